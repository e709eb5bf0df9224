"""The agent APIs' translators without HTTP: request bodies into the chat
template's messages and tools, the response store's byte cap, the field
lists against the request models, and the model-name rule."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Annotated

import pytest
from pydantic import Field

from mlx_kvq.sampling_params import SamplingError, SamplingParams
from mlx_kvq.server.anthropic import schemas as AS
from mlx_kvq.server.anthropic import translate as A
from mlx_kvq.server.chat.job import Refusal
from mlx_kvq.server.errors import APIError, anthropic_error_body
from mlx_kvq.server.fields import FIELDS
from mlx_kvq.server.request_body import check_model_name
from mlx_kvq.server.responses import schemas as RS
from mlx_kvq.server.responses import translate as R
from mlx_kvq.server.responses.store import AgentCounters, ResponseStore
from mlx_kvq.server.settings import ServerSettings


def messages_body(**kw) -> AS.MessagesRequest:
    return AS.MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **kw})


def test_anthropic_history_becomes_template_messages():
    body = messages_body(
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=9f;"},
                {"type": "text", "text": "Be terse."}],  # fmt: skip
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Need a tool.", "signature": "s"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "-3 C"}]},
                {"type": "text", "text": "Thanks"},
            ]},
            {"role": "system", "content": "Mid-conversation note."},
        ],
    )  # fmt: skip
    assert A.template_messages(body) == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning": "Need a tool.",
         "tool_calls": [{"id": "t1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "-3 C"},
        {"role": "user", "content": "Thanks"},
        {"role": "system", "content": "Mid-conversation note."},
    ]  # fmt: skip


def test_anthropic_tools_and_tool_choice():
    tools = [AS.Tool.model_validate({"name": "f", "description": "d", "defer_loading": True,
                                     "input_schema": {"type": "object"}})]  # fmt: skip
    assert A.template_tools(tools) == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                          "description": "d"}}]  # fmt: skip
    assert A.tool_policy(None).parse and not A.tool_policy(AS.ToolChoice(type="none")).render
    assert A.tool_policy(AS.ToolChoice(type="any")).required  # enforced by --tool-format json
    named = A.tool_policy(AS.ToolChoice(type="tool", name="f"))
    assert (named.required, named.name) == (True, "f")
    with pytest.raises(Refusal) as e:
        A.tool_policy(AS.ToolChoice(type="auto", disable_parallel_tool_use=True))
    assert e.value.param == "tool_choice"


def test_anthropic_errors_shape_and_overloaded():
    assert anthropic_error_body(401, "bad key") == (
        401, {"type": "error", "error": {"type": "authentication_error", "message": "bad key"}})  # fmt: skip
    status, body = anthropic_error_body(429, "full", "queue_full")
    assert (status, body["error"]["type"]) == (529, "overloaded_error")


def test_responses_items_become_template_messages_and_reasoning_comes_back():
    opaque = RS.opaque("I should call the tool.")
    body = RS.ResponsesRequest.model_validate({
        "model": "gpt-5", "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Sandbox: read-only."},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": opaque},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Oslo"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "-3 C"},
        ],
    })  # fmt: skip
    messages = R.leading_system(body.instructions, R.input_messages(body))
    assert messages == [
        {"role": "system", "content": "Be brief.\n\nSandbox: read-only."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning": "I should call the tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
    ]  # fmt: skip


def test_responses_tools_namespace_and_hosted():
    counters = AgentCounters(1024)
    body = RS.ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [
        {"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": True},
        {"type": "namespace", "name": "agents", "description": "Sub-agents.",
         "tools": [{"type": "function", "name": "spawn", "description": "Start one."}]},
        {"type": "web_search", "external_web_access": False},
    ]})  # fmt: skip
    tools, namespaces = R.template_tools(body.tools, counters)
    assert [t["function"]["name"] for t in tools] == ["shell", "spawn"]
    assert tools[1]["function"]["description"] == "Sub-agents. Start one."
    assert namespaces == {"spawn": "agents"}
    assert counters.hosted_tools == {"web_search": 1}
    with pytest.raises(ValueError, match="not supported"):
        RS.ResponsesRequest.model_validate({"model": "m", "tools": [{"type": "teleport"}]})


def test_response_store_is_capped_in_bytes_oldest_out_first():
    store = ResponseStore(max_bytes=600)
    body = {"id": "x", "text": "a" * 150}
    for rid in ("r1", "r2", "r3"):
        assert store.put(rid, {**body, "id": rid}, [{"role": "user", "content": "b" * 50}])
    assert store.get("r1") is None and store.get("r3") is not None
    assert store.bytes <= 600 and store.evictions >= 1
    assert not store.put("huge", {"text": "c" * 1000}, [])
    assert store.delete("r3") and not store.delete("r3")


def test_field_lists_match_the_request_models():
    assert set(AS.MessagesRequest.model_fields) == set(FIELDS["messages"])
    assert set(RS.ResponsesRequest.model_fields) == set(FIELDS["responses"])
    with pytest.raises(ValueError, match="frobnicate"):
        AS.MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "frobnicate": 1,
                                           "messages": [{"role": "user", "content": "x"}]})  # fmt: skip


def test_model_names_checked_only_with_served_model_name():
    calls = []
    rejecter = SimpleNamespace(reject=lambda *a, **k: calls.append(a) or APIError(*a, **k))
    check_model_name("claude-opus", ServerSettings(model_id="mine"), rejecter, strict=False)
    with pytest.raises(APIError):
        check_model_name("claude-opus", ServerSettings(model_id="mine", names_checked=True),
                         rejecter, strict=False)  # fmt: skip
    check_model_name("mine", ServerSettings(model_id="mine", names_checked=True), rejecter, False)
    assert [c[0] for c in calls] == [404]


def test_sampling_defaults_come_from_the_server_and_logit_bias_is_checked_once():
    defaults = SamplingParams(max_tokens=77, temperature=0.5)
    body = RS.ResponsesRequest.model_validate({"model": "m", "input": "hi", "top_p": 0.9})
    params = body.to_sampling_params(defaults)
    assert (params.max_tokens, params.temperature, params.top_p) == (77, 0.5, 0.9)
    assert params.repetition_context_size == 20  # SamplingParams' own default
    user = [{"role": "user", "content": "hi"}]
    bias = messages_body(messages=user).to_sampling_params(defaults)
    bias = bias.updated(logit_bias=((10, 1.0),))
    bias.check_vocabulary(11)
    with pytest.raises(SamplingError, match="outside the vocabulary") as e:
        bias.check_vocabulary(10)
    assert e.value.field == "logit_bias"


def test_opaque_reasoning_round_trip():
    value = RS.opaque("think ✓")
    item = RS.ReasoningItem.model_validate({"type": "reasoning", "encrypted_content": value})
    assert RS.reasoning_of(item) == "think ✓"
    other = RS.ReasoningItem.model_validate({"type": "reasoning", "encrypted_content": "gAAA",
                                             "summary": [{"type": "summary_text",
                                                          "text": "sum"}]})  # fmt: skip
    assert RS.reasoning_of(other) == "sum"
    assert json.loads(json.dumps(value)) == value


def test_docs_list_every_field_with_its_treatment():
    from pathlib import Path

    from mlx_kvq.server.fields import Treatment

    text = (Path(__file__).resolve().parents[1] / "docs" / "agents.md").read_text()
    words = {Treatment.HONOURED: "honoured", Treatment.APPROXIMATE: "approximately",
             Treatment.REFUSED: "400", Treatment.IGNORED: "no effect"}  # fmt: skip
    for heading, fields in (("`POST /v1/messages` fields", FIELDS["messages"]),
                            ("`POST /v1/responses` fields", FIELDS["responses"])):  # fmt: skip
        section = text[text.index(heading) :].split("\n### ")[0]
        rows = {line.split("|")[1].strip().strip("`"): line.split("|")[2].strip()
                for line in section.splitlines() if line.startswith("| `")}  # fmt: skip
        assert {k: words[d.treatment] for k, d in fields.items()} == rows


def test_mid_conversation_system_turns_folded_for_templates_that_refuse_them():
    from mlx_kvq.server.chat.system_turns import fold_system, renders_mid_system

    class Refusing:
        def apply_chat_template(self, messages, **kw):
            if any(m["role"] == "system" for m in messages[1:]):
                raise ValueError("System message must be at the beginning")
            return "ok"

    class Rendering:
        def apply_chat_template(self, messages, **kw):
            return "".join(m["content"] for m in messages)

    assert not renders_mid_system(Refusing()) and renders_mid_system(Rendering())
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                {"role": "system", "content": "note"}, {"role": "user", "content": "b"},
                {"role": "tool", "tool_call_id": "c", "content": "r"},
                {"role": "system", "content": "late"}]  # fmt: skip
    assert fold_system(messages) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "a"},
        {"role": "user", "content": "note\n\nb"},
        {"role": "tool", "tool_call_id": "c", "content": "r"},
        {"role": "user", "content": "late"},
    ]  # fmt: skip
    users = [{"role": "user", "content": "hi"}] * 3  # user turns alone are left as they are
    assert fold_system(users) == users


def test_anthropic_prefill_is_refused():
    body = messages_body(messages=[{"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "The answer is"}])  # fmt: skip
    with pytest.raises(Refusal, match="prefill"):
        A.to_job(body, SimpleNamespace(reads=lambda name: False))


def test_a_sampling_field_declared_in_a_schema_reaches_the_sampler():
    """Anthropic's Messages API has no `min_p`: declaring it in the schema is
    all an API needs to take a `SamplingParams` field (no translator edit),
    and the value reaches the engine's sampler."""
    import mlx.core as mx

    from mlx_kvq.engine.sampling import SamplerPool

    class WithMinP(AS.MessagesRequest):
        min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None

    user = [{"role": "user", "content": "hi"}]
    service = SimpleNamespace(settings=ServerSettings(model_id="m"), reads=lambda _: False)
    body = WithMinP.model_validate(
        {"model": "m", "max_tokens": 8, "messages": user, "temperature": 1.0, "min_p": 0.5}
    )
    params = A.to_job(body, service).sampling
    assert (params.min_p, params.temperature, params.max_tokens) == (0.5, 1.0, 8)
    # token 1 has a third of token 0's probability: min_p 0.5 never draws it
    logprobs = mx.log(mx.array([[0.6, 0.2, 0.2]]))
    pool = SamplerPool()
    draws = {pool.get(params.updated(seed=s))(logprobs).item() for s in range(40)}
    without = {pool.get(params.updated(seed=s, min_p=0.0))(logprobs).item() for s in range(40)}
    assert draws == {0} and without == {0, 1, 2}


def test_a_system_turns_output_config_is_the_requests_own():
    """Claude Code 2.1 sends `output_config` inside a system-role turn of `messages`."""
    turn = {"role": "system", "content": "Be brief.", "output_config": {"effort": "medium"}}
    user = {"role": "user", "content": "Hi"}
    service = SimpleNamespace(reads=lambda name: name == "reasoning_effort")
    body = messages_body(messages=[user, turn, user])
    assert A.template_args(body, service) == {"reasoning_effort": "medium"}
    assert A.template_messages(body)[1] == {"role": "system", "content": "Be brief."}
    top = messages_body(messages=[user, turn, user], output_config={"effort": "low"})
    assert A.template_args(top, service) == {"reasoning_effort": "low"}  # the request's own first
    assert A.template_args(body, SimpleNamespace(reads=lambda name: False)) == {}
    formatted = {**turn, "output_config": {"format": {"type": "json_schema"}}}
    with pytest.raises(Refusal) as e:
        A.template_args(messages_body(messages=[user, formatted, user]), service)
    assert e.value.param == "output_config"
    with pytest.raises(ValueError, match="system turns only"):
        messages_body(messages=[{**user, "output_config": {"effort": "low"}}])

"""The generic tool format (`--tool-format json`) for models whose chat
template renders no tools.

Units: the system block and the rewritten history, the grammar (plain text
or one call; only the call when one is required), and the reading of an
answer. Then the official `anthropic` and `openai` SDKs against `mlx-kvq
serve --tool-format json` on a scripted model with the `plain` template
(no tools in it): asked about the weather it writes the JSON call; once the
tool's result is in the prompt it answers in text. The real Gemma 3 270M's
answer in this format is checked in tests/test_real_models.py, on the
server that test starts anyway.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import llguidance
import llguidance.hf
import pytest
from kvq_testing.scripted import save_scripted_model
from kvq_testing.server import ServerProcess
from mlx_lm.utils import load_tokenizer

from mlx_kvq.mlx_lm_internals import hf_tokenizer
from mlx_kvq.server.chat import json_tools as J

KEY = "sk-generic-tools"
CALL = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
SCRIPT = {  # the last trigger present wins: "weather" is in every prompt (get_weather)
    "weather": [CALL],
    "capital": ["Paris is the capital of France."],
    "zorblax": ["It is sunny in Paris."],  # the tool's result is in the prompt
}
WEATHER = "What is the weather in Paris?"
RESULT = "zorblax: 18 C"
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "Conditions in a city",
                                           "parameters": PARAMETERS}}]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_scripted_model(tmp_path_factory.mktemp("generic") / "m", SCRIPT, template="plain")


# -- units ------------------------------------------------------------------------------
def test_the_history_is_rewritten_for_a_template_without_tools():
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": WEATHER},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "user", "content": "Thanks"},
    ]
    out = J.conversation(messages, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    system = out[0]["content"]
    assert system.startswith("You can call these tools") and system.endswith("Be terse.")
    assert json.loads(system.splitlines()[1]) == TOOLS[0]["function"]
    assert json.loads(out[2]["content"]) == json.loads(CALL)
    result, thanks = out[3]["content"].split("\n\n")
    assert json.loads(result) == {"tool_response": {"name": "get_weather", "content": "18 C"}}
    assert thanks == "Thanks" and messages[2]["tool_calls"] == [call]  # the input is unchanged
    assert J.conversation([{"role": "user", "content": "hi"}], TOOLS)[0]["role"] == "system"


def accepts(tokenizer, grammar: str, text: str) -> bool:
    lt = llguidance.hf.from_tokenizer(
        hf_tokenizer(tokenizer), eos_token=list(tokenizer.eos_token_ids)
    )
    matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def test_the_grammar_takes_text_or_one_call_to_a_tool(model_dir):
    tokenizer = load_tokenizer(model_dir)
    free, required = J.grammar(TOOLS), J.grammar(TOOLS, required=True)
    assert accepts(tokenizer, free, "Paris is the capital of France.")
    assert accepts(tokenizer, free, "\n" + CALL) and accepts(tokenizer, required, CALL)
    assert not accepts(tokenizer, required, "Paris is the capital of France.")
    assert not accepts(tokenizer, free, CALL.replace("get_weather", "get_time"))
    assert not accepts(tokenizer, free, CALL + " and more")
    assert not accepts(tokenizer, free, '{"tool_call": {"name": "get_weather", "arguments": {}}}')
    with pytest.raises(ValueError, match="get_time"):
        J.grammar(TOOLS, name="get_time")


def test_a_call_takes_only_the_declared_arguments_unless_its_schema_opens_them(model_dir):
    tokenizer = load_tokenizer(model_dir)
    extra = CALL.replace('"Paris"', '"Paris", "type": "object"')
    assert not accepts(tokenizer, J.grammar(TOOLS, required=True), extra)
    nested = {
        "type": "object",
        "required": ["where"],
        "properties": {"where": {"type": "object", "properties": {"city": {"type": "string"}}}},
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": nested}}]
    call = '{"tool_call": {"name": "get_weather", "arguments": {"where": {"city": "Paris"%s}}}}'
    assert accepts(tokenizer, J.grammar(tools, required=True), call % "")
    assert not accepts(tokenizer, J.grammar(tools, required=True), call % ', "unit": "C"')
    opened = {**PARAMETERS, "additionalProperties": True}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": opened}}]
    assert accepts(tokenizer, J.grammar(tools, required=True), extra)
    both = {"allOf": [{"type": "object", "properties": {"city": {"type": "string"}}},
                      {"type": "object", "properties": {"unit": {"type": "string"}}}]}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": both}}]
    with_unit = CALL.replace('"Paris"', '"Paris", "unit": "C"')
    assert accepts(tokenizer, J.grammar(tools, required=True), with_unit)  # allOf's keys add up
    assert PARAMETERS == {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}  # the client's schema is not changed  # fmt: skip


def test_an_answer_is_read_as_text_or_one_call():
    out = J.JsonToolOutput(streaming=True)
    pieces = [out.feed(t) for t in ("\n", CALL[:10], CALL[10:])]
    assert not any(pieces)  # a call is held to its end
    delta, reason = out.finish("stop")
    (call,) = delta.tool_calls
    assert reason == "tool_calls" and call["index"] == 0 and delta.content == ""
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    out = J.JsonToolOutput(streaming=False)
    assert out.feed(" ").content == "" and out.feed("It is").content == " It is"
    assert out.feed(" sunny").content == " sunny" and out.finish("stop")[1] == "stop"

    cut = J.JsonToolOutput(streaming=False)
    cut.feed(CALL[:20])
    delta, reason = cut.finish("length")  # max_tokens cut the call: its text stays
    assert (delta.content, delta.tool_calls, reason) == (CALL[:20], [], "length")


# -- the SDKs against a server ------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, "--max-tokens", "64", "--tool-format", "json",
                       api_key=KEY) as s:  # fmt: skip
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Conditions in a city",
                    "input_schema": PARAMETERS}]  # fmt: skip


def test_anthropic_sdk_gets_tool_use_then_text(claude):
    ask = [{"role": "user", "content": WEATHER}]
    first = claude.messages.create(model="m", max_tokens=64, messages=ask, tools=ANTHROPIC_TOOLS)
    (call,) = first.content
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert first.stop_reason == "tool_use"
    messages = ask + [
        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": RESULT}]},
    ]  # fmt: skip
    second = claude.messages.create(model="m", max_tokens=64, messages=messages,
                                    tools=ANTHROPIC_TOOLS)  # fmt: skip
    assert [(b.type, b.text) for b in second.content] == [("text", "It is sunny in Paris.")]
    assert second.stop_reason == "end_turn"
    assert second.usage.cache_read_input_tokens > 0  # the history rendered as the first prompt

    with claude.messages.stream(model="m", max_tokens=64, messages=ask,
                                tools=ANTHROPIC_TOOLS) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert [(b.type, b.input) for b in final.content] == [("tool_use", {"city": "Paris"})]
    required = claude.messages.create(model="m", max_tokens=64, messages=ask,
                                      tools=ANTHROPIC_TOOLS,
                                      tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    assert required.content[0].input == {"city": "Paris"}


def test_openai_sdk_chat_and_responses_get_calls_and_text(server):
    oai = server.client()
    ask = [{"role": "user", "content": WEATHER}]
    r = oai.chat.completions.create(model="default_model", messages=ask, tools=TOOLS)
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                        {"city": "Paris"})  # fmt: skip
    messages = ask + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": RESULT}]  # fmt: skip
    r = oai.chat.completions.create(model="default_model", messages=messages, tools=TOOLS)
    assert r.choices[0].message.content == "It is sunny in Paris."
    stream = oai.chat.completions.create(model="default_model", messages=ask, tools=TOOLS,
                                         stream=True, tool_choice="required")  # fmt: skip
    calls = [c for chunk in stream for d in chunk.choices for c in d.delta.tool_calls or ()]
    assert [c.function.name for c in calls] == ["get_weather"]
    plain = oai.chat.completions.create(
        model="default_model", tools=TOOLS, messages=[{"role": "user", "content": "The capital?"}]
    )
    assert plain.choices[0].message.content == "Paris is the capital of France."

    tools = [{"type": "function", **{k: v for k, v in TOOLS[0]["function"].items()}}]
    response = oai.responses.create(model="m", input=WEATHER, tools=tools)
    (item,) = response.output
    assert (item.type, item.name, json.loads(item.arguments)) == ("function_call",
                                                                  "get_weather",
                                                                  {"city": "Paris"})  # fmt: skip


def test_what_the_generic_format_cannot_combine_is_refused(server):
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"messages": [{"role": "user", "content": WEATHER}], "tools": TOOLS,
            "response_format": {"type": "json_object"}}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", headers=h, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    body = {**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    del body["response_format"]
    r = httpx.post(server.url + "/v1/chat/completions", headers=h, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


# -- a real model whose template renders no tools ---------------------------------------

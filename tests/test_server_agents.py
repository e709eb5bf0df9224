"""The agent APIs with the official clients: Anthropic's Messages (`anthropic`
SDK) and OpenAI's Responses (`openai` SDK) against a real `mlx-kvq serve`.

The model is scripted (kvq_testing.scripted, Qwen3-style template): asked
about the weather it reasons, then calls `get_weather`; once the tool's
result is in the prompt it reasons again and answers. Checked, streaming and
not: the call arrives as a `tool_use` block / `function_call` item with
parsed arguments, no reasoning or tool markup leaks into text, a tool result
sent back reaches the next prompt, `count_tokens` equals the usage, a wrong
key gets Anthropic's 401 shape, and `previous_response_id` continues a
conversation.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from kvq_testing.scripted import save_scripted_model
from kvq_testing.server import ServerProcess

KEY = "sk-agents-test"
TOOL_TEXT = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
SCRIPT = {
    "zebracorn": ["The secret word is ", "mango", "."],
    "countdown": ["three, two, ", "STOP", " one"],
    "weather": [
        "<think>",
        "\nThe user wants the weather.\n",
        "</think>",
        "<tool_call>",
        TOOL_TEXT,
        "</tool_call>",
    ],  # fmt: skip
    "<tool_response>": ["<think>", "\nThe tool answered.\n", "</think>", "\n\nIt is sunny."],
}
WEATHER = "What is the weather in Paris?"
ANTHROPIC_TOOLS = [
    {
        "name": "get_weather",
        "description": "Current conditions in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current conditions in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": False,
    },
    {"type": "web_search"},
]
MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_scripted_model(tmp_path_factory.mktemp("agents") / "m", SCRIPT, arch="llama")


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, "--max-tokens", "64", api_key=KEY) as s:
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return server.client()


def no_markup(text: str) -> None:
    assert not any(m in text for m in MARKUP), text


# -- Anthropic Messages ---------------------------------------------------------------
def weather_messages() -> list[dict]:
    return [{"role": "user", "content": WEATHER}]


def test_messages_tool_call(claude):
    m = claude.messages.create(model="claude-sonnet-4-5", max_tokens=64,
                               messages=weather_messages(), tools=ANTHROPIC_TOOLS)  # fmt: skip
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    assert m.content[0].thinking == "The user wants the weather.\n"
    call = m.content[1]
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    assert m.stop_reason == "tool_use"
    assert m.usage.output_tokens == 7  # six pieces and the EOS
    count = claude.messages.count_tokens(model="claude-sonnet-4-5",
                                         messages=weather_messages(), tools=ANTHROPIC_TOOLS)  # fmt: skip
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


def test_messages_tool_result_reaches_the_next_prompt(claude):
    first = claude.messages.create(model="claude-sonnet-4-5", max_tokens=64,
                                   messages=weather_messages(), tools=ANTHROPIC_TOOLS)  # fmt: skip
    call = first.content[-1]
    messages = weather_messages() + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "22 C, clear"}],
        },  # fmt: skip
    ]
    m = claude.messages.create(model="claude-sonnet-4-5", max_tokens=64, messages=messages,
                               tools=ANTHROPIC_TOOLS)  # fmt: skip
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[1].text == "It is sunny."
    assert m.stop_reason == "end_turn"
    # the second prompt starts with the first: its prefix came from the prompt cache
    assert m.usage.cache_read_input_tokens > 0
    count = claude.messages.count_tokens(model="x", messages=messages, tools=ANTHROPIC_TOOLS)
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_messages_stream(claude):
    with claude.messages.stream(model="claude-opus-4-1", max_tokens=64,
                                messages=weather_messages(), tools=ANTHROPIC_TOOLS,
                                thinking={"type": "adaptive"}) as stream:  # fmt: skip
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "message_delta" in events
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[0].thinking == "The user wants the weather.\n"
    assert final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"


def test_messages_stream_events_have_event_lines(server):
    body = {"model": "m", "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": "zebracorn?"}]}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", json=body,
                      headers={"x-api-key": KEY}, timeout=60) as r:  # fmt: skip
        text = "".join(r.iter_text())
    events = [line[len("event: ") :] for line in text.splitlines() if line.startswith("event: ")]
    assert "ping" in events  # sent while the prompt was read
    events = [e for e in events if e != "ping"]
    assert events == ["message_start", "content_block_start", *["content_block_delta"] * 3,
                      "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    deltas = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    said = "".join(d["delta"]["text"] for d in deltas if d["type"] == "content_block_delta")
    assert said == "The secret word is mango."


def test_messages_system_stop_sequences_and_billing_header(claude):
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=abc12;"},
              {"type": "text", "text": "You count.", "cache_control": {"type": "ephemeral"}}]  # fmt: skip
    m = claude.messages.create(model="m", max_tokens=64, system=system,
                               messages=[{"role": "user", "content": "countdown"}],
                               stop_sequences=["STOP"])  # fmt: skip
    assert m.content[0].text == "three, two, "
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "STOP")
    # the billing header's nonce does not reach the prompt: another nonce, the same count
    other = [{**system[0], "text": "x-anthropic-billing-header: cc_version=2; cch=zz999;"},
             system[1]]  # fmt: skip
    counts = {claude.messages.count_tokens(model="m", system=s,
                                           messages=[{"role": "user", "content": "countdown"}],
                                           ).input_tokens for s in (system, other)}  # fmt: skip
    assert len(counts) == 1


def test_messages_max_tokens_beyond_the_context(claude):
    m = claude.messages.create(model="m", max_tokens=10_000_000,
                               messages=[{"role": "user", "content": "zebracorn"}])  # fmt: skip
    assert m.content[0].text == "The secret word is mango."


def test_messages_max_tokens_cut(claude):
    m = claude.messages.create(model="m", max_tokens=2,
                               messages=[{"role": "user", "content": "zebracorn"}])  # fmt: skip
    assert (m.stop_reason, m.content[0].text) == ("max_tokens", "The secret word is mango")


def test_messages_wrong_key_gets_anthropic_401(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 401
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"


def test_messages_unknown_field_and_image_are_400(server):
    h = {"x-api-key": KEY}
    r = httpx.post(server.url + "/v1/messages", headers=h, json={
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
        "frobnicate": 1})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "frobnicate" in r.json()["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    r = httpx.post(server.url + "/v1/messages", headers=h, json={
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [image]}]})  # fmt: skip
    assert r.status_code == 400 and "image" in r.json()["error"]["message"]


# -- OpenAI Responses ------------------------------------------------------------------
def test_responses_tool_call_and_continuation(oai):
    r = oai.responses.create(model="gpt-5", input=WEATHER, tools=RESPONSES_TOOLS,
                             include=["reasoning.encrypted_content"], store=True)  # fmt: skip
    assert [i.type for i in r.output] == ["reasoning", "function_call"]
    assert r.output[0].summary[0].text == "The user wants the weather.\n"
    assert r.output[0].encrypted_content
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert r.status == "completed" and r.usage.output_tokens == 7
    assert r.output_text == ""
    # the tool's result, sent with previous_response_id: the conversation continues
    r2 = oai.responses.create(model="gpt-5", previous_response_id=r.id, tools=RESPONSES_TOOLS,
                              input=[{"type": "function_call_output", "call_id": call.call_id,
                                      "output": "22 C, clear"}])  # fmt: skip
    assert r2.output_text == "It is sunny."
    assert r2.usage.input_tokens_details.cached_tokens > 0
    assert oai.responses.retrieve(r.id).id == r.id
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)


def test_responses_full_history_without_store(oai):
    """Codex's way: store false, the whole history (with the opaque reasoning) every turn."""
    first = oai.responses.create(model="gpt-5", input=WEATHER, tools=RESPONSES_TOOLS,
                                 store=False, include=["reasoning.encrypted_content"])  # fmt: skip
    history = [{"role": "developer", "content": "Be brief."},
               {"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": WEATHER}]}]  # fmt: skip
    history += [i.model_dump(exclude_none=True) for i in first.output]
    call = first.output[-1]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "22 C"})
    r = oai.responses.create(model="gpt-5", input=history, tools=RESPONSES_TOOLS, store=False)
    assert r.output_text == "It is sunny."
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)


def test_responses_stream(oai):
    events = list(oai.responses.create(model="gpt-5", input=WEATHER, tools=RESPONSES_TOOLS,
                                       stream=True))  # fmt: skip
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.reasoning_summary_text.delta" in types
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done[0].arguments) == {"city": "Paris"}
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "function_call"]


def test_responses_stream_text(oai):
    events = list(oai.responses.create(model="m", input="zebracorn", stream=True,
                                       max_output_tokens=2))  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "The secret word is mango"
    no_markup(deltas)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_responses_unknown_previous_id_is_404(oai):
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="m", input="hi", previous_response_id="resp_nope")


def test_hosted_tools_counted_and_store_in_metrics(server, oai):
    oai.responses.create(model="m", input="zebracorn", tools=RESPONSES_TOOLS, store=True)
    m = server.metrics()
    assert m['mlx_kvq_hosted_tools_ignored_total{type="web_search"}'] >= 1
    assert m["mlx_kvq_response_store_bytes"] > 0


def test_new_routes_in_openapi(server):
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
                 "/v1/responses/{response_id}"):  # fmt: skip
        assert path in paths


# -- the OpenAI Agents SDK (its default model speaks the Responses API) ----------------
def test_openai_agents_sdk_runs_a_tool(server, monkeypatch):
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    agents = pytest.importorskip("agents")
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current conditions in a city."""
        calls.append(city)
        return "22 C, clear"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    model = agents.OpenAIResponsesModel(model="default_model", openai_client=client)
    agent = agents.Agent(name="a", instructions="Be brief.", tools=[get_weather], model=model)
    result = agents.Runner.run_sync(agent, WEATHER)
    assert calls == ["Paris"]
    assert result.final_output == "It is sunny."

"""`mlx-kvq serve` as a drop-in for `mlx_lm.server`, end to end.

Both servers run as real processes on the same scripted model
(kvq_testing.scripted: a hybrid gemma3_text with sliding windows and a
Qwen3-style template, whose greedy reply the script chooses), and the
official `openai` client sends them the same requests: tool calls (plain
and streamed, and a history carrying a call and its result), reasoning
(plain and streamed), each penalty, `logit_bias` and XTC give the same
answer from both. Then mlx-kvq alone: `tool_choice: "none"`, the paths
without `/v1`, keep-alive comments during a long prefill, `logprobs` and
`max_completion_tokens` on completions, `response_format`, a walk over every
request field asserting its treatment, and a fuzz run of bodies generated
from `/openapi.json` (no 5xx, the server alive and unchanged afterwards).
"""

from __future__ import annotations

import collections
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvq_testing.schema_bodies import from_schema, mutated
from kvq_testing.scripted import Reply, save_scripted_model, token_id
from kvq_testing.server import MlxLmServerProcess, ServerProcess

from mlx_kvq.server.fields import FIELDS, Treatment

MAX_TOKENS = 12
LOOP = "ticktock" * (MAX_TOKENS // 2)
TOOL_TEXT = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
SCRIPT = {
    "capital": ["Paris is the capital of France."],
    "weather": ["<tool_call>", TOOL_TEXT, "</tool_call>"],
    "<tool_response>": ["It is sunny in Paris."],
    "riddle": ["<think>", "\nCount the legs.\n", "</think>", "\n\nA spider."],
    "clock": Reply(["tick", "tock", "done"], extra={("tock", "tick"): 20.5}),
    "jason": ["{", '"city"', ": ", '"Paris"', "}"],
    "spaced": [" lead", " space"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current conditions in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CLOCK = "What does the clock say?"
WEATHER = "What is the weather in Paris?"
RIDDLE = "Here is a riddle."
# request fields -> what the clock says (tick 20.5 against done 20 after tock)
LOOP_BREAKS = {
    "repetition": ({"repetition_penalty": 1.1}, "ticktockdone"),
    "repetition, context 1": ({"repetition_penalty": 1.1, "repetition_context_size": 1}, LOOP),
    "presence": ({"presence_penalty": 1.0}, "ticktockdone"),
    "presence, context 1": ({"presence_penalty": 1.0, "presence_context_size": 1}, LOOP),
    "frequency": ({"frequency_penalty": 0.2}, "ticktock" * 3 + "done"),
    "frequency, context 4": ({"frequency_penalty": 0.2, "frequency_context_size": 4}, LOOP),
    "bias": ({"logit_bias": {"done": 1.0}}, "ticktockdone"),
    "bias against": ({"logit_bias": {"tick": -1.0}}, "ticktockdone"),
    # XTC cuts tick (p 0.62) when done (p 0.38) is above the threshold too;
    # at temperature 0.02 sampling alone says tick (done's chance is e**-25)
    "xtc": ({"xtc_probability": 1.0, "xtc_threshold": 0.1, "temperature": 0.02}, "ticktockdone"),
    "xtc, high threshold": (
        {"xtc_probability": 1.0, "xtc_threshold": 0.5, "temperature": 0.02},
        LOOP,
    ),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_scripted_model(tmp_path_factory.mktemp("dropin") / "m", SCRIPT, arch="hybrid")


@pytest.fixture(scope="module")
def servers(model_dir):
    """(mlx-kvq serve, mlx_lm.server) on the same model, started together."""
    ours = ServerProcess(model_dir, "--max-tokens", "24", "--prefill-step-size", "32")
    theirs = MlxLmServerProcess(model_dir, "--max-tokens", "24")
    with ours, theirs:
        ours.wait_ready()
        theirs.wait_ready()
        yield ours, theirs


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def by_piece(model_dir, fields: dict) -> dict:
    """`fields` with logit_bias keyed by token id instead of piece."""
    if "logit_bias" not in fields:
        return fields
    bias = {p if p.isdigit() else str(token_id(model_dir, p)): b
            for p, b in fields["logit_bias"].items()}  # fmt: skip
    return {**fields, "logit_bias": bias}


def chat(server, messages, stream=False, **kw):
    """(content, reasoning, [(name, arguments)], finish_reason) from the openai client."""
    client = server.client()
    kw.setdefault("max_tokens", MAX_TOKENS)
    extra = {k: kw.pop(k) for k in list(kw) if k not in ("max_tokens", "tools", "tool_choice",
                                                          "temperature", "logit_bias")}  # fmt: skip
    r = client.chat.completions.create(
        model="default_model", messages=messages, stream=stream, extra_body=extra or None, **kw
    )
    if not stream:
        m = r.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        return m.content, getattr(m, "reasoning", None), calls, r.choices[0].finish_reason
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in r:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning", None) or ""
        for c in delta.tool_calls or []:
            name, args = calls.get(c.index, ("", ""))
            calls[c.index] = (name + (c.function.name or ""), args + (c.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    calls = [(name, json.loads(args)) for _, (name, args) in sorted(calls.items())]
    return content or None, reasoning or None, calls, finish


# -- the same answers as mlx_lm.server ---------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_as_mlx_lm_server(servers, stream):
    answers = [chat(s, user(WEATHER), stream, tools=TOOLS) for s in servers]
    assert answers[0] == answers[1] == (
        None, None, [("get_weather", {"city": "Paris"})], "tool_calls"
    )  # fmt: skip


def test_a_tool_result_in_history_as_mlx_lm_server(servers):
    """The assistant's call comes back with its arguments as a JSON string (as
    OpenAI clients send it), then the tool's result."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    history = user(WEATHER) + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, clear sky"},
    ]
    answers = [chat(s, history, tools=TOOLS) for s in servers]
    assert answers[0] == answers[1] == ("It is sunny in Paris.", None, [], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_as_mlx_lm_server(servers, stream):
    answers = [chat(s, user(RIDDLE), stream) for s in servers]
    assert answers[0] == answers[1] == ("\n\nA spider.", "\nCount the legs.\n", [], "stop")


@pytest.mark.parametrize("case", list(LOOP_BREAKS))
def test_penalties_bias_and_xtc_as_mlx_lm_server(servers, model_dir, case):
    fields, want = LOOP_BREAKS[case]
    fields = by_piece(model_dir, fields)
    answers = [chat(s, user(CLOCK), **fields)[0] for s in servers]
    assert answers == [want, want]


def test_without_processors_the_clock_loops_on_both(servers):
    assert [chat(s, user(CLOCK))[0] for s in servers] == [LOOP, LOOP]


# -- mlx-kvq's own answers -------------------------------------------------------------
def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


def test_tool_choice_none_renders_no_tools_and_parses_no_calls(server):
    content, _, calls, finish = chat(server, user(WEATHER), tools=TOOLS, tool_choice="none")
    assert content == "<tool_call>" + TOOL_TEXT + "</tool_call>" and not calls
    assert finish == "stop"
    base = {"messages": user(WEATHER), "max_tokens": 1}
    plain = post(server, "/v1/chat/completions", base).json()["usage"]["prompt_tokens"]
    none = post(server, "/v1/chat/completions", {**base, "tools": TOOLS, "tool_choice": "none"})
    auto = post(server, "/v1/chat/completions", {**base, "tools": TOOLS})
    assert none.json()["usage"]["prompt_tokens"] == plain < auto.json()["usage"]["prompt_tokens"]


def test_paths_without_v1(servers):
    ours, theirs = servers
    body = {"messages": user("The capital?"), "max_tokens": MAX_TOKENS}
    for server in servers:
        r = post(server, "/chat/completions", body)
        assert r.json()["choices"][0]["message"]["content"] == "Paris is the capital of France."
    r = post(ours, "/completions", {"prompt": "The capital?", "max_tokens": MAX_TOKENS})
    assert r.json()["choices"][0]["text"] == "Paris is the capital of France."


def sse_lines(server, path, body) -> list[str]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def sse_chunks(server, path, body) -> list[dict]:
    lines = sse_lines(server, path, body)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1] if line.startswith("data: ")]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_carries_usage_only_when_asked(servers, path):
    """As OpenAI and mlx_lm.server: without `stream_options.include_usage` no
    chunk has `usage`; with it, one last chunk with no choices has it."""
    body = {"messages": user(CLOCK)} if "chat" in path else {"prompt": CLOCK}
    body["max_tokens"] = 4
    for server in servers:
        assert not [c for c in sse_chunks(server, path, body) if "usage" in c]
    chunks = sse_chunks(servers[0], path, {**body, "stream_options": {"include_usage": True}})
    assert [c for c in chunks if "usage" in c] == [chunks[-1]] and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4


def test_models_retrieve_by_id(server):
    """The openai client's `models.retrieve` (GET /v1/models/{id}) answers the served model."""
    client = server.client()
    served = client.models.list().data[0]
    assert client.models.retrieve(served.id).model_dump() == served.model_dump()
    r = httpx.get(server.url + "/v1/models/no-such-model", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_completion_text_offsets_point_into_the_text(server):
    """`text_offset` indexes the returned text, streamed or not, also when the
    detokenizer drops the first token's leading space (as mlx_lm.server's does)."""
    body = {"prompt": "spaced", "max_tokens": 4, "logprobs": 1}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text == "lead space" and lp["tokens"] == [" lead", " space"]
    assert text[lp["text_offset"][1] :] == " space"
    streamed = [c["choices"][0]["logprobs"] for c in sse_chunks(server, "/v1/completions", body)]
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]


def test_keepalive_comments_during_a_long_prefill(servers):
    """mlx_lm.server's `: keepalive N/M` after each prefill step (32 tokens here)."""
    ours, theirs = servers
    body = {"messages": user("The capital? " + "Lorem ipsum dolor sit amet. " * 30),
            "max_tokens": MAX_TOKENS}  # fmt: skip
    lines = sse_lines(ours, "/v1/chat/completions", body)
    progress = [tuple(map(int, m.groups())) for line in lines
                if (m := re.fullmatch(r": keepalive (\d+)/(\d+)", line))]  # fmt: skip
    assert len(progress) >= 5 and progress == sorted(progress)
    assert progress[-1][0] == progress[-1][1]
    first_token = next(i for i, line in enumerate(lines) if "Paris" in line)
    assert all(lines.index(f": keepalive {p}/{t}") < first_token for p, t in progress)
    theirs_lines = sse_lines(theirs, "/v1/chat/completions", body)
    assert any(line.startswith(": keepalive ") for line in theirs_lines)


def test_completions_take_logprobs_true_and_max_completion_tokens(servers):
    for server in servers:
        body = {"prompt": CLOCK, "max_tokens": 12, "max_completion_tokens": 4, "logprobs": True}
        r = post(server, "/v1/completions", body).json()
        assert r["choices"][0]["text"] == "ticktockticktock"
        assert r["usage"]["completion_tokens"] == 4
        assert r["choices"][0]["logprobs"]  # each server in its own shape
    r = post(servers[0], "/v1/completions", body).json()["choices"][0]["logprobs"]
    assert r["tokens"] == ["tick", "tock"] * 2 and len(r["token_logprobs"]) == 4


def test_top_logprobs_without_logprobs_returns_them(server):
    """mlx_lm.server's reading of top_logprobs (OpenAI would want logprobs: true)."""
    body = {"messages": user(CLOCK), "max_tokens": 4, "top_logprobs": 2}
    content = post(server, "/v1/chat/completions", body).json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == ["tick", "tock"] * 2
    assert all(len(e["top_logprobs"]) == 2 for e in content)


def test_response_format(server):
    enum = {"type": "json_schema",
            "json_schema": {"name": "answer", "schema": {"type": "string", "enum": ["yes", "no"]}}}  # fmt: skip
    r = post(
        server, "/v1/chat/completions", {"messages": user("The capital?"), "response_format": enum}
    )
    # the model's own answer is not JSON: the grammar leaves only "no" or "yes",
    # and among them (logits 0) greedy decoding takes the lower id
    assert r.json()["choices"][0]["message"]["content"] == '"no"'
    r = post(server, "/v1/chat/completions",
             {"messages": user("jason"), "response_format": {"type": "json_object"}})  # fmt: skip
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"city": "Paris"}
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    r = post(server, "/v1/chat/completions", {"messages": user("hi"), "response_format": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_logprobs_of_masked_or_overflowing_tokens_are_json(server):
    """A grammar masks tokens to -inf (reported as OpenAI's -9999); a penalty
    of 1e-178 drives logits to infinity (NaN logprobs are reported as null)."""
    enum = {"type": "json_schema",
            "json_schema": {"name": "a", "schema": {"type": "string", "enum": ["no", "yes"]}}}  # fmt: skip
    body = {"messages": user("The capital?"), "response_format": enum, "top_logprobs": 3}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    first = r.json()["choices"][0]["logprobs"]["content"][0]
    assert first["token"] == '"' and [t["logprob"] for t in first["top_logprobs"]][1:] == [
        -9999.0, -9999.0
    ]  # fmt: skip
    body = {"prompt": "0", "logprobs": True, "repetition_penalty": 1e-178, "max_tokens": 2}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text


# -- every field's treatment ---------------------------------------------------------------
def same(r, base) -> bool:
    return (
        r.status_code == 200
        and text_of(r) == text_of(base)
        and (r.json()["usage"]["prompt_tokens"] == base.json()["usage"]["prompt_tokens"])
    )


def text_of(r) -> str:
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def says(text):
    return lambda r, base: r.status_code == 200 and text_of(r) == text


def one_choice(r, base) -> bool:
    return same(r, base) and len(r.json()["choices"]) == 1


def prompt_grows(r, base) -> bool:
    return r.status_code == 200 and (
        r.json()["usage"]["prompt_tokens"] > base.json()["usage"]["prompt_tokens"]
    )


def streams(marker: str):
    def check(r, base):
        return r.status_code == 200 and "data: [DONE]" in r.text and marker in r.text

    return check


def top_entries(n: int):
    def check(r, base):
        lp = r.json()["choices"][0]["logprobs"]
        if "content" in lp:
            return all(len(e["top_logprobs"]) == n for e in lp["content"]) and lp["content"]
        return lp["tokens"] and all(len(t) == n for t in lp["top_logprobs"])

    return check


REFUSED = "400"
SEEDS = range(5)
# field -> cases: (extra body fields, expectation); the expectation is REFUSED
# (a 400 naming the field), `same` (the baseline's answer), or a check.
COMMON_CASES = {
    "model": [({"model": "default_model"}, same), ({"model": "another"}, "404")],
    "max_tokens": [({"max_tokens": 2}, says("ticktock"))],
    "max_completion_tokens": [({"max_completion_tokens": 4}, says("ticktock" * 2))],
    "temperature": [({"temperature": 1.0, "seed": s}, "sampled") for s in SEEDS],
    "top_p": [({"temperature": 1.0, "seed": s, "top_p": 0.5}, says(LOOP)) for s in SEEDS],
    "top_k": [({"temperature": 1.0, "seed": s, "top_k": 1}, says(LOOP)) for s in SEEDS],
    "min_p": [({"temperature": 1.0, "seed": s, "min_p": 0.7}, says(LOOP)) for s in SEEDS],
    "seed": [({"temperature": 1.0, "seed": 3}, "reproducible")],
    "stop": [({"stop": "tock"}, says("tick")), ({"stop": ["x"] * 17}, REFUSED)],
    "stream": [({"stream": True}, streams("tick"))],
    "stream_options": [
        (
            {
                "stream": True,
                "stream_options": {"include_usage": True, "include_obfuscation": True},
            },
            streams('"usage"'),
        ),
        ({"stream_options": {"include_usage": True}}, REFUSED),
    ],  # fmt: skip
    "n": [({"n": 1}, one_choice), ({"n": 2}, REFUSED)],
    "top_logprobs": [({"top_logprobs": 2}, top_entries(2)), ({"top_logprobs": 21}, REFUSED)],
    **{
        field: [(fields, says(want))]
        for field, (fields, want) in {
            "repetition_penalty": LOOP_BREAKS["repetition"],
            "repetition_context_size": LOOP_BREAKS["repetition, context 1"],
            "presence_penalty": LOOP_BREAKS["presence"],
            "presence_context_size": LOOP_BREAKS["presence, context 1"],
            "frequency_penalty": LOOP_BREAKS["frequency"],
            "frequency_context_size": LOOP_BREAKS["frequency, context 4"],
            "logit_bias": LOOP_BREAKS["bias"],
            "xtc_probability": LOOP_BREAKS["xtc"],
            "xtc_threshold": LOOP_BREAKS["xtc, high threshold"],
        }.items()
    },
    "user": [({"user": "someone"}, same)],
    "adapters": [({"adapters": "path/to/adapter"}, REFUSED)],
    "draft_model": [({"draft_model": "path/to/draft"}, REFUSED)],
    "num_draft_tokens": [({"num_draft_tokens": 2}, REFUSED)],
}
COMMON_CASES["logit_bias"].append(({"logit_bias": {"999999": 1.0}}, REFUSED))
COMMON_CASES["xtc_threshold"].append(({"xtc_threshold": 0.6}, REFUSED))
CHAT_CASES = {
    **COMMON_CASES,
    "messages": [
        ({"messages": user("The capital?")}, says("Paris is the capital of France.")),
        ({"messages": [{"role": "wizard", "content": "x"}]}, REFUSED),
    ],
    "logprobs": [({"logprobs": True}, top_entries(0))],
    "tools": [({"tools": TOOLS}, prompt_grows)],
    "tool_choice": [
        ({"tools": TOOLS, "tool_choice": "auto"}, prompt_grows),
        ({"tools": TOOLS, "tool_choice": "none"}, same),  # the tools left out
        ({"tools": TOOLS, "tool_choice": "required"}, REFUSED),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}, REFUSED),
    ],  # fmt: skip
    "parallel_tool_calls": [
        ({"parallel_tool_calls": True}, same),
        ({"parallel_tool_calls": False}, REFUSED),
    ],  # fmt: skip
    "response_format": [
        ({"response_format": {"type": "text"}}, same),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "a",
                        "schema": {"type": "string", "enum": ["no", "yes"]},
                    },
                }
            },
            says('"no"'),
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": 5}},
                }
            },
            REFUSED,
        ),
    ],  # fmt: skip
    "chat_template_kwargs": [
        ({"chat_template_kwargs": {"enable_thinking": False}}, prompt_grows),
        ({"chat_template_kwargs": {"tokenize": False}}, REFUSED),
    ],  # fmt: skip
    "role_mapping": [({"role_mapping": {"user": "Q: "}}, REFUSED)],
    "reasoning_effort": [({"reasoning_effort": "low"}, REFUSED)],
    "verbosity": [({"verbosity": "low"}, REFUSED)],
    "metadata": [({"metadata": {"k": "v"}}, same)],
    "store": [({"store": True}, same)],
    "service_tier": [({"service_tier": "auto"}, same)],
    "prompt_cache_key": [({"prompt_cache_key": "k"}, same)],
    "prompt_cache_options": [({"prompt_cache_options": {"ttl": "30m"}}, same)],
    "prompt_cache_retention": [({"prompt_cache_retention": "24h"}, same)],
    "safety_identifier": [({"safety_identifier": "s"}, same)],
    "prediction": [({"prediction": {"type": "content", "content": "tick"}}, same)],
    "audio": [({"audio": {"voice": "alloy", "format": "wav"}}, REFUSED)],
    "modalities": [({"modalities": ["text"]}, same), ({"modalities": ["text", "audio"]}, REFUSED)],
    "web_search_options": [({"web_search_options": {}}, REFUSED)],
    "moderation": [({"moderation": {"model": "omni-moderation-latest"}}, REFUSED)],
    "functions": [({"functions": [{"name": "f"}]}, REFUSED)],
    "function_call": [({"function_call": "auto"}, REFUSED)],
}
COMPLETION_CASES = {
    **COMMON_CASES,
    "prompt": [
        ({"prompt": "The capital?"}, says("Paris is the capital of France.")),
        ({"prompt": ["a", "b"]}, REFUSED),
    ],
    "logprobs": [({"logprobs": 2}, top_entries(2)), ({"logprobs": True}, top_entries(0))],
    "echo": [({"echo": False}, same), ({"echo": True}, REFUSED)],
    "best_of": [({"best_of": 1}, same), ({"best_of": 2}, REFUSED)],
    "suffix": [({"suffix": ""}, same), ({"suffix": "and then"}, REFUSED)],
}
CASES = {"chat": CHAT_CASES, "completions": COMPLETION_CASES}
BASE = {
    "chat": ("/v1/chat/completions", {"messages": user(CLOCK), "max_tokens": MAX_TOKENS}),
    "completions": ("/v1/completions", {"prompt": CLOCK, "max_tokens": MAX_TOKENS}),
}


# honoured fields whose honoured case needs another model (this one has a chat
# template that reads neither field): where that case is tested
HONOURED_ELSEWHERE = {
    "role_mapping": "test_chat_output.py::test_role_mapping_renders_templateless_models",
    "reasoning_effort": "test_chat_output.py::test_reasoning_effort_reaches_a_template_that_reads_it",
    "verbosity": "test_chat_output.py::test_reasoning_effort_reaches_a_template_that_reads_it",
    # this server loads neither: a 400 here, served in these tests
    "adapters": "test_server_adapters.py::test_adapter_answers_as_in_mlx_lm_server_and_adapters_field",
    "draft_model": "test_server_drafts.py::test_draft_model_serves_requests_speculatively",
    "num_draft_tokens": "test_server_drafts.py::test_draft_model_serves_requests_speculatively",
}


def test_every_field_has_cases_that_show_its_treatment():
    for endpoint in CASES:
        fields = FIELDS[endpoint]
        assert set(CASES[endpoint]) == set(fields), endpoint
        for name, doc in fields.items():
            kinds = {e if isinstance(e, str) else e.__name__ for _, e in CASES[endpoint][name]}
            if doc.treatment is Treatment.REFUSED:
                assert REFUSED in kinds, name
            elif doc.treatment is Treatment.IGNORED:
                assert kinds == {"same"}, name
            else:
                assert kinds - {REFUSED} or name in HONOURED_ELSEWHERE, name


@pytest.mark.parametrize("endpoint", list(CASES))
def test_every_field_walked(server, model_dir, endpoint):
    """Every case of every field, sent together (the server batches them)."""
    path, base_body = BASE[endpoint]
    base = post(server, path, base_body)
    assert text_of(base) == LOOP
    cases = [
        (field, fields, expect) for field, cs in CASES[endpoint].items() for fields, expect in cs
    ]
    bodies = [{**base_body, **by_piece(model_dir, fields)} for _, fields, _ in cases]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda body: post(server, path, body), bodies))
    sampled = []
    for (field, fields, expect), body, r in zip(cases, bodies, answers, strict=True):
        where = f"{endpoint} {field} {fields}"
        if expect == REFUSED:
            assert r.status_code == 400, (where, r.text)
            assert r.json()["error"]["param"] == field, (where, r.text)
        elif expect == "404":
            assert r.status_code == 404 and r.json()["error"]["param"] == field, where
        elif expect == "sampled":
            assert r.status_code == 200, (where, r.text)
            sampled.append(text_of(r))
        elif expect == "reproducible":
            assert text_of(r) == text_of(post(server, path, body)), where
        else:
            assert expect(r, base), (where, r.status_code, r.text[:300])
    assert any(t != LOOP for t in sampled)  # temperature 1 lets done through (p 0.38)
    r = post(server, path, {**base_body, "frobnicate": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate"
    other = "tools" if endpoint == "completions" else "prompt"
    assert post(server, path, {**base_body, other: TOOLS}).json()["error"]["param"] == other


# -- fuzz: bodies generated from /openapi.json ----------------------------------------------
# MLX_KVQ_FUZZ_EXAMPLES=2000 runs the long version; MLX_KVQ_FUZZ_REPORT=FILE
# writes the count of answers by path and status there (docs/reliability.md).
FUZZ_EXAMPLES = int(os.environ.get("MLX_KVQ_FUZZ_EXAMPLES", "40"))
FUZZ_STATUSES: collections.Counter = collections.Counter()
PATHS = ["/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions"]


@pytest.fixture(scope="module")
def openapi(server):
    r = httpx.get(server.url + "/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


def body_schema(doc: dict, path: str) -> dict:
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    name = ref["$ref"].rsplit("/", 1)[1]
    return {**doc["components"]["schemas"][name], "components": doc["components"]}


def bounded(body: dict) -> dict:
    """Keep the run quick: no more than 4 new tokens, streamed or not."""
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int) and not isinstance(body[field], bool):
            body[field] = min(body[field], 4)
    body.setdefault("max_tokens", 4)
    return body


def test_openapi_publishes_the_request_bodies(openapi):
    for path in PATHS:
        schema = body_schema(openapi, path)
        assert schema["additionalProperties"] is False
        described = schema["properties"]["temperature"]["description"]
        assert described.startswith("honoured")
    chat = body_schema(openapi, "/v1/chat/completions")
    assert {"messages", "tools", "response_format", "repetition_penalty"} <= set(chat["properties"])


@pytest.fixture(scope="module")
def fuzz_strategies(openapi):
    """Bodies the schema allows, naming the served model so that they reach the
    deepest paths, and the same with one thing wrong (the model included)."""
    cases = []
    for path in PATHS:
        valid = from_schema(body_schema(openapi, path)).map(
            lambda body: {**body, "model": "default_model"}
        )
        cases += [st.tuples(st.just(path), valid), st.tuples(st.just(path), mutated(valid))]
    return st.one_of(cases)


def test_fuzzed_schema_bodies_never_get_a_server_error(server, fuzz_strategies):
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True)  # fmt: skip
    @given(case=fuzz_strategies)
    def run(case):
        path, body = case
        if isinstance(body, dict):
            body = bounded(body)
        # json.dumps writes NaN and Infinity as Python's parser reads them back
        raw = json.dumps(body).encode()
        r = httpx.post(server.url + path, content=raw, timeout=120,
                       headers={"Content-Type": "application/json"})  # fmt: skip
        FUZZ_STATUSES[f"{path} {r.status_code}"] += 1
        assert r.status_code < 500, (path, body, r.status_code, r.text[:500])
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
        assert server.proc.poll() is None

    run()
    if os.environ.get("MLX_KVQ_FUZZ_REPORT"):
        with open(os.environ["MLX_KVQ_FUZZ_REPORT"], "w") as f:
            json.dump(dict(sorted(FUZZ_STATUSES.items())), f, indent=1)


def test_the_server_is_unchanged_after_the_fuzz(server):
    assert server.health().status_code == 200
    assert chat(server, user(CLOCK), repetition_penalty=1.1)[0] == "ticktockdone"
    assert chat(server, user(WEATHER), tools=TOOLS)[2] == [("get_weather", {"city": "Paris"})]
    assert server.metrics().get('mlx_kvq_requests_total{status="error"}', 0) == 0

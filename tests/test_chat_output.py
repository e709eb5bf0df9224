"""A chat answer split into content, reasoning and tool calls, and chat
history rendered, as mlx_lm.server does both (no server here: the pieces).

Tokenizers come from scripted models (kvq_testing.scripted) with Qwen3-style
templates that mlx-lm recognizes: `<think>` reasoning, `<tool_call>` JSON
calls (parser `json_tools`) or Qwen3-Coder XML calls (`qwen3_coder`).
"""

from __future__ import annotations

import json

import pytest
from kvq_testing.scripted import save_scripted_model
from mlx_lm.utils import load_tokenizer

from mlx_kvq.engine.prompts import chat_tokens, template_variables
from mlx_kvq.server.chat.output import OutputSplitter
from mlx_kvq.server.chat.tools import ToolChoiceError, tool_policy, tools_refusal
from mlx_kvq.server.openai.bodies import TokenText
from mlx_kvq.server.openai.schemas import ChatCompletionRequest
from mlx_kvq.server.openai.translate import template_fields

TOOL_TEXT = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
CALL = "<tool_call>" + TOOL_TEXT + "</tool_call>"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
SCRIPT = {"weather": ["<tool_call>", TOOL_TEXT, "</tool_call>"]}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    base = tmp_path_factory.mktemp("chat_output")
    return {
        t: load_tokenizer(save_scripted_model(base / t, SCRIPT, template=t))
        for t in ("qwen3", "qwen3_open_think", "qwen3_coder", "plain")
    }


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def split(tokenizer, text: str, reason: str = "stop", *, prompt=None, parse_tools=True,
          pieces: int | None = None):  # fmt: skip
    """(content, reasoning, tool calls, finish reason) of `text` fed in `pieces`-char pieces."""
    splitter = OutputSplitter(tokenizer)
    prompt = prompt if prompt is not None else chat_tokens(tokenizer, user("hi"))
    out = splitter.start(prompt, parse_tools, TOOLS, streaming=pieces is not None)
    step = pieces or len(text) or 1
    deltas = [out.feed(text[i : i + step]) for i in range(0, len(text), step)]
    rest, reason = out.finish(reason)
    deltas.append(rest)
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    calls = [c for d in deltas for c in d.tool_calls]
    return content, reasoning, calls, reason


@pytest.mark.parametrize("pieces", [None, 1, 3])
def test_a_tool_call_becomes_tool_calls(tokenizers, pieces):
    content, reasoning, calls, reason = split(tokenizers["qwen3"], CALL, pieces=pieces)
    assert (content, reasoning, reason) == ("", "", "tool_calls")
    (call,) = calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert ("index" in call) == (pieces is not None)  # streamed calls carry their index


def test_text_around_calls_is_content_and_calls_are_numbered(tokenizers):
    text = "Let me look." + CALL + "\n" + CALL.replace("Paris", "Rome") + "\nDone."
    content, _, calls, reason = split(tokenizers["qwen3"], text, pieces=2)
    assert content == "Let me look.\n\nDone."
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
    assert [c["index"] for c in calls] == [0, 1] and reason == "tool_calls"


def test_a_call_the_parser_cannot_read_stays_content(tokenizers):
    bad = "<tool_call>not json</tool_call>"
    assert split(tokenizers["qwen3"], bad) == (bad, "", [], "stop")
    cut = '<tool_call>\n{"name": "get_weather", "argu'  # max_tokens hit inside the call
    assert split(tokenizers["qwen3"], cut, "length") == (cut + "</tool_call>", "", [], "length")


def test_tool_choice_none_leaves_the_markup_in_content(tokenizers):
    assert split(tokenizers["qwen3"], CALL, parse_tools=False) == (CALL, "", [], "stop")


def test_a_call_ended_by_length_is_still_a_call_but_finish_says_length(tokenizers):
    text = "<tool_call>" + TOOL_TEXT  # the closing marker never came
    content, _, calls, reason = split(tokenizers["qwen3"], text, "length")
    assert content == "" and len(calls) == 1 and reason == "length"


@pytest.mark.parametrize("pieces", [None, 1])
def test_reasoning_is_separated_and_its_markers_removed(tokenizers, pieces):
    text = "<think>\nCount the legs.\n</think>\n\nA spider."
    got = split(tokenizers["qwen3"], text, pieces=pieces)
    assert got == ("\n\nA spider.", "\nCount the legs.\n", [], "stop")


def test_a_template_that_opened_the_block_starts_in_reasoning(tokenizers):
    tokenizer = tokenizers["qwen3_open_think"]
    opened = chat_tokens(tokenizer, user("A riddle."))
    assert tokenizer.decode(opened).endswith("<think>\n")
    text = "\nCount the legs.\n</think>\n\nA spider."
    got = split(tokenizer, text, prompt=opened, pieces=1)
    assert got == ("\n\nA spider.", "\nCount the legs.\n", [], "stop")
    # enable_thinking false closes the block in the prompt: the answer is content
    closed = chat_tokens(tokenizer, user("A riddle."), {"enable_thinking": False})
    assert OutputSplitter(tokenizer).initial_state(closed) == "normal"
    assert split(tokenizer, "A spider.", prompt=closed)[:2] == ("A spider.", "")


def test_text_held_back_at_the_end_is_not_dropped(tokenizers):
    """A final '<' could start a marker; mlx_lm.server discards it, we keep it."""
    assert split(tokenizers["qwen3"], "a <", pieces=1)[0] == "a <"


def test_a_model_without_markers_passes_text_through(tokenizers):
    tokenizer = tokenizers["plain"]
    assert not tokenizer.has_tool_calling and not tokenizer.has_thinking
    assert split(tokenizer, CALL, pieces=2) == (CALL, "", [], "stop")


def test_history_tool_call_arguments_are_decoded_as_mlx_lm_does(tokenizers):
    """Qwen3-Coder's template iterates `arguments | items`: a JSON string (what
    OpenAI clients send back) fails raw, and renders once decoded."""
    tokenizer = tokenizers["qwen3_coder"]
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    history = user("Weather?") + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"},
    ]
    with pytest.raises(TypeError):
        tokenizer.apply_chat_template(json.loads(json.dumps(history)), tools=TOOLS)
    ids = chat_tokens(tokenizer, json.loads(json.dumps(history)), {}, TOOLS)
    as_dict = json.loads(json.dumps(history))
    as_dict[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    assert ids == tokenizer.apply_chat_template(as_dict, tools=TOOLS, add_generation_prompt=True)
    assert "<parameter=city>\nParis\n</parameter>" in tokenizer.decode(ids)
    broken = json.loads(json.dumps(history))
    broken[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(ValueError):
        chat_tokens(tokenizer, broken, {}, TOOLS)


def test_role_mapping_renders_templateless_models(tmp_path):
    tokenizer = load_tokenizer(save_scripted_model(tmp_path / "m", SCRIPT, template="plain"))
    tokenizer.chat_template, tokenizer.has_chat_template = None, False
    mapping = {"user": "Q: ", "assistant": "A: ", "stop": "\n"}
    ids = chat_tokens(tokenizer, user("hi"), role_mapping=mapping)
    assert tokenizer.decode(ids).endswith("Q: hi\nA:")


def test_template_variables_name_what_the_template_reads(tokenizers):
    names = template_variables(tokenizers["qwen3"])
    assert {"messages", "tools", "enable_thinking"} <= names
    assert "reasoning_effort" not in names


def test_reasoning_effort_reaches_a_template_that_reads_it(tmp_path):
    """gpt-oss's template reads `reasoning_effort`: the request field reaches it;
    a template that does not read a field set in the request refuses it."""
    tokenizer = load_tokenizer(save_scripted_model(tmp_path / "m", SCRIPT, template="plain"))
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if reasoning_effort is defined %}[effort: {{ reasoning_effort }}]{% endif %}"
    )
    names = template_variables(tokenizer)
    body = ChatCompletionRequest.model_validate(
        {"messages": user("hi"), "reasoning_effort": "low", "verbosity": "high"}
    )
    fields, unread = template_fields(body, names)
    assert unread == "verbosity"
    assert fields == {"reasoning_effort": "low", "verbosity": "high"}
    fields.pop("verbosity")
    assert tokenizer.decode(chat_tokens(tokenizer, user("hi"), fields)) == "hi[effort: low]"
    fields, unread = template_fields(
        ChatCompletionRequest.model_validate({"messages": user("hi")}), names
    )
    assert (fields, unread) == ({}, None)


@pytest.mark.parametrize(
    ("choice", "render", "parse", "required", "name"),
    [
        (None, True, True, False, None),
        ("auto", True, True, False, None),
        ("none", False, False, False, None),
        ("required", True, True, True, None),  # enforced with --tool-format json, else 400
        ({"type": "function", "function": {"name": "f"}}, True, True, True, "f"),
    ],
)
def test_tool_choice_policies(choice, render, parse, required, name):
    policy = tool_policy(choice)
    assert (policy.render, policy.parse, policy.required, policy.name) == (
        render, parse, required, name,
    )  # fmt: skip


@pytest.mark.parametrize("choice", ["sometimes", {"type": "function"}, {"function": {"name": 1}}])
def test_tool_choices_that_mean_nothing_are_refused(choice):
    with pytest.raises(ToolChoiceError):
        tool_policy(choice)


def test_tools_a_model_cannot_take_are_refused(tokenizers):
    qwen3, plain = tokenizers["qwen3"], tokenizers["plain"]
    assert tools_refusal(OutputSplitter(qwen3).tools, template_variables(qwen3)) is None
    refusal = tools_refusal(OutputSplitter(plain).tools, template_variables(plain))
    assert "does not render tools" in refusal
    assert "no tool-call parser" in tools_refusal(False, frozenset({"tools"}))


def test_logprob_bytes_are_the_tokens_own_bytes(tokenizers):
    """OpenAI's `bytes` lets a client join the tokens of a character split
    across tokens: each token's entry carries its own bytes (the first byte of
    "é" alone decodes to U+FFFD, whose bytes are not that token's)."""
    tokenizer = tokenizers["qwen3"]
    text = TokenText(tokenizer)
    for s in ("é ☕", "tick"):
        ids = tokenizer.encode(s, add_special_tokens=False)
        assert b"".join(bytes(text.entry(t, 0.0)["bytes"]) for t in ids).decode() == s

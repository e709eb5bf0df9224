"""Scripted models (kvq_testing.scripted): real mlx-lm models whose greedy
output is what the test wrote, for end-to-end tests of tool calls,
reasoning, stop strings, penalties, logit_bias and HTML in answers.

Checked here: the greedy output of both architectures (llama, and gemma3_text
with wrapped sliding windows) is the script, with full-precision caches, with
mlx-kvq's 4-, 5-, 6- and 8-bit caches, the split layout (K6/V5, per-channel
keys) and the default (K4/V3, rotated) caches, in batches of
different lengths through mlx-lm's BatchGenerator, past 600 tokens; the
logits are the designed table; penalties and logit_bias break the scripted
loop as the docstring says; mlx-lm's tokenizer wrapper recognizes the tool
and thinking markers; the templates render history as Qwen3's does (or keep
it verbatim); files are deterministic; `mlx_lm.server` returns a parsed tool
call and `mlx-kvq serve` answers the script.
"""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import numpy as np
import pytest
from kvq_testing.scripted import (
    ARCHS,
    DEFAULT_REPLY,
    EOS,
    START,
    Reply,
    expected_logits,
    save_scripted_model,
    token_id,
)
from kvq_testing.server import MlxLmServerProcess, ServerProcess
from mlx_lm import generate, load
from mlx_lm.generate import BatchGenerator, make_text_state_machine
from mlx_lm.sample_utils import make_logits_processors

import mlx_kvq
from mlx_kvq.config import KVConfig
from mlx_kvq.defaults import DEFAULT_KV_CONFIG
from mlx_kvq.plan import plan_kv

TOOL_TEXT = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
SCRIPT = {
    "capital": ["Paris is the capital of France."],
    "weather": ["<tool_call>", TOOL_TEXT, "</tool_call>"],
    "<tool_response>": ["It is sunny in Paris."],
    "riddle": ["<think>", "\nCount the legs.\n", "</think>", "\n\nA spider."],
    "countdown": ["three, two, ", "STOP", " one"],
    "clock": Reply(["tick", "tock", "done"], extra={("tock", "tick"): 20.5}),
    "html": ["<script>alert(1)</script>"],
}
MAX_TOKENS = 12
FILLER = "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod. " * 10
TOOL_CALL = {
    "id": "call_0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
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


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# name -> (messages, template kwargs, expected greedy text for MAX_TOKENS tokens)
CASES = {
    "answer": (user("What is the capital of France?"), {}, "Paris is the capital of France."),
    "tool_call": (
        user("What is the weather in Paris?"),
        {"tools": TOOLS},
        "<tool_call>" + TOOL_TEXT + "</tool_call>",
    ),
    "tool_result": (
        user("What is the weather in Paris?")
        + [
            {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
            {"role": "tool", "tool_call_id": "call_0", "content": "22 C, clear sky"},
        ],
        {"tools": TOOLS},
        "It is sunny in Paris.",
    ),
    "reasoning": (user("Here is a riddle."), {}, "<think>\nCount the legs.\n</think>\n\nA spider."),
    "no_thinking": (
        user("Here is a riddle."),
        {"enable_thinking": False},
        "<think>\nCount the legs.\n</think>\n\nA spider.",
    ),
    "stop_string": (user("Start the countdown."), {}, "three, two, STOP one"),
    "loop": (user("What does the clock say?"), {}, "ticktock" * (MAX_TOKENS // 2)),
    "html": (user("Show me some html."), {}, "<script>alert(1)</script>"),
    "default": (user("Hello there."), {}, DEFAULT_REPLY[0]),
    # more than 600 tokens, the trigger at the start: every window has wrapped past it
    "long": (user("The capital, please. " + FILLER), {}, "Paris is the capital of France."),
    # the later-listed trigger wins however often the earlier one occurs
    "crowded": (user("capital," * 50 + "weather?"), {}, "<tool_call>" + TOOL_TEXT + "</tool_call>"),
}


@pytest.fixture(scope="module", params=ARCHS)
def scripted(request, tmp_path_factory):
    path = save_scripted_model(
        tmp_path_factory.mktemp("scripted") / request.param, SCRIPT, arch=request.param
    )
    model, tokenizer = load(str(path))
    return path, model, tokenizer


def prompt_of(tokenizer, case: str) -> list[int]:
    messages, kwargs, _ = CASES[case]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)


def default_setting() -> dict:
    """mlx-kvq's default KV setting as mlx-lm style keyword arguments (all of
    it: widths, rotation, windows and the split layout's fields)."""
    return DEFAULT_KV_CONFIG.as_kwargs()


# the split layout with 5-bit values: per-channel keys, raw sinks and residual
SPLIT_K6V5 = KVConfig(
    key_bits=6, value_bits=5, group_size=64, key_scales="channel", key_group_size=128,
    sinks=4, residual=64,
)  # fmt: skip

SETTINGS = {
    "4bit": lambda: {"kv_bits": 4},
    "8bit": lambda: {"kv_bits": 8},
    # 5 and 6 bits without rotation: the widths whose 16-bit scales do not
    # store a row's zeros exactly (an absent trigger's share is read against
    # REF, which carries the same error)
    "5bit": lambda: {"kv_bits": 5},
    "6bit": lambda: {"kv_bits": 6},
    "split_K6V5": SPLIT_K6V5.as_kwargs,
    "default": default_setting,
}


def test_long_case_wraps_the_windows(scripted):
    """The long case is past 600 tokens, and the hybrid's quantized window
    caches hold only their window of it afterwards."""
    path, model, tokenizer = scripted
    prompt = prompt_of(tokenizer, "long")
    assert len(prompt) > 600
    cache = mlx_kvq.make_prompt_cache(model, **default_setting())
    mx.eval(model(mx.array([prompt]), cache=cache))
    window = json.loads((path / "config.json").read_text()).get("sliding_window")
    sizes = [c.size() for c in cache]
    assert sizes == ([len(prompt)] * 2 if window is None else [window, len(prompt), window])


@pytest.mark.parametrize("case", CASES)
def test_greedy_output_is_the_script(scripted, case):
    _, model, tokenizer = scripted
    text = generate(model, tokenizer, prompt_of(tokenizer, case), max_tokens=MAX_TOKENS)
    assert text == CASES[case][2]


def test_logits_are_the_designed_table(scripted):
    """At the last prompt position and along the reply, the logits are the
    script's table (20 for the scripted token, 0 elsewhere, 20.5 for the loop)."""
    _, model, tokenizer = scripted
    for case in ("tool_result", "loop", "default", "crowded"):
        tokens = prompt_of(tokenizer, case)
        reply = tokenizer.encode(CASES[case][2], add_special_tokens=False)[:4]
        seq = tokens + reply
        logits = np.array(model(mx.array([seq]))[0].astype(mx.float32))
        for i in range(len(tokens) - 1, len(seq)):
            want = expected_logits(SCRIPT, seq[: i + 1])
            np.testing.assert_allclose(logits[i], want, atol=5e-3, err_msg=f"{case} at {i}")


@pytest.mark.parametrize("setting", SETTINGS)
def test_quantized_caches_keep_the_script(scripted, setting):
    _, model, tokenizer = scripted
    cases = ["tool_result", "crowded"] if setting == "8bit" else list(CASES)
    for case in cases:
        want = CASES[case][2]
        text = mlx_kvq.generate(
            model, tokenizer, prompt_of(tokenizer, case), max_tokens=MAX_TOKENS,
            **SETTINGS[setting](),
        )  # fmt: skip
        assert text == want, (setting, case)


def batch_generate(model, batches: list[list[list[int]]], kv: KVConfig, eos: int, processors=None):
    """Greedy continuous batching the way the server's engine runs it: mlx-lm's
    BatchGenerator on the KV plan's quantized batch caches. Each group of
    `batches` is inserted after the previous group has decoded two steps, so
    later sequences join a running batch. Returns the tokens of each prompt."""
    plan = plan_kv(model, kv, batch=True)
    n = sum(len(b) for b in batches)
    bg = BatchGenerator(model, stop_tokens=[[eos]], completion_batch_size=n)
    out: dict[int, list[int]] = {}
    done: set[int] = set()
    order = []
    processors = iter(processors or [None] * n)
    for group in batches:
        uids = bg.insert(
            group,
            max_tokens=[MAX_TOKENS] * len(group),
            caches=[plan.make_cache() for _ in group],
            logits_processors=[next(processors) or [] for _ in group],
        )
        order += uids
        out.update({uid: [] for uid in uids})
        steps = 0
        while len(done) < len(out) and (steps < 2 or group is batches[-1]):
            for r in bg.next_generated():
                if r.finish_reason != "stop":
                    out[r.uid].append(r.token)
                if r.finish_reason is not None:
                    done.add(r.uid)
            steps += 1
    bg.close()
    return [out[uid] for uid in order]


@pytest.mark.parametrize("setting", ["4bit", "default"])
def test_batched_quantized_caches_keep_the_script(scripted, setting):
    """Short prompts of different lengths (left-padded together), then a tool
    result (~380 tokens) and the long prompt (~760) joining the running
    batch: every sequence says its own script."""
    _, model, tokenizer = scripted
    groups = [["answer", "reasoning", "loop", "default", "html"], ["tool_result", "long"]]
    outs = batch_generate(
        model,
        [[prompt_of(tokenizer, c) for c in group] for group in groups],
        KVConfig.from_args(**SETTINGS[setting]()),
        tokenizer.eos_token_id,
    )
    cases = [c for group in groups for c in group]
    assert {c: tokenizer.decode(t) for c, t in zip(cases, outs, strict=True)} == {
        c: CASES[c][2] for c in cases
    }


LOOP_BREAKS = {  # penalties and biases on the clock's loop (tick 20.5 vs done 20 after tock)
    "none": ({}, "ticktock" * (MAX_TOKENS // 2)),
    "repetition": ({"repetition_penalty": 1.1}, "ticktockdone"),
    "presence": ({"presence_penalty": 1.0}, "ticktockdone"),
    "frequency": ({"frequency_penalty": 0.2}, "ticktock" * 3 + "done"),
    "bias": ({"logit_bias": {"done": 1.0}}, "ticktockdone"),
}


def processors(path, kwargs: dict):
    """mlx-lm's logits processors for `kwargs` (logit_bias keyed by piece)."""
    if "logit_bias" in kwargs:
        bias = {token_id(path, piece): b for piece, b in kwargs["logit_bias"].items()}
        kwargs = {**kwargs, "logit_bias": bias}
    return make_logits_processors(**kwargs)


@pytest.mark.parametrize("name", LOOP_BREAKS)
def test_penalties_break_the_loop(scripted, name):
    path, model, tokenizer = scripted
    kwargs, want = LOOP_BREAKS[name]
    prompt = prompt_of(tokenizer, "loop")
    text = generate(
        model, tokenizer, prompt, max_tokens=MAX_TOKENS, logits_processors=processors(path, kwargs)
    )
    assert text == want
    quantized = mlx_kvq.generate(
        model, tokenizer, prompt, max_tokens=MAX_TOKENS,
        logits_processors=processors(path, kwargs), **default_setting(),
    )  # fmt: skip
    assert quantized == want


def test_penalties_per_sequence_in_a_quantized_batch(scripted):
    """BatchGenerator's per-sequence logits processors (what the server will use)."""
    path, model, tokenizer = scripted
    prompt = prompt_of(tokenizer, "loop")
    names = list(LOOP_BREAKS)
    outs = batch_generate(
        model, [[prompt] * len(names)], DEFAULT_KV_CONFIG, tokenizer.eos_token_id,
        processors=[processors(path, LOOP_BREAKS[n][0]) for n in names],
    )  # fmt: skip
    assert [tokenizer.decode(t) for t in outs] == [LOOP_BREAKS[n][1] for n in names]


def test_mlx_lm_recognizes_tool_calls_and_thinking(scripted):
    path, _, tokenizer = scripted
    assert tokenizer.has_tool_calling and tokenizer.init_kwargs["tool_parser_type"] == "json_tools"
    assert (tokenizer.tool_call_start, tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert tokenizer.tool_call_start_tokens == (token_id(path, "<tool_call>"),)
    assert tokenizer.tool_parser(TOOL_TEXT, TOOLS) == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert tokenizer.has_thinking
    assert (tokenizer.think_start, tokenizer.think_end) == ("<think>", "</think>")
    assert tokenizer.think_start_id == token_id(path, "<think>")
    assert tokenizer.think_end_id == token_id(path, "</think>")
    # mlx_lm.server's text state machine splits the scripted replies
    sm = make_text_state_machine(tokenizer)
    for case, want in [
        ("reasoning", [("reasoning", "\nCount the legs.\n"), ("normal", "\n\nA spider.")]),
        ("tool_call", [("tool", TOOL_TEXT)]),
    ]:
        state, segments = sm.split(sm.make_state("normal"), CASES[case][2])
        state, rest, current = sm.flush(state)
        got = [(s, t) for s, t in [*segments, (current, rest)] if t]
        assert got == want, case


def test_plain_template_has_no_tool_calling_or_thinking(tmp_path):
    path = save_scripted_model(tmp_path / "plain", {"capital": ["Paris."]}, template="plain")
    model, tokenizer = load(str(path))
    assert not tokenizer.has_tool_calling and not tokenizer.has_thinking
    prompt = tokenizer.apply_chat_template(user("The capital?"), add_generation_prompt=True)
    assert tokenizer.decode(prompt) == "<bos><|user|>The capital?<|end|>\n<|assistant|>"
    assert generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS) == "Paris."
    other = tokenizer.apply_chat_template(user("Hello."), add_generation_prompt=True)
    assert generate(model, tokenizer, other, max_tokens=MAX_TOKENS) == DEFAULT_REPLY[0]


REASONED = {"role": "assistant", "reasoning": "\nCount the legs.\n", "content": "\n\nA spider."}


@pytest.mark.parametrize("template", ["qwen3", "qwen3_keep_reasoning"])
def test_history_rendering(tmp_path, template):
    """qwen3 drops the reasoning of answers before the last user message (as
    Qwen3's template does); qwen3_keep_reasoning renders them as generated,
    so the next prompt starts with the previous prompt and its answer."""
    path = save_scripted_model(tmp_path / template, SCRIPT, template=template)
    model, tokenizer = load(str(path))
    turn1 = user("Here is a riddle.")
    prompt1 = tokenizer.apply_chat_template(turn1, add_generation_prompt=True)
    answer = generate(model, tokenizer, prompt1, max_tokens=MAX_TOKENS)
    assert answer == CASES["reasoning"][2]
    generated = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    turn2 = turn1 + [REASONED] + user("And another one?")
    prompt2 = tokenizer.apply_chat_template(turn2, add_generation_prompt=True)
    text2 = tokenizer.decode(prompt2)
    verbatim = prompt2[: len(prompt1) + len(generated)] == prompt1 + generated
    if template == "qwen3":
        assert "Count the legs." not in text2 and not verbatim
        assert "<|im_start|>assistant\nA spider.<|im_end|>" in text2
    else:
        assert verbatim
    # a tool call in history renders as the tokens the model produced, in both
    prompt3 = prompt_of(tokenizer, "tool_call")
    call = tokenizer.encode(CASES["tool_call"][2], add_special_tokens=False)
    for arguments in ({"city": "Paris"}, '{"city": "Paris"}'):
        tool_call = {**TOOL_CALL, "function": {"name": "get_weather", "arguments": arguments}}
        history = CASES["tool_call"][0] + [
            {"role": "assistant", "content": "", "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "22 C"},
        ]
        prompt4 = tokenizer.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True)
        assert prompt4[: len(prompt3) + len(call) + 1] == prompt3 + call + [tokenizer.eos_token_id]
        assert tokenizer.decode(prompt4).endswith(
            "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )


CODER_CALL = "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"


def test_qwen3_coder_template_iterates_the_arguments(tmp_path):
    """mlx-lm picks its qwen3_coder parser, which reads the scripted XML call;
    history arguments must be dicts (a JSON string fails, as with Qwen3-Coder)."""
    script = {"weather": ["<tool_call>", CODER_CALL, "</tool_call>"]}
    path = save_scripted_model(tmp_path / "coder", script, template="qwen3_coder")
    model, tokenizer = load(str(path))
    assert tokenizer.has_tool_calling and tokenizer.init_kwargs["tool_parser_type"] == "qwen3_coder"
    prompt = prompt_of(tokenizer, "tool_call")
    answer = generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)
    assert answer == "<tool_call>" + CODER_CALL + "</tool_call>"
    assert tokenizer.tool_parser(CODER_CALL, TOOLS) == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    history = CASES["tool_call"][0] + [
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call_0", "content": "22 C"},
    ]
    prompt2 = tokenizer.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True)
    generated = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    assert prompt2[: len(prompt) + len(generated)] == prompt + generated
    as_string = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    history[1] = {**history[1], "tool_calls": [{**TOOL_CALL, "function": as_string}]}
    with pytest.raises(TypeError, match="mapping"):  # jinja2's `items` filter
        tokenizer.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True)


def test_open_think_template_starts_inside_the_reasoning(tmp_path):
    script = {"riddle": ["\nCount the legs.\n", "</think>", "\n\nA spider."]}
    path = save_scripted_model(tmp_path / "open", script, template="qwen3_open_think")
    model, tokenizer = load(str(path))
    prompt = tokenizer.apply_chat_template(user("A riddle."), add_generation_prompt=True)
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
    # mlx_lm.server starts in the reasoning state when the prompt opened the block
    assert tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)
    assert generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS) == "".join(script["riddle"])


def digest(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_call_same_files(tmp_path):
    a = digest(save_scripted_model(tmp_path / "a", SCRIPT, arch="hybrid"))
    b = digest(save_scripted_model(tmp_path / "b", SCRIPT, arch="hybrid"))
    c = digest(
        save_scripted_model(tmp_path / "c", {**SCRIPT, "capital": ["Lyon", "."]}, arch="hybrid")
    )
    assert a == b
    assert set(a) == {"config.json", "model.safetensors", "scripted.json", "tokenizer.json",
                      "tokenizer_config.json"}  # fmt: skip
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["tokenizer.json"] != c["tokenizer.json"]


@pytest.mark.parametrize(
    ("replies", "kwargs", "match"),
    [
        ({"key": ["x", "y", "x"]}, {}, "occurs twice"),
        ({"tick": ["tick"]}, {}, "also a piece"),
        ({"assistant": ["x"]}, {}, "occurs in the 'qwen3' template"),
        ({"key": ["caf\u00e9"]}, {}, "byte-level alphabet"),
        ({"key": ["<|im_end|>"]}, {}, "reserved"),
        ({"key": "text"}, {}, "list of strings"),
        ({"key": ["\n"]}, {}, "generation prompt ends with"),
        ({"key": Reply(["x"], extra={(EOS, "x"): 1.0})}, {}, "backwards"),
        ({f"t{i}": ["x"] for i in range(63)}, {}, "at most 62"),
        ({"key": ["x"]}, {"template": "chatml"}, "unknown template"),
        ({"key": ["x"]}, {"arch": "mamba"}, "unknown arch"),
    ],
)
def test_bad_scripts_are_refused(tmp_path, replies, kwargs, match):
    with pytest.raises(ValueError, match=match):
        save_scripted_model(tmp_path / "m", replies, **kwargs)


def test_start_extra_gives_an_alternative_first_piece(tmp_path):
    reply = Reply(["yes"], extra={(START, "no"): 19.0, ("no", EOS): 20.0})
    path = save_scripted_model(tmp_path / "m", {"ask": reply}, arch="hybrid")
    model, tokenizer = load(str(path))
    prompt = tokenizer.apply_chat_template(user("ask"), add_generation_prompt=True)
    bias = make_logits_processors(logit_bias={token_id(path, "no"): 2.0})
    assert generate(model, tokenizer, prompt, max_tokens=4) == "yes"
    assert generate(model, tokenizer, prompt, max_tokens=4, logits_processors=bias) == "no"


# -- servers -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return save_scripted_model(tmp_path_factory.mktemp("serve") / "hybrid", SCRIPT, arch="hybrid")


def test_mlx_lm_server_parses_the_scripted_tool_call(hybrid_dir):
    """The reference issue-12's server tests compare with: mlx_lm.server
    parses the tool call and the reasoning, and honours a penalty."""
    with MlxLmServerProcess(hybrid_dir) as server:
        server.wait_ready()
        client = server.client()
        messages, kwargs, _ = CASES["tool_call"]
        r = client.chat.completions.create(
            model="default_model", messages=messages, tools=kwargs["tools"], max_tokens=32
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert not choice.message.content

        r = client.chat.completions.create(
            model="default_model", messages=CASES["reasoning"][0], max_tokens=32
        )
        message = r.choices[0].message
        assert (message.reasoning, message.content) == ("\nCount the legs.\n", "\n\nA spider.")

        r = client.chat.completions.create(
            model="default_model", messages=CASES["loop"][0], max_tokens=MAX_TOKENS,
            extra_body={"repetition_penalty": 1.1},
        )  # fmt: skip
        assert r.choices[0].message.content == LOOP_BREAKS["repetition"][1]


def test_mlx_kvq_serve_answers_the_script(hybrid_dir):
    """`mlx-kvq serve` loads it, warms up every cache kind quantized (default
    setting), and says the script."""
    with ServerProcess(hybrid_dir) as server:
        server.wait_ready()
        client = server.client()
        for case in ("answer", "long", "html"):
            messages, _, want = CASES[case]
            r = client.chat.completions.create(
                model="default_model", messages=messages, max_tokens=MAX_TOKENS, temperature=0
            )
            assert r.choices[0].message.content == want, case
            assert r.choices[0].finish_reason == "stop"

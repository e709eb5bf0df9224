"""Tiny real mlx-lm models whose greedy output the test writes: scripted models.

Features whose result depends on what the model says (tool calls, reasoning,
stop strings, penalties, ``logit_bias``, HTML in the answer, multi-turn chats)
need a model that says a known thing. :func:`save_scripted_model` writes a
model directory that ``mlx_lm.load``, ``python -m mlx_lm.server --model DIR``
and ``mlx-kvq serve --model DIR`` open like any other: a real mlx-lm
architecture (``llama``, or ``gemma3_text`` with sliding-window and
full-attention layers for ``arch="hybrid"``), float32 weights written by hand
(no training), a byte-level BPE ``tokenizer.json`` (one token per byte of
ordinary text) and a chat template.

How to script
=============

A script maps **trigger** strings to **replies**. A reply is a list of
**pieces**; every piece and every trigger is one token of the vocabulary (an
added token, so the same text in a prompt is that token too; a one-byte
piece such as ``"\n"`` is that byte's token). When a trigger occurs anywhere
in the prompt (system prompt, tool definitions and earlier turns included),
the model answers with that trigger's reply, then its EOS. When several
triggers occur, the one listed **last** wins: list them in the order the
conversation brings them up. Without any trigger the model says ``default``.
Greedy decoding says the script exactly, also with mlx-kvq's KV caches at
every width (2, 3, 4, 5, 6 and 8 bits, keys and values alike or not, rotated
or not, per token or in the split layout, the defaults included), in
batches and past wrapped sliding windows::

    from kvq_testing.scripted import Reply, save_scripted_model, token_id

    path = save_scripted_model(tmp_path / "model", {
        # a plain answer
        "capital": ["Paris is the capital of France."],
        # a tool call: mlx-lm's json_tools parser reads the text between the markers
        "weather": ["<tool_call>",
                    '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
                    "</tool_call>"],
        # the answer once the tool result is in the prompt (qwen3 templates wrap
        # it in <tool_response>, listed after "weather" so that it wins)
        "<tool_response>": ["It is sunny in Paris."],
        # reasoning, then the answer
        "riddle": ["<think>", "\nCount the legs.\n", "</think>", "\n\nA spider."],
        # a stop string inside a reply: "STOP" is one token here, so mlx_lm.server
        # (which matches stop words on token ids) and text matchers both find it
        "countdown": ["three, two, ", "STOP", " one"],
        # a loop that penalties break (see "Logits")
        "clock": Reply(["tick", "tock", "done"], extra={("tock", "tick"): 20.5}),
        # HTML that a web page must show as text
        "html": ["<script>alert(1)</script>"],
    }, template="qwen3", arch="hybrid")

    model, tokenizer = mlx_lm.load(str(path))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the weather?"}], add_generation_prompt=True)
    mlx_lm.generate(model, tokenizer, prompt)   # the tool call's text

For a stop string that is not a token of its own, put its text inside a
bigger piece (``["three, two, STOP one"]``): mlx_lm.server's token match
then misses it where a text matcher finds it.

Logits
======

At every step the model's next-token logits are ``Reply.logit`` (20) for the
scripted next piece (or EOS), the values of ``Reply.extra`` for the pairs it
names, and 0 for every other token (to about 1e-3, whatever the KV cache's
precision; :func:`expected_logits` computes the table). ``extra`` maps
``(after, next)`` to a logit: after the token ``after`` (a piece, or
:data:`START` for the first step), the token ``next`` (a piece, or
:data:`EOS`) gets that logit. After ``tock``, the ``clock`` reply gives
``tick`` 20.5 and ``done`` 20, so greedy decoding with mlx-lm's
``make_logits_processors`` (or the same ``mlx_lm.server`` request fields) says:

======================  ===========================================
no processor            ``ticktockticktock...`` until ``max_tokens``
repetition_penalty 1.1  ``ticktockdone`` (20.5 / 1.1 < 20)
presence_penalty 1.0    ``ticktockdone``
frequency_penalty 0.2   ``ticktockticktockticktockdone`` (three ticks)
logit_bias {done: 1}    ``ticktockdone``
======================  ===========================================

(penalties see the last 20 tokens by default, prompt included;
:func:`token_id` gives a piece's id for ``logit_bias``).

The trigger chooses the reply and the current token alone chooses the next
piece, so within one reply each piece occurs once (``extra`` may point back
to earlier pieces: that is how loops are made). After a token that is not a
piece of the active reply (the end of the generation prompt, or any other
text) the reply starts from its first piece. With ``qwen3_open_think`` the
generation prompt already opens ``<think>``: script that reply without it.

Templates (``template=``)
=========================

``"plain"``
    ``<|role|>content<|end|>`` turns after ``<bos>``, no tools; EOS ``<|end|>``.
``"qwen3"``
    Qwen3-style (``<|im_start|>``/``<|im_end|>``, EOS ``<|im_end|>``): tools in
    the system turn, assistant ``tool_calls`` rendered as
    ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` (arguments
    given as a dict or a JSON string), ``role: "tool"`` messages as
    ``<tool_response>`` blocks in a user turn, ``enable_thinking=False`` adds
    an empty ``<think>\n\n</think>\n\n``. Like Qwen3's, it drops the
    reasoning of assistant turns before the last user message when it
    re-renders history (reasoning taken from ``reasoning_content``,
    ``reasoning`` or a ``<think>`` block in ``content``).
``"qwen3_keep_reasoning"``
    The same, but earlier answers keep their reasoning: an answer sent back
    as mlx_lm.server returned it (``reasoning`` + ``content``) renders as the
    tokens the model produced, when the pieces carry the newlines the
    template adds (``["<think>", "\n...\n", "</think>", "\n\n..."]``), so the
    next prompt starts with the previous prompt and its answer.
``"qwen3_open_think"``
    Like ``"qwen3"``, with ``<think>\n`` at the end of the generation prompt
    (the model starts inside its reasoning).
``"qwen3_coder"``
    Like ``"qwen3"``, with Qwen3-Coder's XML tool calls (mlx-lm's
    ``qwen3_coder`` parser)::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    Like Qwen3-Coder's template it iterates ``arguments | items``, so an
    assistant ``tool_calls`` entry in the history whose arguments are still
    a JSON string fails to render (mlx_lm.server decodes them to dicts first).

mlx-lm infers from these files what it infers for real models: the qwen3
templates give ``tokenizer.has_tool_calling`` (parser ``json_tools``, or
``qwen3_coder`` for that template; markers ``<tool_call>`` and
``</tool_call>``) and ``has_thinking`` (``<think>`` and ``</think>``, one
token each); ``"plain"`` gives neither unless the pieces contain the think
markers (mlx-lm looks those up in the vocabulary).

Rules, checked when the model is written (``ValueError`` otherwise): a
trigger is not a piece of any reply and does not occur in the template's own
text; at most 62 triggers; pieces and triggers avoid the characters U+00A1 to
U+0143 (mlx-lm's byte-level streaming detokenizer decodes them as bytes).
Not checked: at most 100 trigger tokens in one prompt, repeats included (the
model tells "present" from "absent" by a trigger's share of them, with the
line at 1/256); a reply should not start with a space (that detokenizer
drops a leading space). Triggers and pieces are matched anywhere in text,
even inside words (``"sun"`` matches in ``"sunny"``): choose distinctive
strings.

How it works
============

The residual stream carries a one-hot of the current token over the tokens
the script tells apart (magnitude 8) and small channels (1e-3 of that). One
full-attention layer has the same query at every position and a key only on
trigger tokens (score 24 against 0): it attends to the trigger tokens in the
context and writes each trigger's share of them. Its value rows are
``c * (e_0 + e_slot)`` on trigger tokens (slots 1 to 62) and 0 elsewhere;
channel 63 is 0 in every row, and a trigger's share is read as its slot
minus channel 63, which makes an absent trigger's share exactly 0 (to
float32 rounding, about 1e-7 of the share) however the cache stores values.
Affine quantization keeps a row's larger edge (``c``, the bias) exactly and
puts its zeros on one level; with 16-bit scales that level misses 0 at some
widths (at 5 bits ``c / 31`` in float16 times 31 misses ``c`` by about 4e-4,
which the gates would read as a trigger), but it is the same number in every
zero channel of the row, slot and channel 63 alike, so the difference is 0.
Rotated (Hadamard over the head), a row is ``c / 4`` on the 32 channels where
its slot's Hadamard column is +1 and 0 on the others, and the zero level's
error rotates back onto channel 0 and the slot only. An empty row (a
non-trigger token) is stored exactly. (``c`` = 1785/1024 also makes
``c / (2**bits - 1)`` a short float16 at 2, 3, 4 and 8 bits, so there
every level is exact, present shares too; at 5 and 6 bits a present share is
off by about 2e-4.) Its MLP has two units per (trigger, current token) step
whose difference saturates at a constant: a step is on when its trigger's
share is at least 1/128, no later-listed trigger is present and the current
token is the step's ``after`` token; it writes one channel that the
``lm_head`` maps to the step's logit row. The other layers attend (random
queries, keys and values, so their quantized caches work and a NaN in them
would show) but write nothing. The logits therefore depend on the KV cache
only through the trigger shares, which only have to stay on the right side
of 1/256.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np

START = "<|scripted:start|>"  # `extra` key: the step before the first piece
EOS = "<|scripted:eos|>"  # `extra` value: the end of the reply (the template's EOS token)

TEMPLATES = ("plain", "qwen3", "qwen3_keep_reasoning", "qwen3_open_think", "qwen3_coder")
ARCHS = ("llama", "hybrid")
DEFAULT_REPLY = ("Nothing is scripted for this.",)
SCRIPT_FILE = "scripted.json"

MAX_TRIGGERS = 62  # value slots 1..62 of a 64-wide head (0: the share sum, 63: REF)
SHARE_THRESHOLD = 1 / 128  # a trigger with at least this share of the trigger tokens is present
HEAD_DIM = 64
SCORE = 24.0  # attention score of a trigger token (others: 0)
QK_DIM = HEAD_DIM // 2 - 1  # the lowest-frequency RoPE pair: the angle stays near 0
REF = HEAD_DIM - 1  # value channel that is 0 in every row: shares are read against it
# Value rows are V_MAG * (e_0 + e_slot): two levels, 0 and V_MAG (0 and V_MAG/4
# rotated). The zeros of a row dequantize to one number, in the slots and REF
# alike, so a slot minus REF is exactly 0 for an absent trigger at any width.
# V_MAG / (2**bits - 1) is also a float16 with few mantissa bits for 2, 3, 4
# and 8 bits (1785 = 7 * 255): there the 16-bit scales store both levels exactly.
V_MAG = 1785 / 1024
E = 8.0  # magnitude of the one-hot in the residual stream (RMS-norm eps negligible)
SMALL = 1e-3  # magnitude of the other channels, relative to E
SATURATION = 20.0  # output of a saturated MLP step (two units' difference)
GATE_MARGIN = 40.0  # |gate| at the decision boundaries' nearest allowed inputs
ROPE_THETA = 1_000_000.0
MAX_POSITIONS = 32768

# Characters of the byte-level alphabet that mlx-lm's BPEStreamingDetokenizer
# would decode as single bytes: not allowed in added tokens.
_BYTE_ALPHABET_NON_ASCII = frozenset(
    [chr(c) for c in range(0xA1, 0xAD)]
    + [chr(c) for c in range(0xAE, 0x100)]
    + [chr(0x100 + n) for n in range(68)]
)


@dataclass(frozen=True)
class Reply:
    """A scripted reply: `pieces` (one token each) then EOS.

    `extra` maps ``(after, next)`` to a logit (see the module docstring);
    `logit` is the scripted next piece's logit at every step.
    """

    pieces: Sequence[str]
    extra: Mapping[tuple[str, str], float] = field(default_factory=dict)
    logit: float = 20.0

    def __post_init__(self) -> None:
        if isinstance(self.pieces, str):
            raise ValueError(
                f"Reply pieces must be a list of strings, not the string {self.pieces!r}"
            )
        object.__setattr__(self, "pieces", tuple(self.pieces))
        object.__setattr__(self, "extra", dict(self.extra))

    @property
    def text(self) -> str:
        """The reply's text (what greedy decoding says, EOS excluded)."""
        return "".join(self.pieces)

    def rows(self) -> dict[str, dict[str, float]]:
        """The logit rows: after-token -> {next-token: logit} (START/EOS as sentinels)."""
        rows: dict[str, dict[str, float]] = {}
        chain = (START, *self.pieces, EOS)
        for after, nxt in pairwise(chain):
            rows[after] = {nxt: float(self.logit)}
        for (after, nxt), value in self.extra.items():
            rows.setdefault(after, {})[nxt] = float(value)
        return rows


# -- templates -------------------------------------------------------------------
_PLAIN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>"
    "{{ message['content'] if message['content'] is string else '' }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Qwen3-style, written for these tests. KEEP_REASONING and OPEN_THINK are
# replaced by `true`/`false`, TOOLS_HOW_TO and TOOL_CALL by the tool-call
# format's blocks (textually: mlx-lm picks the parser by searching the text).
_QWEN3_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nFunction signatures:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + (tool | tojson) }}
    {%- endfor %}
TOOLS_HOW_TO
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' and message.content is string and not message.content.startswith('<tool_response>') %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif message.reasoning is string %}
            {%- set reasoning = message.reasoning %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if reasoning and (KEEP_REASONING or loop.index0 > ns.last_query) %}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- content.lstrip('\n') }}
        {%- if message.tool_calls %}
            {%- for call in message.tool_calls %}
                {%- set tool_call = call.function if call.function else call %}
                {%- if content or not loop.first %}
                    {{- '\n' }}
                {%- endif %}
TOOL_CALL
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- elif OPEN_THINK %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
""".strip()


@dataclass(frozen=True)
class _TemplateSpec:
    chat_template: str
    special: tuple[str, ...]  # special tokens (skipped when decoding with skip_special_tokens)
    markers: tuple[str, ...]  # always-present added tokens (think / tool markup)
    bos: str | None
    eos: str
    pad: str


_JSON_TOOLS = (
    r"""    {{- '\n</tools>\n\nCall a function with <tool_call>\n{"name": <name>, "arguments": <json>}\n</tool_call><|im_end|>\n' }}""",
    r"""                {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}""",
)
_XML_TOOLS = (
    r"""    {{- '\n</tools>\n\nCall a function with <tool_call>\n<function=NAME>\n<parameter=NAME>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n' }}""",
    r"""                {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- for name, value in tool_call.arguments | items %}
                    {{- '<parameter=' + name + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' }}
                {%- endfor %}
                {{- '</function>\n</tool_call>' }}""",
)


def _qwen3(keep: bool = False, open_think: bool = False, coder: bool = False) -> _TemplateSpec:
    how_to, call = _XML_TOOLS if coder else _JSON_TOOLS
    text = _QWEN3_TEMPLATE.replace("TOOLS_HOW_TO", how_to).replace("TOOL_CALL\n", call + "\n")
    for name, value in {"KEEP_REASONING": keep, "OPEN_THINK": open_think}.items():
        text = text.replace(name, "true" if value else "false")
    return _TemplateSpec(
        text,
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        markers=(
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
        ),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
    )


_TEMPLATE_SPECS = {
    "plain": _TemplateSpec(
        _PLAIN_TEMPLATE,
        special=(
            "<pad>",
            "<bos>",
            "<|end|>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|tool|>",
        ),
        markers=(),
        bos="<bos>",
        eos="<|end|>",
        pad="<pad>",
    ),
    "qwen3": _qwen3(),
    "qwen3_keep_reasoning": _qwen3(keep=True),
    "qwen3_open_think": _qwen3(open_think=True),
    "qwen3_coder": _qwen3(coder=True),
}


def _spec(template: str) -> _TemplateSpec:
    if template not in _TEMPLATE_SPECS:
        raise ValueError(f"unknown template {template!r}; choose one of {TEMPLATES}")
    return _TEMPLATE_SPECS[template]


def render(template: str, messages: list[dict], **kwargs) -> str:
    """Render `messages` with a template the way transformers does (for checks
    that do not need a tokenizer)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    spec = _spec(template)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    kwargs.setdefault("add_generation_prompt", False)
    return env.from_string(spec.chat_template).render(
        messages=messages, bos_token=spec.bos or "", eos_token=spec.eos, **kwargs
    )


# -- tokenizer -------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel alphabet)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(0x100 + n)
            n += 1
    return out


def _tokenizer_json(tokens: list[tuple[str, bool]]) -> dict:
    """A byte-level BPE (the 256 byte symbols, no merges) plus `tokens` as
    added tokens, ids from 256 on in order."""
    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    added = [
        {
            "id": 256 + i,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for i, (content, special) in enumerate(tokens)
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


# -- the resolved script -----------------------------------------------------------
@dataclass(frozen=True)
class _Step:
    """One MLP step: under `owner` (trigger index, None for the default reply),
    after token `after` (None: any token outside the owner's chain), the logit
    row `row` (token id -> logit)."""

    owner: int | None
    after: int | None
    row: dict[int, float]


@dataclass(frozen=True)
class _Resolved:
    tokens: list[tuple[str, bool]]  # added tokens (content, special), ids 256...
    ids: dict[str, int]  # every piece, trigger and marker (one-byte ones: the byte's id)
    eos_id: int
    triggers: list[int]  # token ids, in priority order (last wins)
    steps: list[_Step]
    chains: dict[int | None, frozenset[int]]  # owner -> its after-token ids
    vocab_size: int


def _round_up(n: int, k: int = 64) -> int:
    return -(-n // k) * k


def _check_text(kind: str, text: str) -> None:
    if not isinstance(text, str) or not text:
        raise ValueError(f"{kind} must be a non-empty string, got {text!r}")
    bad = sorted(set(text) & _BYTE_ALPHABET_NON_ASCII)
    if bad:
        raise ValueError(
            f"{kind} {text!r} contains {bad}: characters of the byte-level alphabet "
            "(U+00A1-U+0143) are decoded as bytes by mlx-lm's streaming detokenizer"
        )


def _as_reply(value: Sequence[str] | Reply) -> Reply:
    return value if isinstance(value, Reply) else Reply(value)


def _resolve(
    replies: Mapping[str, Sequence[str] | Reply],
    default: Sequence[str] | Reply,
    template: str,
    extra_tokens: Sequence[str],
) -> _Resolved:
    spec = _spec(template)
    owners: list[tuple[int | None, str | None, Reply]] = [(None, None, _as_reply(default))]
    owners += [(i, t, _as_reply(r)) for i, (t, r) in enumerate(replies.items())]
    if len(replies) > MAX_TRIGGERS:
        raise ValueError(f"{len(replies)} triggers; at most {MAX_TRIGGERS}")

    reserved = set(spec.special) | {START, EOS}
    order: list[str] = list(spec.markers)

    def add(kind: str, text: str) -> None:
        _check_text(kind, text)
        if text in reserved:
            raise ValueError(f"{kind} {text!r} is reserved (template token or sentinel)")
        if text not in order:
            order.append(text)

    pieces_of: dict[str, str] = {}  # piece -> which reply says it
    for owner, trigger, reply in owners:
        where = "the default reply" if owner is None else f"the reply to {trigger!r}"
        seen = set()
        for piece in reply.pieces:
            add(f"a piece of {where}", piece)
            if piece in seen:
                raise ValueError(
                    f"{piece!r} occurs twice in {where}: the next piece is chosen by the "
                    "current one, so a reply uses each piece once (use `extra` for loops)"
                )
            seen.add(piece)
            pieces_of.setdefault(piece, where)
        for after, nxt in reply.extra:
            if after == EOS or nxt == START:
                raise ValueError(f"`extra` of {where}: ({after!r}, {nxt!r}) is backwards")
            if after != START:
                add(f"an `extra` token of {where}", after)
                pieces_of.setdefault(after, where)
            if nxt != EOS:
                add(f"an `extra` token of {where}", nxt)
                pieces_of.setdefault(nxt, where)
    for trigger in replies:
        add("trigger", trigger)
        if trigger in pieces_of:
            raise ValueError(
                f"trigger {trigger!r} is also a piece of {pieces_of[trigger]}: saying it "
                "would change which reply is active"
            )
    for token in extra_tokens:
        add("extra token", token)

    # A one-byte text already is a token of the byte-level vocabulary.
    single = {t: t.encode()[0] for t in order if len(t.encode()) == 1}
    tokens = [(t, True) for t in spec.special] + [(t, False) for t in order if t not in single]
    ids = {t: 256 + i for i, (t, _) in enumerate(tokens)} | single
    eos_id = ids[spec.eos]
    triggers = [ids[t] for t in replies]

    steps, chains = [], {}
    for owner, _, reply in owners:
        chain = set()
        for after, row in reply.rows().items():
            after_id = None if after == START else ids[after]
            if after_id is not None:
                chain.add(after_id)
            row_ids = {eos_id if n == EOS else ids[n]: v for n, v in row.items()}
            steps.append(_Step(owner, after_id, row_ids))
        chains[owner] = frozenset(chain)
    resolved = _Resolved(tokens, ids, eos_id, triggers, steps, chains, _round_up(256 + len(tokens)))
    _check_template(resolved, template, replies)
    return resolved


def _check_template(r: _Resolved, template: str, replies: Mapping) -> None:
    """Triggers must not occur in the template's own text, and no generation
    prompt may end with a token that continues a reply."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(json.dumps(_tokenizer_json(r.tokens)))
    tools = [{"type": "function", "function": {"name": "", "description": "", "parameters": {}}}]
    messages = [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": ""},
    ]
    all_chains = set().union(*r.chains.values())
    for kwargs in ({}, {"tools": tools}, {"enable_thinking": False}):
        text = render(template, messages, add_generation_prompt=True, **kwargs)
        ids = tok.encode(text, add_special_tokens=False).ids
        for trigger, tid in zip(replies, r.triggers, strict=True):
            if tid in ids:
                raise ValueError(f"trigger {trigger!r} occurs in the {template!r} template's text")
        if ids[-1] in all_chains:
            raise ValueError(
                f"the {template!r} generation prompt ends with {tok.id_to_token(ids[-1])!r}, "
                "a piece of a reply: the reply would not start at its beginning"
            )


# -- weights -----------------------------------------------------------------------
@dataclass(frozen=True)
class _Layout:
    """Residual stream channels: a one-hot of the current token over the
    tokens the script distinguishes (triggers and the tokens steps follow;
    every other token shares channel 0), then the share sum, the trigger
    shares and one channel per step."""

    dims: dict[int, int]  # token id -> its one-hot channel (others: 0)
    n_triggers: int
    n_steps: int

    @classmethod
    def of(cls, r: _Resolved) -> _Layout:
        tokens = set(r.triggers) | {s.after for s in r.steps if s.after is not None}
        return cls(
            {tid: 1 + i for i, tid in enumerate(sorted(tokens))}, len(r.triggers), len(r.steps)
        )

    def dim(self, tid: int) -> int:
        return self.dims.get(tid, 0)

    @property
    def onehot(self) -> int:
        return 1 + len(self.dims)

    @property
    def bal(self) -> int:  # sum of the trigger shares (0 or about 1)
        return self.onehot

    def tr(self, t: int) -> int:  # trigger t's share
        return self.onehot + 1 + t

    def f(self, s: int) -> int:  # step s is on
        return self.onehot + 1 + self.n_triggers + s

    @property
    def hidden(self) -> int:
        return _round_up(self.onehot + 1 + self.n_triggers + self.n_steps)


def _bf16(x: float) -> float:
    """`x` rounded to bfloat16 (round to nearest even), as gemma3 scales its embeddings."""
    bits = np.array([x], np.float32).view(np.uint32)[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(np.array([bits], np.uint32).view(np.float32)[0])


def _weights(
    r: _Resolved, arch: str, window: int, kv_heads: int = 1, layers: int | None = None
) -> tuple[dict[str, np.ndarray], dict]:
    lay = _Layout.of(r)
    V, H, nT, n1 = r.vocab_size, lay.hidden, lay.n_triggers, lay.onehot
    u = math.sqrt(H)  # a normalized one-hot entry (RMS norms with unit weight)
    hybrid = arch == "hybrid"
    n_kv = kv_heads
    n_heads = max(2, n_kv)
    inter = _round_up(2 * len(r.steps))
    rng = np.random.default_rng(0)

    def zeros(*shape: int) -> np.ndarray:
        return np.zeros(shape, np.float32)

    def norm(weight: np.ndarray) -> np.ndarray:
        """An RMSNorm weight giving per-channel scale `weight` (gemma stores scale - 1)."""
        return (weight - 1.0 if hybrid else weight).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, np.float32)

    def noise_layer() -> dict[str, np.ndarray]:
        """Attends with random q/k/v and writes nothing (a NaN would still show)."""
        sigma = 1.0 / u
        w = {
            "self_attn.q_proj.weight": rng.normal(0, sigma, (n_heads * HEAD_DIM, H)),
            "self_attn.k_proj.weight": rng.normal(0, sigma, (n_kv * HEAD_DIM, H)),
            "self_attn.v_proj.weight": rng.normal(0, sigma, (n_kv * HEAD_DIM, H)),
            "self_attn.o_proj.weight": zeros(H, n_heads * HEAD_DIM),
            "mlp.gate_proj.weight": zeros(inter, H),
            "mlp.up_proj.weight": zeros(inter, H),
            "mlp.down_proj.weight": zeros(H, inter),
            "input_layernorm.weight": norm(ones(H)),
            "post_attention_layernorm.weight": norm(ones(H)),
        }
        if hybrid:
            w["self_attn.q_norm.weight"] = norm(ones(HEAD_DIM))
            w["self_attn.k_norm.weight"] = norm(ones(HEAD_DIM))
            w["pre_feedforward_layernorm.weight"] = norm(ones(H))
            w["post_feedforward_layernorm.weight"] = norm(ones(H))
        return {k: v.astype(np.float32) for k, v in w.items()}

    def trigger_layer() -> dict[str, np.ndarray]:
        w = noise_layer()
        # Attention: one query for every token, a key on trigger tokens only.
        q, k, v = zeros(n_heads * HEAD_DIM, H), zeros(HEAD_DIM, H), zeros(HEAD_DIM, H)
        # (every KV head gets the same key and value rows: tiled below)
        if hybrid:  # q_norm/k_norm fix the magnitude; their weights set the score
            qk = 1.0
            scale = math.sqrt(SCORE / HEAD_DIM * math.sqrt(HEAD_DIM))  # per side
            for name in ("q_norm", "k_norm"):
                weight = ones(HEAD_DIM)
                weight[QK_DIM] = scale
                w[f"self_attn.{name}.weight"] = norm(weight)
        else:
            qk = math.sqrt(SCORE * math.sqrt(HEAD_DIM))  # q.k * head_dim**-0.5 = SCORE
        for h in range(n_heads):
            q[h * HEAD_DIM + QK_DIM, :n1] = qk / u
        for t, tid in enumerate(r.triggers):
            k[QK_DIM, lay.dim(tid)] = qk / u
            v[0, lay.dim(tid)] = v[1 + t, lay.dim(tid)] = V_MAG / u  # two levels (see REF)
        w["self_attn.q_proj.weight"] = q
        w["self_attn.k_proj.weight"] = np.tile(k, (n_kv, 1))
        w["self_attn.v_proj.weight"] = np.tile(v, (n_kv, 1))
        # Output: the share sum to BAL, each trigger's share (its slot minus REF,
        # the same quantization error cancelling) to TR_t.
        o = zeros(H, n_heads * HEAD_DIM)
        if hybrid:  # post_attention_layernorm normalizes: BAL dominates, then rescale
            bal, tr = E / V_MAG, SMALL * E / V_MAG
            post = zeros(H)
            post[lay.bal] = SMALL * E / u
            for t in range(nT):
                post[lay.tr(t)] = E / u  # SMALL * E / (u * SMALL): shares relative to BAL
            w["post_attention_layernorm.weight"] = norm(post)
        else:
            bal = tr = SMALL * E / V_MAG
        for h in range(n_heads):
            o[lay.bal, h * HEAD_DIM] = bal / n_heads
            for t in range(nT):
                o[lay.tr(t), h * HEAD_DIM + 1 + t] = tr / n_heads
                o[lay.tr(t), h * HEAD_DIM + REF] = -tr / n_heads
        w["self_attn.o_proj.weight"] = o

        # MLP: two units per step; (act(g) - act(g - K)) * [current token] = K.
        gate, up, down = zeros(inter, H), zeros(inter, H), zeros(H, inter)
        slope = 2 * GATE_MARGIN / SHARE_THRESHOLD  # M: share tau -> gate +40, 0 -> -40
        suppress = 2 / SHARE_THRESHOLD  # lambda: a later trigger present switches a step off
        ch = SMALL * u  # a share of 1 / the share sum of 1, normalized
        for s, step in enumerate(r.steps):
            g = zeros(H)
            if step.owner is None:  # on when no trigger is present
                g[lay.bal] = -2 * GATE_MARGIN / ch
                g[:n1] = GATE_MARGIN / u
            else:
                g[lay.tr(step.owner)] = slope / ch
                for later in range(step.owner + 1, nT):
                    g[lay.tr(later)] = -slope * suppress / ch
                g[:n1] = -slope * SHARE_THRESHOLD / 2 / u
            gate[2 * s], gate[2 * s + 1] = g, g
            gate[2 * s + 1, :n1] -= SATURATION / u
            sel = zeros(H)
            if step.after is None:
                sel[:n1] = 1.0 / u
                sel[[lay.dim(c) for c in r.chains[step.owner]]] = 0.0
            else:
                sel[lay.dim(step.after)] = 1.0 / u
            up[2 * s] = up[2 * s + 1] = sel
            out = E if hybrid else SMALL * E
            down[lay.f(s), 2 * s] = out / SATURATION
            down[lay.f(s), 2 * s + 1] = -out / SATURATION
        w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"] = gate, up
        w["mlp.down_proj.weight"] = down
        if hybrid:  # post_feedforward_layernorm normalizes the one step that is on
            post = zeros(H)
            for s in range(len(r.steps)):
                post[lay.f(s)] = SMALL * E / u
            w["post_feedforward_layernorm.weight"] = norm(post)
        return {k: v.astype(np.float32) for k, v in w.items()}

    count = layers if layers is not None else 3 if hybrid else 2
    if count < 2:
        raise ValueError(f"a scripted model has at least 2 layers, got {count}")
    # layer 1 (full attention) reads the triggers; hybrid: sliding windows in
    # the even layers, full attention in the odd ones
    layers = [noise_layer(), trigger_layer()] + [noise_layer() for _ in range(count - 2)]

    embed_scale = _bf16(math.sqrt(H)) if hybrid else 1.0
    embed = zeros(V, H)
    embed[np.arange(V), [lay.dim(tid) for tid in range(V)]] = E / embed_scale
    lm_head = zeros(V, H)
    for s, step in enumerate(r.steps):
        for tid, logit in step.row.items():
            lm_head[tid, lay.f(s)] = logit / (SMALL * u)
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}
    weights["model.norm.weight"] = norm(ones(H))
    for i, layer in enumerate(layers):
        for name, value in layer.items():
            weights[f"model.layers.{i}.{name}"] = value

    config = {
        "hidden_size": H,
        "intermediate_size": inter,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": len(layers),
        "rms_norm_eps": 1e-6,
        "vocab_size": V,
        "rope_theta": ROPE_THETA,
        "max_position_embeddings": MAX_POSITIONS,
        "eos_token_id": r.eos_id,
        "torch_dtype": "float32",
    }
    if hybrid:
        config.update(
            model_type="gemma3_text",
            sliding_window=window,
            sliding_window_pattern=2,
            query_pre_attn_scalar=HEAD_DIM,
            rope_local_base_freq=10_000.0,
        )
    else:
        config.update(model_type="llama", tie_word_embeddings=False)
    return weights, config


# -- writing -------------------------------------------------------------------------
def save_scripted_model(
    path: str | Path,
    replies: Mapping[str, Sequence[str] | Reply],
    default: Sequence[str] | Reply = DEFAULT_REPLY,
    *,
    template: str = "qwen3",
    arch: str = "llama",
    extra_tokens: Sequence[str] = (),
    window: int = 16,
    kv_heads: int = 1,
    layers: int | None = None,
) -> Path:
    """Write a scripted model directory at `path` and return it.

    `replies` maps trigger -> reply (a list of pieces or a :class:`Reply`),
    in priority order (the last trigger present wins); `default` is said when
    no trigger is present. `template` is one of :data:`TEMPLATES`, `arch` one
    of :data:`ARCHS` ("llama": two full-attention layers; "hybrid":
    gemma3_text, sliding windows of `window` tokens in layers 0 and 2, full
    attention in layer 1); `kv_heads` KV heads of 64 dimensions each and
    `layers` layers (default 2 for "llama", 3 for "hybrid", whose even layers
    slide and odd ones attend fully) shape the KV caches. `extra_tokens` are added to the vocabulary as
    single tokens with no role (stop strings, for example). Besides the model
    files it writes `scripted.json` (the script's texts and token ids, see
    :func:`token_id`). The same call writes the same bytes. See the module
    docstring for how to script.
    """
    import mlx.core as mx

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    if window < 1:
        raise ValueError(f"window must be positive, got {window}")
    resolved = _resolve(replies, default, template, extra_tokens)
    spec = _spec(template)
    weights, config = _weights(resolved, arch, window, kv_heads, layers)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(_tokenizer_json(resolved.tokens), indent=1))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.pad,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": spec.chat_template,
        "model_max_length": MAX_POSITIONS,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    (path / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    mx.save_safetensors(
        str(path / "model.safetensors"),
        {k: mx.array(v) for k, v in sorted(weights.items())},
        metadata={"format": "mlx"},
    )
    script = {
        "template": template,
        "arch": arch,
        "eos": spec.eos,
        "eos_id": resolved.eos_id,
        "triggers": list(replies),
        "replies": {t: _as_reply(r).text for t, r in replies.items()},
        "default": _as_reply(default).text,
        "token_ids": {t: i for t, i in resolved.ids.items() if t not in spec.special},
    }
    (path / SCRIPT_FILE).write_text(json.dumps(script, indent=1))
    return path


def token_id(path: str | Path, token: str) -> int:
    """The id of a piece, trigger or marker of the scripted model at `path`."""
    ids = json.loads((Path(path) / SCRIPT_FILE).read_text())["token_ids"]
    if token not in ids:
        raise KeyError(f"{token!r} is not a token of the scripted model at {path}")
    return ids[token]


def expected_logits(
    replies: Mapping[str, Sequence[str] | Reply],
    tokens: Sequence[int],
    default: Sequence[str] | Reply = DEFAULT_REPLY,
    *,
    template: str = "qwen3",
    extra_tokens: Sequence[str] = (),
) -> np.ndarray:
    """The logits the script prescribes after `tokens` (a vocabulary-sized row):
    what a scripted model built from the same arguments computes (to about
    1e-3), whatever its KV cache precision."""

    def spec(reply: Sequence[str] | Reply) -> list:
        reply = _as_reply(reply)
        return [reply.pieces, sorted(reply.extra.items()), reply.logit]

    key = json.dumps(
        [[[t, spec(r)] for t, r in replies.items()], spec(default), template, list(extra_tokens)]
    )
    r = _resolve_cached(key, replies, default, template, tuple(extra_tokens))
    present = set(tokens)
    active = None
    for t, tid in enumerate(r.triggers):
        if tid in present:
            active = t
    cur = tokens[-1]
    after = cur if cur in r.chains[active] else None
    out = np.zeros(r.vocab_size, np.float32)
    for step in r.steps:
        if step.owner == active and step.after == after:
            for tid, logit in step.row.items():
                out[tid] = logit
    return out


_RESOLVED: dict[str, _Resolved] = {}


def _resolve_cached(key: str, replies, default, template, extra_tokens) -> _Resolved:
    if key not in _RESOLVED:
        _RESOLVED[key] = _resolve(replies, default, template, extra_tokens)
    return _RESOLVED[key]

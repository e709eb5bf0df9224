"""Where a chat prompt is worth a prompt-cache copy: its segments.

A cache that cannot be trimmed (a sliding window that has wrapped, a
recurrent state) is reusable only by a prompt that starts with exactly the
tokens it holds. Two places in a chat prompt are where later prompts
diverge, so the engine keeps a copy there while the prompt is processed, as
mlx-lm's server does:

- the end of the system prompt: a new conversation with the same system
  prompt starts with it;
- the start of the think tail: templates that open the reasoning block in
  the generation prompt (`<think>\\n`) render it differently once the turn is
  in the history, so the next turn starts with the prompt before it.

The engine also keeps all but the last prompt token (the next turn of a
template that drops earlier reasoning starts there) and the prompt with
its answer (the next turn of a template that keeps history verbatim).

Whatever the API or template, a prompt is also cut where it parts from
prompts the server has seen (`parting_points`): from a prompt beside it (a
system prompt or a document that sessions arriving together share, kept
as a system prompt) and from a prompt-cache entry that cannot be cut back
that far (a conversation whose history an agent rewrote, kept as
context). The next prompt to part there starts from that copy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from .prompt_cache import common_prefix
from .prompts import chat_tokens
from .requests import Checkpoint, Segment

THINK_TAIL = 11  # tokens from the end searched for an opening think marker (mlx-lm's)
PARTING_MIN = 128  # tokens a parting point must add to what a prompt starts from

log = logging.getLogger(__name__)
_reported: set[str] = set()  # reasons already logged, so each is said once


def chat_checkpoints(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    prompt: list[int],
    template_args: dict[str, Any] | None = None,
    tools: list[dict] | None = None,
) -> tuple[Checkpoint, ...]:
    """The system-prompt and think-tail checkpoints of a rendered chat `prompt`."""
    out = []
    system_end = _system_end(tokenizer, messages, prompt, template_args, tools)
    if 0 < system_end < len(prompt) - 1:
        out.append(Checkpoint(system_end, Segment.SYSTEM))
    tail = _think_tail(tokenizer, prompt)
    if system_end < tail < len(prompt) - 1:
        out.append(Checkpoint(tail, Segment.CONTEXT))
    return tuple(out)


def _system_end(tokenizer, messages, prompt, template_args, tools) -> int:
    """Tokens the system messages take at the start of `prompt` (0 if none),
    found as mlx-lm finds them: the system messages and an empty user turn
    rendered alone, compared with the prompt up to the first difference."""
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    if n == 0 or n == len(messages):
        return 0
    try:
        alone = chat_tokens(
            tokenizer,
            messages[:n] + [{"role": "user", "content": ""}],
            template_args,
            tools,
            add_generation_prompt=False,
        )
    except Exception as e:  # noqa: BLE001 - any template error: the prompt itself rendered
        reason = f"{type(e).__name__}: {e}"
        if reason not in _reported:
            _reported.add(reason)
            log.warning(
                "system prompts are not cached for chats this template renders: it fails "
                "on the system messages with an empty user turn (%s); such requests run "
                "without a system-prompt prompt-cache copy", reason,
            )  # fmt: skip
        return 0
    for i, (a, b) in enumerate(zip(alone, prompt, strict=False)):
        if a != b:
            return i
    return 0


def _think_tail(tokenizer, prompt: list[int]) -> int:
    """Where an opening think marker in the last few tokens starts (len(prompt) if none)."""
    if not getattr(tokenizer, "has_thinking", False):
        return len(prompt)
    start = tokenizer.rfind_think_start(prompt, start=max(0, len(prompt) - THINK_TAIL))
    if start is None or start < 0:
        return len(prompt)
    return start


def parting_points(
    prompt: Sequence[int],
    covered: int,
    beside: Iterable[Sequence[int]] = (),
    held: Iterable[Sequence[int]] = (),
) -> tuple[Checkpoint, ...]:
    """Where `prompt` parts from the prompts `beside` it (queued or running:
    a `Segment.SYSTEM` checkpoint) and from the prompt cache's keys `held`
    (a `Segment.CONTEXT` one), the longest of each, when it adds at least
    `PARTING_MIN` tokens to the `covered` ones it starts from."""
    out = {}
    for others, segment in ((beside, Segment.SYSTEM), (held, Segment.CONTEXT)):
        length = max((common_prefix(o, prompt) for o in others), default=0)
        if covered + PARTING_MIN <= length < len(prompt) - 1 and length not in out:
            out[length] = segment
    return tuple(Checkpoint(n, s) for n, s in out.items())


def split_prompt(
    prompt: list[int], cached: int, checkpoints: tuple[Checkpoint, ...]
) -> tuple[list[list[int]], list[Segment]]:
    """The uncached part of `prompt` cut at the checkpoints past `cached`, and
    the segment each cut stores. The last cut, all but the last token, is
    made by mlx-lm's `BatchGenerator` itself and stores a `Segment.CONTEXT`."""
    at: dict[int, Segment] = {}  # the first checkpoint at a length names its segment
    for c in checkpoints:
        if cached < c.length < len(prompt) - 1:
            at.setdefault(c.length, c.segment)
    cuts = sorted(at.items())
    pieces, start = [], cached
    for length, _ in cuts:
        pieces.append(prompt[start:length])
        start = length
    pieces.append(prompt[start:])
    return pieces, [segment for _, segment in cuts] + [Segment.CONTEXT]

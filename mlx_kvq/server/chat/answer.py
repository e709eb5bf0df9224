"""An answer read back as parts, whichever API asked for it.

The two agent APIs read the answer as `Part`s: reasoning text, answer text
and parsed tool calls in the order the model wrote them, then one
`Finished` with the stop reason and usage (`Waiting` while the prompt is
read, `Failed` after the stream began). Chat completions read the same
`Answer`'s engine events and splitter directly, for their per-token
logprobs.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from mlx_kvq.engine import FinishEvent, PromptProgress, TokenEvent, Usage
from mlx_kvq.engine.stops import first_stop

from .generation import IDLE, Generation
from .job import ChatJob
from .json_tools import JsonToolOutput
from .output import ChatDelta, ChatOutput


class PartKind(str, Enum):
    REASONING = "reasoning"
    TEXT = "text"
    TOOL_CALL = "tool_call"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model's parser returned it

    def input(self) -> dict[str, Any]:
        """The arguments as an object (`{}` for text that is not a JSON object)."""
        try:
            value = json.loads(self.arguments or "{}")
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Part:
    """A piece of the answer: reasoning or answer text, or one tool call."""

    kind: PartKind
    text: str = ""
    call: ToolCall | None = None


class StopReason(str, Enum):
    END = "end"  # the model ended its answer
    TOOL_USE = "tool_use"  # it ended after calling tools
    LENGTH = "length"  # max tokens, or the end of the context
    STOP_SEQUENCE = "stop_sequence"  # one of the request's stop strings


@dataclass(frozen=True)
class Finished:
    reason: StopReason
    usage: Usage
    stop_sequence: str | None = None  # which stop string, for STOP_SEQUENCE


@dataclass(frozen=True)
class Waiting:
    """No output yet: the prompt is being read (`progress`) or the request waits for a slot."""

    progress: PromptProgress | None = None


@dataclass(frozen=True)
class Failed:
    """The request failed after its stream began."""

    status: int
    message: str
    code: str | None = None


Event = Part | Waiting | Finished | Failed


def delta_parts(delta: ChatDelta) -> list[Part]:
    """A splitter delta as parts (reasoning, then text, then calls: their order in one token)."""
    parts = []
    if delta.reasoning:
        parts.append(Part(PartKind.REASONING, delta.reasoning))
    if delta.content:
        parts.append(Part(PartKind.TEXT, delta.content))
    for c in delta.tool_calls:
        fn = c["function"]
        parts.append(Part(PartKind.TOOL_CALL, call=ToolCall(c["id"], fn["name"], fn["arguments"])))
    return parts


def merge_parts(parts: list[Part]) -> list[Part]:
    """Consecutive text (or reasoning) parts joined into one; calls stay apart."""
    out: list[Part] = []
    for p in parts:
        if out and p.kind != PartKind.TOOL_CALL and out[-1].kind == p.kind:
            out[-1] = Part(p.kind, out[-1].text + p.text)
        else:
            out.append(p)
    return out


class Answer:
    """One job running in the engine, read back as `Event`s.

    Each run of text or reasoning comes without its leading whitespace (the
    line breaks templates put between reasoning, answer and calls); a run
    that is only whitespace is left out. `reasoning_tokens` counts the
    tokens that added reasoning.
    """

    def __init__(self, generation: Generation, output: ChatOutput | JsonToolOutput, job: ChatJob,
                 tokenizer: Any):  # fmt: skip
        self.generation = generation
        self.output = output
        self.job = job
        self.tokenizer = tokenizer
        self.tokens: list[TokenEvent] = []
        self.reasoning_tokens = 0
        self._run: PartKind | None = None  # the kind of the run being written
        self._started = False  # whether that run has non-blank text yet

    async def events(self) -> AsyncIterator[Event]:
        """The answer as it is generated (a client that leaves cancels it)."""
        async for ev in self.generation.events():
            if isinstance(ev, TokenEvent):
                for part in self._token(ev):
                    yield part
            elif isinstance(ev, PromptProgress) or ev is IDLE:
                yield Waiting(ev if isinstance(ev, PromptProgress) else None)
            elif isinstance(ev, FinishEvent):
                for event in self._finish(ev):
                    yield event
            else:
                yield Failed(ev.status, ev.message, ev.code)

    async def collect(
        self, client_gone: Callable[[], Awaitable[None]]
    ) -> tuple[list[Part], Finished]:
        """The whole answer at once (cancelled as soon as `client_gone()` returns)."""
        tokens, fin = await self.generation.collect(client_gone)
        parts = [p for t in tokens for p in self._token(t)]
        *rest, finished = self._finish(fin)
        return merge_parts(parts + rest), finished

    def _token(self, ev: TokenEvent) -> list[Part]:
        self.tokens.append(ev)
        parts = self._trim(delta_parts(self.output.feed(ev.text)))
        if any(p.kind == PartKind.REASONING for p in parts):
            self.reasoning_tokens += 1
        return parts

    def _trim(self, parts: list[Part]) -> list[Part]:
        out = []
        for p in parts:
            if p.kind != self._run:
                self._run, self._started = p.kind, False
            if p.kind != PartKind.TOOL_CALL and not self._started:
                p = Part(p.kind, p.text.lstrip())
                if not p.text:
                    continue
                self._started = True
            out.append(p)
        return out

    def _finish(self, fin: FinishEvent) -> list[Part | Finished]:
        delta, reason = self.output.finish(fin.reason.value)
        stop = None
        if reason == "tool_calls":
            why = StopReason.TOOL_USE
        elif reason == "length":
            why = StopReason.LENGTH
        else:
            stop = self._stop_sequence()
            why = StopReason.END if stop is None else StopReason.STOP_SEQUENCE
        return [*self._trim(delta_parts(delta)), Finished(why, fin.usage, stop)]

    def _stop_sequence(self) -> str | None:
        """The stop string that ended the answer, or None when the model ended it
        (the engine leaves stop strings out of the text; the tokens still hold them)."""
        stops = list(self.job.sampling.stop)
        if not stops or (self.tokens and self.tokens[-1].eos):
            return None
        text = self.tokenizer.decode([t.token for t in self.tokens if not t.eos])
        cut = first_stop(text, stops)
        if cut is None:
            return None
        return min((s for s in stops if text.startswith(s, cut)), key=len, default=None)

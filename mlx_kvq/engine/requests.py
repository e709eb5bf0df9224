"""What flows into and out of the engine: requests, sampling settings, events.

Plain data, no MLX and no HTTP, so the server can build requests and read
events without knowing how the engine schedules them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

_ids = itertools.count(1)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. `temperature == 0` is greedy decoding."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass
class GenerationRequest:
    """One sequence to generate: prompt token ids plus sampling settings."""

    prompt: list[int]
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_ids))


@dataclass(frozen=True)
class TokenEvent:
    """One generated token and the text it released.

    `text` may be empty (an incomplete UTF-8 character, or text held back
    because it could be the start of a stop string). `eos` marks the model's
    end-of-sequence token, which is counted but never shown as text.
    """

    token: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    eos: bool = False


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class FinishEvent:
    """The sequence ended: `reason` is "stop" (EOS or stop string) or "length"."""

    reason: str
    usage: Usage


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed. `status` is the HTTP status the server should use."""

    message: str
    status: int = 500
    code: str | None = None


Event = TokenEvent | FinishEvent | ErrorEvent
EventSink = Callable[[Event], None]

"""What flows into and out of the engine: requests and events.

Plain data, no MLX and no HTTP, so the server can build requests and read
events without knowing how the engine schedules them. Everything crossing a
thread boundary is a small frozen dataclass; states and reasons are enums.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from ..sampling_params import SamplingParams

_ids = itertools.count(1)


class FinishReason(str, Enum):
    """Why a sequence ended (OpenAI's `finish_reason` values)."""

    STOP = "stop"  # the model's end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens, or the end of the context


class Segment(str, Enum):
    """What a prompt-cache entry holds, as mlx-lm's server names it; eviction
    takes answers first, then context, then system prompts (mlx-lm's order)."""

    SYSTEM = "system"  # the system prompt: a new conversation can start from it
    CONTEXT = "user"  # a prefix of a prompt (before its think tail, or all but its last token)
    ANSWER = "assistant"  # a prompt and the answer generated for it


@dataclass(frozen=True)
class Checkpoint:
    """Store the prompt cache after the first `length` prompt tokens, as `segment`."""

    length: int
    segment: Segment


class Outcome(str, Enum):
    """How a request ended, as counted in `/metrics` (`mlx_kvq_requests_total`)."""

    OK = "ok"
    CANCELLED = "cancelled"  # the client went away
    ERROR = "error"  # the request failed inside the engine
    REJECTED = "rejected"  # refused before generation (a 4xx)
    UNAUTHORIZED = "unauthorized"  # no or a wrong API key


class Rejection(str, Enum):
    """Why the engine refused a request before running it, as counted in
    `/metrics` (`mlx_kvq_rejections_total`)."""

    KV_BUDGET = "kv_budget"  # its sequence cannot fit the KV memory budget, even alone (400)
    QUEUE_FULL = "queue_full"  # --max-queued-requests are already waiting (429)


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate: prompt token ids plus sampling settings."""

    prompt: tuple[int, ...]
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_ids))
    progress: bool = False  # send `PromptProgress` events while the prompt is processed
    # Where the prompt cache keeps a copy while the prompt is processed, besides
    # all but the last token (see `engine.segments`).
    checkpoints: tuple[Checkpoint, ...] = ()
    # Tokens the draft model proposes per step (speculative decoding); 0: none.
    draft_tokens: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(self.prompt))
        object.__setattr__(self, "checkpoints", tuple(self.checkpoints))


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
    """The sequence ended."""

    reason: FinishReason
    usage: Usage


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed. `status` is the HTTP status the server should use."""

    message: str
    status: int = 500
    code: str | None = None
    retry_after: int | None = None  # seconds, for a refusal worth retrying (429)


@dataclass(frozen=True)
class PromptProgress:
    """`processed` of the `total` prompt tokens this request prefills are done
    (sent after each prefill step, to requests that asked for progress)."""

    processed: int
    total: int


Event = TokenEvent | FinishEvent | ErrorEvent | PromptProgress
EventSink = Callable[[Event], None]


# -- the engine's inbox: what other threads ask of the engine thread ----------------
@dataclass(frozen=True)
class Submit:
    """Generate `request`; its events go to `sink` (called on the engine thread)."""

    request: GenerationRequest
    sink: EventSink


@dataclass(frozen=True)
class Cancel:
    """Drop a request whose client went away."""

    request_id: int


@dataclass(frozen=True)
class Stop:
    """Stop the engine: requests still running get an error."""


Message = Submit | Cancel | Stop

"""Speculative decoding beside the batch: one sequence at a time.

mlx-lm's speculative loop (`speculative_generate_step`) decodes one sequence:
the draft model proposes tokens, the model checks them in one forward pass,
both caches are rewound past the rejected ones. The `SpeculativeLane` runs
that loop for one request, on caches from the KV plans (quantized, windows
made rewindable: `mlx_kvq.speculative`), one unit of work per engine step:
a prefill chunk, then one draft-and-verify cycle per step. The engine runs the
lane only while it serves nothing else: when another request arrives, the
lane's sequence moves into the batch with its cache and goes on there (see
`Engine._admit`), so speculation never slows another request down.

The lane prefills the prompt itself, chunk by chunk, cut where the prompt
cache keeps copies (`engine.segments`), so that a long prompt never holds
the batch back for more than one chunk; mlx-lm's loop then starts from the
last prompt token.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream, speculative_generate_step

from mlx_kvq.plan import KVPlan
from mlx_kvq.speculative import end_speculation, prepare_for_speculation

from .requests import Checkpoint, Segment


@dataclass(frozen=True)
class DraftModel:
    """The draft model the engine speculates with, and its KV plan."""

    model: Any
    plan: KVPlan
    name: str
    num_draft_tokens: int


@dataclass(frozen=True)
class LaneToken:
    """One token the speculative loop produced; `from_draft`: the draft's, accepted."""

    token: int
    logprobs: mx.array
    from_draft: bool


@dataclass
class LaneWork:
    """What one lane step did, for the engine to report."""

    tokens: list[LaneToken] = field(default_factory=list)
    snapshots: list[tuple[list[int], list, Segment]] = field(default_factory=list)
    prompt_tokens: int = 0
    prompt_time: float = 0.0
    decode_time: float = 0.0
    proposed: int = 0  # draft tokens proposed in this step's cycle


@dataclass
class _Chunk:
    target: bool  # the model's cache (else the draft model's)
    start: int
    end: int
    segment: Segment | None  # a prompt-cache copy of the model's cache after it


def chunks(n: int, cached: int, checkpoints: tuple[Checkpoint, ...], step: int) -> list[_Chunk]:
    """Prefill work for a prompt of `n` tokens, `cached` of them in the model's
    cache: the draft model's prompt, then the model's, both without the last
    token, the model's cut at the checkpoints (each stores a copy)."""
    out = [_Chunk(False, s, min(s + step, n - 1), None) for s in range(0, n - 1, step)]
    cuts = {c.length: c.segment for c in checkpoints if cached < c.length < n - 1}
    cuts[n - 1] = Segment.CONTEXT
    start = cached
    for end in sorted(cuts):
        if end <= start:
            continue
        for s in range(start, end, step):
            e = min(s + step, end)
            out.append(_Chunk(True, s, e, cuts[end] if e == end else None))
        start = end
    return out


class SpeculativeLane:
    """One sequence decoded by mlx-lm's speculative loop; see the module docstring."""

    def __init__(self, model: Any, draft: DraftModel, prefill_step_size: int):
        self.model = model
        self.draft = draft
        self.prefill_step_size = prefill_step_size
        self.owner: Any = None  # what the engine serves here (None: the lane is free)
        self._prompt: list[int] = []
        self._cache: list = []
        self._draft_cache: list = []
        self._work: list[_Chunk] = []
        self._steps: Iterator | None = None
        self._start_args: dict[str, Any] = {}
        self._generated: list[int] = []
        self._num_draft = 0
        self._max_tokens = 0

    @property
    def busy(self) -> bool:
        return self.owner is not None

    def start(
        self,
        owner: Any,
        prompt: list[int],
        cache: list,
        cached: int,
        *,
        max_tokens: int,
        num_draft_tokens: int,
        sampler: Callable,
        checkpoints: tuple[Checkpoint, ...] = (),
        logits_processors: list | None = None,
    ) -> None:
        """Serve `owner`: `cache` (the model's, holding `prompt[:cached]`) is the lane's now."""
        self.owner = owner
        self._prompt = list(prompt)
        self._cache = prepare_for_speculation(cache, num_draft_tokens)
        self._draft_cache = prepare_for_speculation(self.draft.plan.make_cache(), num_draft_tokens)
        self._work = chunks(len(prompt), cached, checkpoints, self.prefill_step_size)
        self._generated = []
        self._num_draft = num_draft_tokens
        self._max_tokens = max_tokens
        self._start_args = dict(sampler=sampler, logits_processors=logits_processors)
        self._steps = None

    def step(self) -> LaneWork:
        """One prefill chunk, or one draft-and-verify cycle (its tokens one by one
        through `LaneWork.tokens`, ending with the model's own token)."""
        work = LaneWork()
        with mx.stream(generation_stream):
            if self._work:
                self._prefill(self._work.pop(0), work)
            else:
                self._cycle(work)
        return work

    def _prefill(self, chunk: _Chunk, work: LaneWork) -> None:
        t0 = time.perf_counter()
        model, cache = (self.model, self._cache) if chunk.target else (
            self.draft.model, self._draft_cache
        )  # fmt: skip
        model(mx.array(self._prompt[chunk.start : chunk.end])[None], cache=cache)
        mx.eval([c.state for c in cache])
        if chunk.target:
            work.prompt_tokens += chunk.end - chunk.start
            work.prompt_time += time.perf_counter() - t0
            if chunk.segment is not None:
                snapshot = end_speculation(copy.deepcopy(self._cache))
                work.snapshots.append((self._prompt[: chunk.end], snapshot, chunk.segment))

    def _cycle(self, work: LaneWork) -> None:
        t0 = time.perf_counter()
        if self._steps is None:
            self._steps = speculative_generate_step(
                mx.array(self._prompt[-1:]),
                self.model,
                self.draft.model,
                num_draft_tokens=self._num_draft,
                max_tokens=self._max_tokens,
                prompt_cache=self._cache + self._draft_cache,
                **self._start_args,
            )
        work.proposed = min(self._num_draft, self._max_tokens - len(self._generated))
        for token, logprobs, from_draft in self._steps:
            work.tokens.append(LaneToken(int(token), logprobs, bool(from_draft)))
            self._generated.append(int(token))
            if not from_draft:
                break
        work.decode_time = time.perf_counter() - t0

    def take(self, emitted: int, leave: int = 0) -> tuple[list, list[int], list[int]]:
        """Free the lane after `emitted` generated tokens: the model's cache,
        rewound to hold all but at least `leave` of the sequence's tokens and
        ready for the prompt cache or the batch; the tokens it holds; the rest."""
        if self._steps is not None:
            self._steps.close()  # mlx-lm's loop rewinds both caches on the way out
        tokens = self._prompt + self._generated[:emitted]
        held = next((c.offset for c in self._cache if isinstance(c.offset, int)), 0)
        if held > len(tokens) - leave:  # past the end (or the tokens to leave): rewind
            for c in self._cache:
                c.trim(held - (len(tokens) - leave))
            held = len(tokens) - leave
        cache = end_speculation(self._cache)
        self.drop()
        return cache, tokens[:held], tokens[held:]

    def drop(self) -> None:
        """Free the lane (the request finished, failed or was cancelled)."""
        self.owner = None
        self._steps = None
        self._cache, self._draft_cache, self._work = [], [], []

    @property
    def model_cache(self) -> list:
        return list(self._cache)

    @property
    def draft_cache(self) -> list:
        return list(self._draft_cache)

    def caches(self) -> list:
        """Every cache the lane holds (the model's and the draft model's)."""
        return self.model_cache + self.draft_cache

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self.caches())

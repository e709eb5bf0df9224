"""Per-request samplers and log-probability read-out for the batch.

Samplers are mlx-lm's `make_sampler` (temperature, top-p, min-p, XTC,
top-k, with mlx_lm.server's XTC special tokens: newline and EOS). Unseeded
requests with the same settings share one sampler object, so mlx-lm's
`GenerationBatch` samples them in one batched call. A seeded request gets its
own random key chain: its draws do not depend on which other requests share
the batch, so seeding never has to turn batching off.

Every sampler is handed out inside a `Guarded` wrapper: a sampler that
raises must fail its own requests, not the batch step that all requests
share (one request must never fail the others), so the wrapper records the error, returns greedy tokens
to keep the step going, and the engine fails the requests using it.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    apply_xtc,
    greedy_sampler,
    make_sampler,
)

from .requests import SamplingParams

Sampler = Callable[[mx.array], mx.array]


class Guarded:
    """A sampler whose failure is recorded instead of raised (see the module docstring)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.error: Exception | None = None

    def __call__(self, logprobs: mx.array) -> mx.array:
        try:
            return self.sampler(logprobs)
        except Exception as e:  # noqa: BLE001 - the engine fails this sampler's requests
            self.error = self.error or e
            return mx.argmax(logprobs, axis=-1)

    def take_error(self) -> Exception | None:
        """The recorded failure, cleared."""
        error, self.error = self.error, None
        return error


class SamplerPool:
    """Hands out guarded samplers, sharing one object per unseeded setting.

    `vocab` is the width of the model's logits once known: a `top_k` at or
    above it keeps every token, so it is treated as off (mlx-lm's top-k
    raises instead). `xtc_special` are the tokens XTC never removes
    (mlx_lm.server's: the newline's tokens and EOS).
    """

    def __init__(self, vocab: int | None = None, xtc_special: tuple[int, ...] = ()) -> None:
        self.vocab = vocab
        self.xtc_special = list(xtc_special)
        self._greedy = Guarded(greedy_sampler)
        self._shared: dict[tuple, Guarded] = {}

    def get(self, p: SamplingParams) -> Guarded:
        if p.temperature == 0:
            return self._greedy
        top_k = 0 if self.vocab is not None and p.top_k >= self.vocab else p.top_k
        if p.seed is not None:
            return Guarded(seeded_sampler(p, top_k, self.xtc_special))
        key = (p.temperature, p.top_p, top_k, p.min_p, p.xtc_probability, p.xtc_threshold)
        if key not in self._shared:
            if len(self._shared) > 64:
                self._shared.clear()
            self._shared[key] = Guarded(
                make_sampler(
                    temp=p.temperature,
                    top_p=p.top_p,
                    min_p=p.min_p,
                    top_k=top_k,
                    xtc_probability=p.xtc_probability,
                    xtc_threshold=p.xtc_threshold,
                    xtc_special_tokens=self.xtc_special,
                )
            )
        return self._shared[key]


def seeded_sampler(p: SamplingParams, top_k: int, xtc_special: list[int] | None = None) -> Sampler:
    """A sampler drawing from its own key chain, started at `p.seed`: mlx-lm's
    `make_sampler` chain (top-p, min-p, XTC, top-k, then a categorical draw)
    with every random draw keyed."""
    state = [mx.random.key(p.seed)]

    def sample(logprobs: mx.array) -> mx.array:
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p > 0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.xtc_probability > 0:
            state[0], sub = mx.random.split(state[0])
            # apply_xtc with probability 1 is XTC's cut; whether to cut is this chain's draw
            cut = apply_xtc(logprobs, 1.0, p.xtc_threshold, xtc_special or [])
            logprobs = mx.where(mx.random.uniform(key=sub) > p.xtc_probability, logprobs, cut)
        if top_k > 0:
            logprobs = apply_top_k(logprobs, top_k)
        state[0], sub = mx.random.split(state[0])
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=sub)

    return sample


def top_logprobs(logprobs: mx.array, k: int) -> tuple[tuple[int, float], ...]:
    """The `k` most likely tokens of one row of log-probabilities, best first."""
    if k <= 0:
        return ()
    k = min(k, logprobs.shape[-1])
    idx = mx.argpartition(-logprobs, kth=k - 1)[:k]
    vals = logprobs[idx]
    order = mx.argsort(-vals)
    idx, vals = idx[order].tolist(), vals[order].tolist()
    return tuple(zip(idx, vals, strict=True))

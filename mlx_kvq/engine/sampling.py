"""Per-request samplers and log-probability read-out for the batch.

Unseeded requests with the same settings share one sampler object, so
mlx-lm's `GenerationBatch` samples them in one batched call. A seeded request
gets its own random key chain: its draws do not depend on which other
requests share the batch, so seeding never has to turn batching off.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_sampler,
)

from .requests import SamplingParams

Sampler = Callable[[mx.array], mx.array]


class SamplerPool:
    """Hands out samplers, sharing one object per unseeded setting."""

    def __init__(self) -> None:
        self._shared: dict[tuple, Sampler] = {}

    def get(self, p: SamplingParams) -> Sampler:
        if p.temperature == 0:
            return greedy_sampler
        if p.seed is not None:
            return seeded_sampler(p)
        key = (p.temperature, p.top_p, p.top_k, p.min_p)
        if key not in self._shared:
            if len(self._shared) > 64:
                self._shared.clear()
            self._shared[key] = make_sampler(
                temp=p.temperature, top_p=p.top_p, min_p=p.min_p, top_k=p.top_k
            )
        return self._shared[key]


def seeded_sampler(p: SamplingParams) -> Sampler:
    """A sampler drawing from its own key chain, started at `p.seed`."""
    state = [mx.random.key(p.seed)]

    def sample(logprobs: mx.array) -> mx.array:
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p > 0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
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

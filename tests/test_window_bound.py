"""A quantized sliding window holds a bounded number of bytes, forever.

Bytes are summed over every array in the cache's `state` (what a prompt file
would store), not taken from `nbytes`, so nothing hides outside the ring.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_kvq.caches import KVQBatchWindowCache, KVQWindowCache
from mlx_kvq.config import QuantSpec

H, D, MAX = 2, 64, 16
STEPS = 1000


def state_bytes(cache) -> int:
    return sum(v.nbytes for _, v in tree_flatten(cache.state) if isinstance(v, mx.array))


def ring_bytes(spec: QuantSpec, batch: int, slots: int) -> int:
    """Packed data + 16-bit scales and biases for `slots` tokens, K and V."""
    per_token = H * (D * spec.bits // 8 + 2 * 2 * D // spec.group_size)
    return 2 * batch * slots * per_token


def _kv(rng, b: int, n: int):
    x = mx.array(rng.standard_normal((b, H, n, D)).astype(np.float32))
    return x, x * 2


@pytest.mark.parametrize("bits,keep", [(4, 0), (8, 4), (2, 0)])
def test_single_window_bytes_constant(bits, keep):
    spec = QuantSpec(bits)
    rng = np.random.default_rng(bits)
    cache = KVQWindowCache(MAX, spec, spec, keep=keep)
    cache.update_and_fetch(*_kv(rng, 1, 3 * MAX))  # prefill longer than the window
    cache.update_and_fetch(*_kv(rng, 1, 1))  # first decode trims the over-long prefill
    mx.eval(cache.state)
    held = state_bytes(cache)
    # The arrays of the state are exactly the ring: max_size token slots.
    assert held == ring_bytes(spec, 1, MAX)
    for step in range(STEPS):
        cache.update_and_fetch(*_kv(rng, 1, 1))
        if step % 50 == 0:
            mx.eval(cache.state)
        assert state_bytes(cache) == held, step
    assert cache.offset == 3 * MAX + 1 + STEPS
    assert cache.size() == MAX


def test_batched_window_bytes_constant():
    spec = QuantSpec(4)
    rng = np.random.default_rng(0)
    singles = []
    for n in (5, 2 * MAX, MAX + 3):  # one not yet full, two past the window
        c = KVQWindowCache(MAX, spec, spec)
        c.update_and_fetch(*_kv(rng, 1, n))
        singles.append(c)
    batch = KVQWindowCache.merge(singles)
    assert type(batch) is KVQBatchWindowCache
    assert np.array(batch.offset).tolist() == [5, 2 * MAX, MAX + 3]
    for _ in range(MAX):  # fill every row's window
        batch.update_and_fetch(*_kv(rng, 3, 1))
    mx.eval(batch.state)
    held = state_bytes(batch)
    bookkeeping = batch.offset.nbytes + batch.left_padding.nbytes
    assert held == ring_bytes(spec, 3, MAX) + bookkeeping
    for step in range(STEPS):
        batch.update_and_fetch(*_kv(rng, 3, 1))
        if step % 50 == 0:
            mx.eval(batch.state)
        assert state_bytes(batch) == held, step
    assert np.array(batch.offset).tolist() == [n + MAX + STEPS for n in (5, 2 * MAX, MAX + 3)]


def test_window_bytes_return_to_bound_after_prefill_chunks():
    """A prefill chunk may hold max_size - 1 + N slots for that step (as
    mlx-lm); the next decode step brings the ring back to max_size."""
    spec = QuantSpec(4)
    rng = np.random.default_rng(1)
    cache = KVQWindowCache(MAX, spec, spec)
    cache.update_and_fetch(*_kv(rng, 1, MAX + 1))
    cache.update_and_fetch(*_kv(rng, 1, 1))
    held = state_bytes(cache)
    for _ in range(20):
        cache.update_and_fetch(*_kv(rng, 1, 7))
        assert state_bytes(cache) == ring_bytes(spec, 1, MAX - 1 + 7)
        for _ in range(5):
            cache.update_and_fetch(*_kv(rng, 1, 1))
            assert state_bytes(cache) == held

"""Rewindable sliding windows (`KVQWindowCache.set_rewind`), against a reference.

Any mix of multi-token and one-token updates, with trims of at most the
rewind depth and of at most the tokens added since the last trim (what
speculative decoding does), leaves the window holding exactly what a fresh
window fed only the surviving tokens holds: the same sink tokens, the same
last `max_size - keep` tokens (bit for bit: stored rows are per-token), the
same offset; and the bytes stay bounded.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mlx_kvq.caches import KVQWindowCache
from mlx_kvq.config import QuantSpec

H, D = 2, 64


def rows(positions: list[int]) -> tuple[mx.array, mx.array]:
    """Keys and values for tokens at `positions`: fixed per position."""
    ks = [mx.random.normal((1, H, 1, D), key=mx.random.key(p)) for p in positions]
    vs = [mx.random.normal((1, H, 1, D), key=mx.random.key(10_000 + p)) for p in positions]
    return mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)


def held(c: KVQWindowCache) -> tuple[np.ndarray, np.ndarray]:
    """(sink rows, last max_size - keep token rows) in temporal order, dequantized."""
    if c.offset == 0:
        return np.zeros(0), np.zeros(0)
    k = c._temporal_order(c.keys).dequantize(mx.float32)
    n = min(c.offset, c.max_size) - c.keep
    return np.array(k[..., : c.keep, :]), np.array(k[..., k.shape[2] - n :, :])


def window(max_size: int, keep: int, bits: int | None) -> KVQWindowCache:
    spec = QuantSpec(bits, 64)
    return KVQWindowCache(max_size, spec, spec, keep=keep)


@settings(max_examples=60, deadline=None)
@given(
    max_size=st.sampled_from([6, 9]),
    keep=st.sampled_from([0, 2]),
    bits=st.sampled_from([None, 4]),
    depth=st.integers(1, 5),
    ops=st.lists(
        st.tuples(st.integers(1, 5), st.booleans(), st.integers(0, 5)), min_size=1, max_size=12
    ),
)
@example(  # rewound past the held tokens into the evicted ones, sinks kept
    max_size=6, keep=2, bits=None, depth=5, ops=[(1, False, 0), (1, False, 0), (5, True, 5)]
)
@example(  # a chunk left the buffer over the window: it is not evicted by a rewind
    max_size=6, keep=2, bits=None, depth=1, ops=[(1, False, 0)] * 4 + [(5, False, 1)]
)
def test_rewind_matches_a_window_fed_only_the_surviving_tokens(max_size, keep, bits, depth, ops):
    c = window(max_size, keep, bits)
    c.set_rewind(depth)
    surviving: list[int] = []
    position = 0
    for add, one_by_one, drop in ops:
        # a multi-token update (prefill, verification) or one-token updates (decoding)
        for n in [1] * add if one_by_one else [add]:
            k, v = rows(list(range(position, position + n)))
            c.update_and_fetch(k, v)
            surviving += list(range(position, position + n))
            position += n
        drop = min(drop, add, depth)
        if drop:
            assert c.is_trimmable()
            assert c.trim(drop) == drop
            surviving = surviving[:-drop]
            position -= drop  # the rewound positions are written again
        assert c.offset == len(surviving)
        assert c.keys.length <= max_size + depth + 5  # bounded (+ one concat chunk)
        if c._evicted is not None:
            assert c._evicted[0].length <= depth

        ref = window(max_size, keep, bits)
        for p in surviving:
            ref.update_and_fetch(*rows([p]))
        got_sinks, got = held(c)
        want_sinks, want = held(ref)
        np.testing.assert_array_equal(got_sinks, want_sinks)
        np.testing.assert_array_equal(got, want)


def test_without_rewind_a_wrapped_window_is_not_trimmable_and_set_rewind_0_frees():
    plain, c = window(6, 0, 4), window(6, 0, 4)
    for w in (plain, c):
        w.update_and_fetch(*rows(list(range(10))))
    assert not c.is_trimmable()
    c.set_rewind(3)
    for p in range(10, 15):
        for w in (plain, c):
            w.update_and_fetch(*rows([p]))
    # it holds exactly 3 more slots than a plain window: the last evicted ones
    slot = plain.nbytes // plain.keys.length
    assert c.is_trimmable() and c.nbytes == plain.nbytes + 3 * slot
    c.set_rewind(0)
    assert not c.is_trimmable() and c.nbytes == plain.nbytes

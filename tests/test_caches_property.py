"""Property tests: every quantized cache against mlx-lm's unquantized twin.

Hypothesis draws random sequences of prefill chunks, one-token decodes,
trims, state round trips and (for batches) merges, extracts, filters,
extends and right-padded prompts. Both caches get the same keys/values; after
every step the quantized cache must hand back K/V that dequantize to the
reference within the data-derived quantization bound, build identical masks
and agree on offsets and ring indices.
"""

from __future__ import annotations

import copy
import os

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kvq_testing.budget import WINDOWS_8BIT
from kvq_testing.helpers import (
    as_bool,
    assert_close_dequantized,
    assert_close_quantized,
    mask_equal,
    positional_mask,
)
from mlx_lm.models import cache as C

from mlx_kvq.caches import (
    DEQUANTIZED,
    PACKED,
    KVQBatchFullCache,
    KVQBatchWindowCache,
    KVQChunkedCache,
    KVQFullCache,
    KVQWindowCache,
)
from mlx_kvq.config import QuantSpec
from mlx_kvq.quant import QuantizedKV

H, DK, DV = 2, 64, 128

# KVQ_EXAMPLES=500 for a longer bug hunt; the default keeps the suite fast.
SETTINGS = settings(
    max_examples=int(os.environ.get("KVQ_EXAMPLES", "30")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

specs = st.sampled_from(
    [
        (QuantSpec(4), QuantSpec(4)),
        (QuantSpec(8), QuantSpec(8)),
        (QuantSpec(2, 32), QuantSpec(3, 32)),
        (QuantSpec(8, 64), QuantSpec(4, 128)),
        (QuantSpec(4, 64, "hadamard"), QuantSpec(6, 64, "hadamard")),
        (QuantSpec(None), QuantSpec(4)),
        # A per-token setting with wider windows: bounded layers (windows,
        # chunks) and the others (KVConfig.window_bits).
        WINDOWS_8BIT.specs(bounded=True),
        WINDOWS_8BIT.specs(bounded=False),
    ]
)


class Data:
    """Deterministic random K/V for one example."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def kv(self, b: int, n: int) -> tuple[mx.array, mx.array]:
        k = self.rng.standard_normal((b, H, n, DK)).astype(np.float32)
        v = self.rng.standard_normal((b, H, n, DV)).astype(np.float32) * 3
        return mx.array(k), mx.array(v)


def check_fetch(got, ref, what: str) -> None:
    gk, gv = got
    rk, rv = ref
    assert_close_quantized(gk, rk, f"{what} keys")
    assert_close_quantized(gv, rv, f"{what} values")


def expect_packed(got, kspec: QuantSpec, vspec: QuantSpec, converted: bool) -> None:
    gk, gv = got
    assert isinstance(gk, QuantizedKV) == (converted and kspec.quantized)
    assert isinstance(gv, QuantizedKV) == (converted and vspec.quantized)


def check_masks(ours, ref, n: int, windows, what: str) -> None:
    for ws in windows:
        for ra in (False, True):
            a = ours.make_mask(n, window_size=ws, return_array=ra)
            b = ref.make_mask(n, window_size=ws, return_array=ra)
            assert mask_equal(a, b), (what, n, ws, ra, a, b)


def exact_window_mask(ref, n: int, window: int) -> mx.array:
    """The mask the last chunk of `n` queries needed, from a batch window
    cache's state after it was written: each row's keys sit in time order after
    its left padding, and a query sees the keys at or before it within
    `window` tokens."""
    length = ref.keys.shape[2]
    pad = ref.left_padding[:, None, None, None]
    end = ref.offset[:, None, None, None]
    j = mx.arange(length)[None, None, None, :]
    key_pos = end - length + j
    query_pos = end - n + mx.arange(n)[None, None, :, None]
    return (j >= pad) & (key_pos <= query_pos) & (key_pos > query_pos - window)


def _reload(ours, how: int, data: Data, b: int = 1):
    """Continue with a restored (`from_state`, how=0) or deep-copied (how=1)
    cache. A deep copy must be independent: the original keeps being written."""
    mx.eval(ours.state)
    if how == 0:
        return type(ours).from_state(ours.state)
    new = copy.deepcopy(ours)
    if not ours.empty():
        ours.update_and_fetch(*data.kv(b, 1))
        mx.eval(ours.state)
    return new


# -- single sequence: full ------------------------------------------------------
single_ops = st.lists(
    st.one_of(
        st.tuples(st.just("prefill"), st.integers(2, 12)),
        st.tuples(st.just("decode"), st.integers(1, 6)),
        st.tuples(st.just("trim"), st.integers(1, 6)),
        st.tuples(st.just("reload"), st.integers(0, 1)),
    ),
    min_size=1,
    max_size=14,
)


@SETTINGS
@given(
    specs=specs,
    ops=single_ops,
    start=st.sampled_from([0, 0, 5, 17]),
    hand_out=st.sampled_from([PACKED, PACKED, DEQUANTIZED]),
    seed=st.integers(0, 2**31),
)
def test_full_cache_matches_kvcache(specs, ops, start, hand_out, seed):
    kspec, vspec = specs
    data = Data(seed)
    ours, ref = KVQFullCache(kspec, vspec, start=start, hand_out=hand_out), C.KVCache()
    converted = False
    for op, n in ops:
        if op == "trim":
            assert ours.is_trimmable() and ref.is_trimmable()
            assert ours.trim(n) == ref.trim(n)
        elif op == "reload":
            ours = _reload(ours, n, data)
        else:
            for _ in range(1 if op == "prefill" else n):
                m = n if op == "prefill" else 1
                check_masks(ours, ref, m, (None, 5), "full")
                converted |= ours.offset >= start
                k, v = data.kv(1, m)
                got, want = ours.update_and_fetch(k, v), ref.update_and_fetch(k, v)
                if hand_out == PACKED:
                    expect_packed(got, kspec, vspec, converted)
                    check_fetch(got, want, "full")
                else:
                    packed = _requantize(ours)
                    check_fetch(packed, want, "full (stored)")
                    for g, p, w in zip(got, packed, want, strict=True):
                        assert_close_dequantized(g, p, w, "dequantized hand-out")
        assert ours.offset == ref.offset
        assert ours.size() == ref.size()
        if ours.offset:
            assert ours.quantized == (converted and (kspec.quantized or vspec.quantized))


def _requantize(cache):
    """The stored K/V of a dequantized-hand-out cache in packed form."""
    saved = cache.hand_out
    cache.hand_out = PACKED
    try:
        return cache.keys_and_values()
    finally:
        cache.hand_out = saved


# -- single sequence: sliding window --------------------------------------------
@SETTINGS
@given(
    specs=specs,
    ops=single_ops,
    max_size=st.integers(8, 16),
    keep=st.sampled_from([0, 0, 2, 4]),
    start=st.sampled_from([0, 0, 9]),
    seed=st.integers(0, 2**31),
)
def test_window_cache_matches_rotating(specs, ops, max_size, keep, start, seed):
    kspec, vspec = specs
    data = Data(seed)
    ours = KVQWindowCache(max_size, kspec, vspec, keep=keep, start=start)
    ref = C.RotatingKVCache(max_size, keep=keep)
    # Tracks the absolute position each ring slot holds (mlx-lm's storage is
    # right; only its keep>0 one-token mask is not).
    where = C.RotatingKVCache(max_size, keep=keep)
    windows = (None, max_size // 2 + 1, max_size)
    converted = False
    for op, n in ops:
        if op == "trim":
            assert ours.is_trimmable() == ref.is_trimmable()
            if ref.is_trimmable():
                assert ours.trim(n) == ref.trim(n) == where.trim(n)
        elif op == "reload":
            ours = _reload(ours, n, data)
        else:
            for _ in range(1 if op == "prefill" else n):
                m = n if op == "prefill" else 1
                if m > 1 or keep == 0:
                    check_masks(ours, ref, m, windows, f"window keep={keep}")
                masks = {ws: ours.make_mask(1, window_size=ws) for ws in windows} if m == 1 else {}
                q_pos = ours.offset
                converted |= ours.offset >= start
                k, v = data.kv(1, m)
                got, want = ours.update_and_fetch(k, v), ref.update_and_fetch(k, v)
                pos = mx.arange(q_pos, q_pos + m, dtype=mx.float32)
                positions = where.update_and_fetch(
                    *(mx.broadcast_to(pos[None, None, :, None], (1, 1, m, 1)),) * 2
                )[0]
                expect_packed(got, kspec, vspec, converted)
                check_fetch(got, want, f"window keep={keep}")
                if m == 1:
                    slots = positions[0, 0, :, 0].astype(mx.int32)
                    for ws, mask in masks.items():
                        truth = positional_mask(slots, q_pos, ws)
                        assert np.array_equal(as_bool(mask, slots.size), truth), (ws, mask, slots)
        assert (ours.offset, ours._idx, ours.keep) == (ref.offset, ref._idx, ref.keep)
        assert ours.size() == ref.size()


# -- chunked (llama4) --------------------------------------------------------------
@SETTINGS
@given(specs=specs, ops=single_ops, chunk=st.integers(6, 12), seed=st.integers(0, 2**31))
def test_chunked_cache_matches_chunked(specs, ops, chunk, seed):
    kspec, vspec = specs
    data = Data(seed)
    ours, ref = KVQChunkedCache(chunk, kspec, vspec), C.ChunkedKVCache(chunk)
    for op, n in ops:
        if op == "trim":
            assert ours.trim(n) == ref.trim(n)
        elif op == "reload":
            ours = _reload(ours, n, data)
        else:
            for _ in range(1 if op == "prefill" else n):
                m = n if op == "prefill" else 1
                ours.maybe_trim_front()
                ref.maybe_trim_front()
                k, v = data.kv(1, m)
                check_fetch(ours.update_and_fetch(k, v), ref.update_and_fetch(k, v), "chunked")
        assert (ours.offset, ours.start_position) == (ref.offset, ref.start_position)


# -- batches ------------------------------------------------------------------------
batch_ops = st.lists(
    st.one_of(
        st.tuples(st.just("prefill"), st.integers(2, 10)),
        st.tuples(st.just("decode"), st.integers(1, 8)),
        st.tuples(st.just("trim"), st.integers(1, 4)),
        st.tuples(st.just("filter"), st.integers(0, 2**16)),
        st.tuples(st.just("extend"), st.integers(0, 2**16)),
        st.tuples(st.just("extract"), st.integers(0, 2**16)),
        st.tuples(st.just("right_padded"), st.integers(0, 2**16)),
        st.tuples(st.just("reload"), st.integers(0, 1)),
    ),
    min_size=1,
    max_size=10,
)


def _fill_singles(data, lengths, make_pair):
    """Single caches filled to `lengths` (a prefill chunk then decodes)."""
    ours, refs = [], []
    for n in lengths:
        q, r = make_pair()
        done = 0
        while done < n:
            m = n - done if done == 0 and n - done > 1 else 1
            m = min(m, 6) if m > 1 else 1
            k, v = data.kv(1, m)
            q.update_and_fetch(k, v)
            r.update_and_fetch(k, v)
            done += m
        ours.append(q)
        refs.append(r)
    return ours, refs


def _merged(data, rng, make_pair, max_len, windowed):
    b = int(rng.integers(1, 4))
    lengths = [int(x) for x in rng.integers(0, max_len, size=b)]
    singles_q, singles_r = _fill_singles(data, lengths, make_pair)
    q = type(singles_q[0]).merge(singles_q)
    r = type(singles_r[0]).merge(singles_r)
    assert type(q) is (KVQBatchWindowCache if windowed else KVQBatchFullCache)
    return q, r


def _check_batch_state(ours, ref, windowed: bool) -> None:
    assert np.array_equal(np.array(ours.offset), np.array(ref.offset))
    assert np.array_equal(np.array(ours.left_padding), np.array(ref.left_padding))
    assert ours._idx == ref._idx
    assert ours.size() == ref.size()
    if windowed:
        assert (ours._offset, ours.rotated) == (ref._offset, ref.rotated)


def _run_batch(specs, ops, seed, windowed: bool, max_size: int = 12):
    kspec, vspec = specs
    data = Data(seed)
    rng = np.random.default_rng(seed + 1)
    starts = np.random.default_rng(seed + 2)
    if windowed:

        def make_pair():
            start = int(starts.choice([0, 0, 12]))  # some rows still raw when merged
            q = KVQWindowCache(max_size, kspec, vspec, start=start)
            return q, C.RotatingKVCache(max_size)

        windows = (None, max_size // 2, max_size)
    else:

        def make_pair():
            start = int(starts.choice([0, 0, 12]))
            return KVQFullCache(kspec, vspec, start=start), C.KVCache()

        windows = (None, 6)
    ours, ref = _merged(data, rng, make_pair, 20, windowed)
    for op, arg in ops:
        b = ref.offset.shape[0]
        if op in ("prefill", "decode"):
            for _ in range(1 if op == "prefill" else arg):
                m = arg if op == "prefill" else 1
                wrapped = windowed and m > 1 and ref.rotated
                if wrapped:  # mlx-lm's mask is wrong here: check ours against the exact one
                    masks = {ws: ours.make_mask(m, window_size=ws) for ws in windows}
                else:
                    check_masks(ours, ref, m, windows, f"batch windowed={windowed}")
                k, v = data.kv(b, m)
                check_fetch(ours.update_and_fetch(k, v), ref.update_and_fetch(k, v), "batch")
                if wrapped:
                    for ws, mask in masks.items():
                        want = exact_window_mask(ref, m, ws or max_size)
                        assert mask_equal(mask, want), ("chunk after a wrap", m, ws, mask, want)
        elif op == "trim":
            assert ours.is_trimmable() == ref.is_trimmable()
            # at most what every row holds: past that, rows hold negative counts
            # and mlx-lm's own cache fails the next write (the engine takes back
            # only tokens a row wrote: rejected drafts)
            n = min(arg, int(np.array(ref.offset).min()))
            if ref.is_trimmable() and n > 0:
                assert ours.trim(n) == ref.trim(n)
        elif op == "filter":
            keep = sorted(set(np.random.default_rng(arg).integers(0, b, size=b).tolist()))
            ours.filter(keep)
            ref.filter(keep)
        elif op == "extend":
            if b >= 5:
                continue
            oq, orf = _merged(data, np.random.default_rng(arg), make_pair, 20, windowed)
            ours.extend(oq)
            ref.extend(orf)
        elif op == "extract" and ref.keys is not None:  # mlx-lm cannot extract from empty
            i = arg % b
            q1, r1 = ours.extract(i), ref.extract(i)
            assert q1.offset == r1.offset
            if ref.keys is not None:
                check_fetch(q1.keys_and_values(), r1.keys_and_values(), "extracted")
                k, v = data.kv(1, 1)
                check_fetch(q1.update_and_fetch(k, v), r1.update_and_fetch(k, v), "extracted+1")
        elif op == "right_padded":
            lengths = [int(x) for x in np.random.default_rng(arg).integers(1, 8, size=b)]
            n = max(lengths)
            padding = [n - x for x in lengths]
            ours.prepare(lengths=lengths, right_padding=padding)
            ref.prepare(lengths=lengths, right_padding=padding)
            if not (windowed and n > 1 and ref.rotated):  # mlx-lm's mask is wrong there
                check_masks(ours, ref, n, windows[:1], "right padded")
            k, v = data.kv(b, n)
            check_fetch(ours.update_and_fetch(k, v), ref.update_and_fetch(k, v), "right padded")
            ours.finalize()
            ref.finalize()
            if ref.keys is not None:
                check_fetch(ours.keys_and_values(), ref.keys_and_values(), "finalized")
        elif op == "reload":
            ours = _reload(ours, arg, data, b)
        _check_batch_state(ours, ref, windowed)


@SETTINGS
@given(specs=specs, ops=batch_ops, seed=st.integers(0, 2**30))
@example(  # a row extracted with no tokens yet, rotated: nothing to transform
    specs=(QuantSpec(4, 64, "hadamard"), QuantSpec(6, 64, "hadamard")),
    ops=[("extend", 185), ("extract", 0)],
    seed=35082,
)
@example(  # trims past the shortest row, then a filter and a write: clamped to what rows hold
    specs=(QuantSpec(4, 64), QuantSpec(4, 64)),
    ops=[("trim", 1), ("trim", 3), ("filter", 95), ("prefill", 2)],
    seed=2,
)
def test_batch_full_cache_matches_batchkvcache(specs, ops, seed):
    _run_batch(specs, ops, seed, windowed=False)


@SETTINGS
@given(specs=specs, ops=batch_ops, max_size=st.integers(8, 14), seed=st.integers(0, 2**30))
def test_batch_window_cache_matches_batchrotating(specs, ops, max_size, seed):
    _run_batch(specs, ops, seed, windowed=True, max_size=max_size)


# -- quantized_kv_start and conversion of filled mlx-lm caches ------------------------
@pytest.mark.parametrize("start", [1, 7, 30])
def test_start_raw_until_start_then_quantized(start):
    data = Data(start)
    ours, ref = KVQFullCache(QuantSpec(4), QuantSpec(4), start=start), C.KVCache()
    for step in range(40):
        before = ours.offset
        k, v = data.kv(1, 3 if step == 0 else 1)
        got = ours.update_and_fetch(k, v)
        want = ref.update_and_fetch(k, v)
        assert isinstance(got[0], QuantizedKV) == (before >= start), (step, before)
        check_fetch(got, want, "start")
        if before < start:
            assert ours.nbytes == ref.nbytes  # raw storage, same buffer
    assert ours.quantized and ours.nbytes < ref.nbytes / 3


def _filled(cache, data, n_prefill, n_decode, b=1):
    k, v = data.kv(b, n_prefill)
    cache.update_and_fetch(k, v)
    for _ in range(n_decode):
        cache.update_and_fetch(*data.kv(b, 1))
    return cache


@pytest.mark.parametrize("n_prefill,n_decode", [(5, 0), (10, 9), (30, 13)])
@pytest.mark.parametrize("keep", [0, 3])
def test_convert_filled_rotating_preserves_ring(n_prefill, n_decode, keep):
    from mlx_kvq.caches import quantize_cache

    data = Data(n_prefill * 100 + n_decode)
    ref = _filled(C.RotatingKVCache(12, keep=keep), data, n_prefill, n_decode)
    mx.eval(ref.state)
    raw_k, raw_v = ref.keys, ref.values
    q = quantize_cache(ref, QuantSpec(4), QuantSpec(8))
    assert type(q) is KVQWindowCache
    assert (q.offset, q._idx, q.keep, q.max_size) == (ref.offset, ref._idx, ref.keep, ref.max_size)
    # Slot for slot, sink tokens included.
    assert_close_quantized(q.keys.fetch(), raw_k, "ring keys")
    assert_close_quantized(q.values.fetch(), raw_v, "ring values")
    for _ in range(15):
        k, v = data.kv(1, 1)
        assert mask_equal(q.make_mask(1), ref.make_mask(1))
        check_fetch(q.update_and_fetch(k, v), ref.update_and_fetch(k, v), "after convert")
        assert (q.offset, q._idx) == (ref.offset, ref._idx)
    k, v = data.kv(1, 4)
    check_fetch(q.update_and_fetch(k, v), ref.update_and_fetch(k, v), "concat after convert")


@pytest.mark.parametrize("start", [0, 8, 100])
def test_convert_filled_kvcache_and_chunked(start):
    from mlx_kvq.caches import quantize_cache

    data = Data(start)
    for ref in (C.KVCache(), C.ConcatenateKVCache()):
        _filled(ref, data, 9, 4)
        q = quantize_cache(ref, QuantSpec(4), QuantSpec(4), start=start)
        assert type(q) is KVQFullCache and q.offset == ref.offset == 13
        assert q.quantized == (13 >= start)
        for _ in range(3):
            k, v = data.kv(1, 1)
            check_fetch(q.update_and_fetch(k, v), ref.update_and_fetch(k, v), "full")
    ref = C.ChunkedKVCache(8)
    for n in (5, 6, 1, 1):
        ref.maybe_trim_front()
        ref.update_and_fetch(*data.kv(1, n))
    q = quantize_cache(ref, QuantSpec(4), QuantSpec(4), start=start)
    assert (q.offset, q.start_position) == (ref.offset, ref.start_position)
    for n in (1, 3):
        ref.maybe_trim_front()
        q.maybe_trim_front()
        k, v = data.kv(1, n)
        check_fetch(q.update_and_fetch(k, v), ref.update_and_fetch(k, v), "chunked")


@pytest.mark.parametrize("decode", [0, 3, 20])
def test_convert_filled_batch_caches(decode):
    from mlx_kvq.caches import quantize_cache

    data = Data(decode)
    for windowed in (False, True):
        singles = []
        for n in (3, 11, 7):
            c = C.RotatingKVCache(10) if windowed else C.KVCache()
            singles.append(_filled(c, data, n, 0))
        ref = type(singles[0]).merge(singles)
        for _ in range(decode):
            ref.update_and_fetch(*data.kv(3, 1))
        q = quantize_cache(ref, QuantSpec(4), QuantSpec(4))
        assert type(q) is (KVQBatchWindowCache if windowed else KVQBatchFullCache)
        _check_batch_state(q, ref, windowed)
        for _ in range(4):
            assert mask_equal(q.make_mask(1), ref.make_mask(1))
            k, v = data.kv(3, 1)
            check_fetch(q.update_and_fetch(k, v), ref.update_and_fetch(k, v), "batch convert")
        for i in range(3):
            check_fetch(q.extract(i).keys_and_values(), ref.extract(i).keys_and_values(), "ex")


@pytest.mark.parametrize("windowed", [False, True])
def test_convert_batch_between_prepare_and_finalize(windowed):
    """Conversion in the middle of a right-padded prompt keeps the pending
    padding, and the twin shares no array with the original."""
    from mlx_kvq.caches import quantize_cache

    data = Data(11)
    singles = [
        _filled(C.RotatingKVCache(10) if windowed else C.KVCache(), data, n, 0) for n in (3, 5)
    ]
    ref = type(singles[0]).merge(singles)
    ref.prepare(lengths=[4, 2], right_padding=[0, 2])
    ref.update_and_fetch(*data.kv(2, 4))
    q = quantize_cache(ref, QuantSpec(8), QuantSpec(8))
    ref.finalize()
    q.finalize()
    _check_batch_state(q, ref, windowed)
    check_fetch(q.keys_and_values(), ref.keys_and_values(), "finalized after convert")
    for _ in range(12):
        assert mask_equal(q.make_mask(1), ref.make_mask(1))
        k, v = data.kv(2, 1)
        check_fetch(q.update_and_fetch(k, v), ref.update_and_fetch(k, v), "decode after convert")
        _check_batch_state(q, ref, windowed)


@pytest.mark.parametrize("kind", ["rotating", "batch", "batch_rotating"])
def test_converted_raw_twin_does_not_alias_original(kind):
    """Below quantized_kv_start the twin stores raw arrays: writing to it
    must not write into the original cache (and vice versa)."""
    from mlx_kvq.caches import quantize_cache

    data = Data(12)
    if kind == "rotating":
        ref = _filled(C.RotatingKVCache(8), data, 5, 5)  # ring full: writes go in place
        b = 1
    else:

        def single():
            return C.RotatingKVCache(8) if kind == "batch_rotating" else C.KVCache()

        ref = type(single()).merge([_filled(single(), data, 6, 4), _filled(single(), data, 3, 0)])
        ref.update_and_fetch(*data.kv(2, 1))
        b = 2
    mx.eval(ref.state)
    snapshot = [mx.array(np.array(x)) for x in tree_flatten_arrays(ref.state)]
    q = quantize_cache(ref, QuantSpec(4), QuantSpec(4), start=1000)
    assert not q.quantized
    for _ in range(3):
        q.update_and_fetch(*data.kv(b, 1))
    mx.eval(q.state)
    after = tree_flatten_arrays(ref.state)
    assert all(mx.array_equal(x, y).item() for x, y in zip(snapshot, after, strict=True))


def tree_flatten_arrays(state) -> list:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(state) if isinstance(v, mx.array)]

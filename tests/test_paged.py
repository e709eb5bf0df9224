"""Paged caches: block pools, block tables, and attention read through them.

The property tests drive a paged batch through random prefills, right-padded
prompts, decodes, trims, filters, extends and forks (a row extracted and
added back, sharing its blocks), windows wrapping, and compare what
attention computes for every real query with the exact reference: each
row's whole history, stored with the same spec, attended with the exact
mask (a query at position p sees p - window + 1 .. p). They also compare it
with mlx-lm: its padded `BatchKVCache` for full attention, and one
`RotatingKVCache` per row for windows, which is exact. mlx-lm's
`BatchRotatingKVCache` only keeps the offsets in step: its mask for a
multi-token chunk after decodes have wrapped the ring is wrong for rows
with left padding (see `test_window_chunk_after_decodes_matches_exact_window`).
Attention over paged K/V runs by the native kernel and by the MLX path.
"""

from __future__ import annotations

import copy
import os

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as C

from mlx_kvq import attention
from mlx_kvq.caches import blocks_kept, keep_in_prompt_cache
from mlx_kvq.caches.base import DEQUANTIZED
from mlx_kvq.caches.paged import (
    BlockPool,
    KVQPagedFullCache,
    KVQPagedSequence,
    KVQPagedWindowCache,
    Pages,
)
from mlx_kvq.caches.window import KVQBatchWindowCache, KVQWindowCache
from mlx_kvq.config import QuantSpec
from mlx_kvq.kernels import native_status
from mlx_kvq.quant import PagedKV, Store

H, NQ, D = 2, 4, 64

SETTINGS = settings(
    max_examples=int(os.environ.get("KVQ_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

specs = st.sampled_from(
    [
        (QuantSpec(4), QuantSpec(4)),
        (QuantSpec(8, 64), QuantSpec(4, 32)),
        (QuantSpec(2, 32), QuantSpec(3, 32)),
        (QuantSpec(4, 64, "hadamard"), QuantSpec(6, 64, "hadamard")),
        (QuantSpec(6, 64, "hadamard"), QuantSpec(5, 64, "hadamard")),  # a default
        (QuantSpec(None), QuantSpec(4)),
        (QuantSpec(None), QuantSpec(None)),
    ]
)

NATIVE = native_status().available


class Data:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def kv(self, b: int, n: int) -> tuple[mx.array, mx.array]:
        k = self.rng.standard_normal((b, H, n, D)).astype(np.float32)
        v = self.rng.standard_normal((b, H, n, D)).astype(np.float32) * 3
        return mx.array(k), mx.array(v)

    def q(self, b: int, n: int) -> mx.array:
        return mx.array(self.rng.standard_normal((b, NQ, n, D)).astype(np.float32))


def _stored(x: mx.array, spec: QuantSpec) -> mx.array:
    """`x` as the pool stores it, back in float32."""
    return Store.encode(x, spec).dequantize(mx.float32)


def _reference(ref, q, k, v, kspec, vspec) -> mx.array:
    """mlx-lm's batch cache updated with k/v, attended with its own mask."""
    n = k.shape[2]
    mask = ref.make_mask(n, return_array=True)
    rk, rv = ref.update_and_fetch(k, v)
    if mask is not None and mask.ndim == 2:
        mask = mask[None, None]
    return mx.fast.scaled_dot_product_attention(
        q, _stored(rk, kspec), _stored(rv, vspec), scale=D**-0.5, mask=mask
    )


def _ours(cache, q, k, v, native: bool) -> mx.array:
    mask = cache.make_mask(k.shape[2])
    kk, vv = cache.update_and_fetch(k, v)
    assert isinstance(kk, PagedKV)
    was = attention._native
    attention._native = lambda: native and NATIVE
    try:
        return attention.scaled_dot_product_attention(q, kk, vv, None, D**-0.5, mask)
    finally:
        attention._native = was


def _exact(q, k, v, n, window, kspec, vspec) -> mx.array:
    """Attention of the last `n` of one row's whole history `k`/`v` (1, H, L, D)
    as the model was trained: a query at position p sees the keys at positions
    p - window + 1 .. p (all keys at or before p without a window)."""
    L = k.shape[2]
    qpos = mx.arange(L - n, L)[:, None]
    kpos = mx.arange(L)[None]
    mask = kpos <= qpos
    if window is not None:
        mask = mask & (kpos > qpos - window)
    return mx.fast.scaled_dot_product_attention(
        q, _stored(k, kspec), _stored(v, vspec), scale=D**-0.5, mask=mask[None, None]
    )


class Pair:
    """A paged batch kept in step with the exact reference (every row's whole
    history, attended with the exact causal or sliding-window mask) and with
    mlx-lm: its padded `BatchKVCache` for full attention, and for windows one
    `RotatingKVCache` per row (exact where its batch form is not: see the module docstring). mlx-lm's
    `BatchRotatingKVCache` follows too, for its offsets only."""

    def __init__(self, pool: BlockPool, window: int | None, kspec, vspec, data, native, rows=2):
        self.pool, self.window, self.data, self.native = pool, window, data, native
        self.kspec, self.vspec = kspec, vspec
        self.ours, self.ref = self._new(rows)
        empty = mx.zeros((1, H, 0, D))
        self.history: list[tuple[mx.array, mx.array]] = [(empty, empty)] * rows
        self.singles = [self._single_ref() for _ in range(rows)]

    def _single_ref(self):
        return C.KVCache() if self.window is None else C.RotatingKVCache(self.window)

    def _new(self, rows: int):
        ours = KVQPagedSequence.merge(
            [KVQPagedSequence(self.pool, self.window) for _ in range(rows)]
        )
        ref = type(self._single_ref()).merge([self._single_ref() for _ in range(rows)])
        return ours, ref

    @property
    def rows(self) -> int:
        return len(self.ours.tables)

    def _against_references(self, got, want, q, k, v, lengths, what) -> None:
        """Row b's real queries and tokens are its first `lengths[b]`."""
        for b, x in enumerate(lengths):
            hk, hv = self.history[b]
            hk = mx.concatenate([hk, k[b : b + 1, :, :x]], axis=2)
            hv = mx.concatenate([hv, v[b : b + 1, :, :x]], axis=2)
            self.history[b] = (hk, hv)
            if not x:
                continue
            g = got[b : b + 1, :, :x]
            exact = _exact(q[b : b + 1, :, :x], hk, hv, x, self.window, self.kspec, self.vspec)
            err = mx.abs(g - exact).max().item()
            assert err < 2e-3, f"{what}: row {b} differs from the exact reference by {err}"
            if self.window is None:
                err = mx.abs(g - want[b : b + 1, :, :x]).max().item()
                assert err < 2e-3, f"{what}: row {b} differs from BatchKVCache by {err}"
            else:
                single = self._single_step(b, q[b : b + 1, :, :x], k, v, x)
                err = mx.abs(g - single).max().item()
                assert err < 2e-3, f"{what}: row {b} differs from RotatingKVCache by {err}"

    def _single_step(self, b, q, k, v, x) -> mx.array:
        cache = self.singles[b]
        mask = cache.make_mask(x, return_array=True) if x > 1 else None
        sk, sv = cache.update_and_fetch(k[b : b + 1, :, :x], v[b : b + 1, :, :x])
        if mask is not None and mask.ndim == 2:
            mask = mask[None, None]
        return mx.fast.scaled_dot_product_attention(
            q, _stored(sk, self.kspec), _stored(sv, self.vspec), scale=D**-0.5, mask=mask
        )

    def step(self, n: int, what: str) -> None:
        b = self.rows
        if b == 0:
            return
        k, v = self.data.kv(b, n)
        q = self.data.q(b, n)
        got = _ours(self.ours, q, k, v, self.native)
        want = _reference(self.ref, q, k, v, self.kspec, self.vspec)
        self._against_references(got, want, q, k, v, [n] * b, what)
        self.check_offsets()

    def padded(self, lengths: list[int]) -> None:
        b = self.rows
        n = max(lengths)
        pad = [n - x for x in lengths]
        k, v = self.data.kv(b, n)
        q = self.data.q(b, n)
        self.ours.prepare(lengths=lengths, right_padding=pad)
        self.ref.prepare(lengths=lengths, right_padding=pad)
        before = [t.length for t in self.ours.tables]
        got = _ours(self.ours, q, k, v, self.native)
        # the padding is never written: each row holds its own tokens only
        assert [t.length for t in self.ours.tables] == [
            b + x for b, x in zip(before, lengths, strict=True)
        ]
        want = _reference(self.ref, q, k, v, self.kspec, self.vspec)
        self.ours.finalize()
        self.ref.finalize()
        self._against_references(got, want, q, k, v, lengths, "right padded")
        self.check_offsets()

    # -- the batch's rows, on every side ----------------------------------------
    def filter(self, keep: list[int]) -> None:
        self.ours.filter(keep)
        self.ref.filter(keep)
        self.history = [self.history[i] for i in keep]
        self.singles = [self.singles[i] for i in keep]

    def extend(self, other: Pair) -> None:
        self.ours.extend(other.ours)
        self.ref.extend(other.ref)
        self.history += other.history
        self.singles += other.singles

    def fork(self, i: int) -> None:
        one, ref_one = self.ours.extract(i), self.ref.extract(i)
        self.ours.extend(KVQPagedSequence.merge([one]))
        self.ref.extend(type(ref_one).merge([ref_one]))
        self.history.append(self.history[i])
        self.singles.append(copy.deepcopy(self.singles[i]))

    def trim(self, n: int) -> None:
        assert self.ours.trim(n) == self.ref.trim(n)
        self.history = [(k[:, :, :-n], v[:, :, :-n]) for k, v in self.history]
        for c in self.singles:
            c.trim(n)

    def check_offsets(self) -> None:
        assert self.ours.offset.tolist() == self.ref.offset.tolist()
        assert self.ours.offset.tolist() == [k.shape[2] for k, _ in self.history]
        if self.window is not None:
            # what the next query sees (window - 1 tokens), in whole blocks
            bs = self.pool.block_size
            for t in self.ours.tables:
                assert t.length - t.base <= max(0, self.window - 1) + bs - 1


ops = st.lists(
    st.one_of(
        st.tuples(st.just("prefill"), st.integers(2, 9)),
        st.tuples(st.just("decode"), st.integers(1, 12)),
        st.tuples(st.just("padded"), st.integers(0, 2**20)),
        st.tuples(st.just("add"), st.integers(0, 2**20)),
        st.tuples(st.just("filter"), st.integers(0, 2**20)),
        st.tuples(st.just("fork"), st.integers(0, 2**20)),
        st.tuples(st.just("trim"), st.integers(1, 5)),
        st.tuples(st.just("copy"), st.just(0)),
        st.tuples(st.just("compact"), st.just(0)),
    ),
    min_size=1,
    max_size=12,
)


def _run(kspec, vspec, window, block, script, seed, native, first=(3, 5)) -> BlockPool:
    data = Data(seed)
    pool = BlockPool(block, kspec, vspec, min_growth=2)
    pair = Pair(pool, window, kspec, vspec, data, native, rows=len(first))
    pair.padded(list(first))
    for op, arg in script:
        rng = np.random.default_rng(arg)
        b = pair.rows
        if op == "prefill":
            pair.step(arg, "prefill")
        elif op == "decode":
            for _ in range(arg):
                pair.step(1, "decode")
        elif op == "padded" and b:
            pair.padded([int(x) for x in rng.integers(1, 8, size=b)])
        elif op == "add" and b < 5:
            n = int(rng.integers(1, 3))
            side = Pair(pool, window, kspec, vspec, data, native, rows=n)
            side.padded([int(x) for x in rng.integers(1, 9, size=n)])
            pair.extend(side)
        elif op == "filter" and b:
            pair.filter(sorted(set(rng.integers(0, b, size=b).tolist())))
        elif op == "fork" and 0 < b < 5:
            pair.fork(int(rng.integers(0, b)))
        elif op == "trim" and b:
            # (mlx-lm trims a padded buffer: a row shorter than `arg` would go
            # negative; a window trims only before it wraps)
            trimmable = pair.ours.is_trimmable() and pair.ref.is_trimmable()
            if trimmable and arg < min(t.length for t in pair.ours.tables):
                pair.trim(arg)
        elif op == "copy":
            pair.ours = copy.deepcopy(pair.ours)  # the original is dropped: its blocks go back
        elif op == "compact":
            pool.compact()  # between steps: block ids renumbered under the batch's table array
        pair.check_offsets()
        _check_pool(pool, [pair.ours])
    return pool


def _check_pool(pool: BlockPool, caches) -> None:
    """Reference counts are exactly the references the tables hold."""
    counts = [0] * pool.capacity
    for c in caches:
        for t in c.tables:
            for i in t.ids:
                counts[i] += 1
    assert counts == pool.refs


@SETTINGS
@given(
    specs=specs,
    script=ops,
    block=st.sampled_from([1, 3, 4, 8]),
    native=st.booleans(),
    seed=st.integers(0, 2**30),
)
def test_paged_full_matches_batchkvcache(specs, script, block, native, seed):
    pool = _run(*specs, None, block, script, seed, native)
    del pool


@SETTINGS
@given(
    specs=specs,
    script=ops,
    window=st.integers(4, 11),
    block=st.sampled_from([1, 3, 4, 8]),
    native=st.booleans(),
    seed=st.integers(0, 2**30),
)
def test_paged_window_matches_exact_window(specs, script, window, block, native, seed):
    _run(*specs, window, block, script, seed, native)


@pytest.mark.parametrize(
    ("window", "script"),
    [(4, [("add", 8), ("decode", 1), ("prefill", 2)]), (11, [("decode", 7), ("prefill", 2)])],
)
def test_window_chunk_after_decodes_matches_exact_window(window, script):
    """The next turn's prompt, a chunk after decodes that wrapped the window.
    Here mlx-lm 0.32.2's `BatchRotatingKVCache` is off (by 1.28 in the second
    case, row 0): its mask for a chunk reads the ring's write index from before
    the update puts the ring in temporal order, so a row with left padding
    also hides its oldest tokens still in the window. The exact reference and
    mlx-lm's one-sequence `RotatingKVCache` agree with the paged cache."""
    _run(QuantSpec(4), QuantSpec(4), window, 1, script, 0, False)


def test_padded_window_chunk_after_decodes_matches_exact_window():
    """The padded layout in the case above, against the exact reference
    (mlx-lm 0.32's BatchRotatingKVCache, which it once mirrored, hides a
    left-padded row's oldest tokens still in the window here)."""
    data, window, spec = Data(0), 11, QuantSpec(4)
    rows = [KVQWindowCache(window, spec, spec, hand_out=DEQUANTIZED) for _ in range(2)]
    cache = KVQBatchWindowCache.merge(rows)
    history = [[], []]
    for lengths in ([3, 5], *[[1, 1]] * 7, [2, 2]):
        n = max(lengths)
        k, v = data.kv(2, n)
        q = data.q(2, n)
        cache.prepare(lengths=lengths, right_padding=[n - x for x in lengths])
        mask = cache.make_mask(n, return_array=True)
        ck, cv = cache.update_and_fetch(k, v)
        cache.finalize()
        out = mx.fast.scaled_dot_product_attention(q, ck, cv, scale=D**-0.5, mask=mask)
        for b, x in enumerate(lengths):
            history[b].append((k[b : b + 1, :, :x], v[b : b + 1, :, :x]))
            hk = mx.concatenate([h[0] for h in history[b]], axis=2)
            hv = mx.concatenate([h[1] for h in history[b]], axis=2)
            want = _exact(q[b : b + 1, :, :x], hk, hv, x, window, spec, spec)
            got = out[b : b + 1, :, :x]
            err = mx.abs(got - want).max().item()
            assert err < 2e-3, f"step of {n}: row {b} differs from the exact reference by {err}"


turns = st.lists(
    st.one_of(
        st.tuples(st.just("decode"), st.integers(1, 12)),
        st.tuples(st.just("prefill"), st.integers(2, 14)),
        st.tuples(st.just("padded"), st.integers(0, 2**20)),
        st.tuples(st.just("add"), st.integers(0, 2**20)),
        st.tuples(st.just("fork"), st.integers(0, 2**20)),
    ),
    min_size=2,
    max_size=10,
)


@SETTINGS
@given(
    script=turns,
    first=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    window=st.integers(2, 8),
    block=st.sampled_from([1, 2, 3, 4, 8]),
    native=st.booleans(),
    seed=st.integers(0, 2**30),
)
def test_paged_window_turns_match_exact_window(script, first, window, block, native, seed):
    """Chats taking turns: rows of different lengths decode past small windows
    (wrapping them), then take chunks longer or shorter than the window, and
    rows join or fork in between."""
    _run(QuantSpec(4), QuantSpec(4), window, block, script, seed, native, first=first)


# -- the pool --------------------------------------------------------------------
def _batch(pool, window=None, rows=1):
    return KVQPagedSequence.merge([KVQPagedSequence(pool, window) for _ in range(rows)])


def test_blocks_return_to_the_pool_when_the_last_reference_goes():
    pool = BlockPool(4, QuantSpec(4), QuantSpec(4))
    data = Data(0)
    batch = _batch(pool, rows=2)
    batch.update_and_fetch(*data.kv(2, 10))  # 3 blocks per row
    assert pool.used == 6
    entry = batch.extract(0)  # a prompt-cache entry: same blocks, one more reference
    assert pool.used == 6 and pool.stats().shared == 3
    batch.filter([1])
    assert pool.used == 6  # the entry still holds row 0's blocks
    del entry
    assert pool.used == 3
    del batch
    assert pool.used == 0 and all(r == 0 for r in pool.refs)


def test_shared_blocks_are_never_written_by_a_sequence_that_does_not_own_them():
    pool = BlockPool(4, QuantSpec(4), QuantSpec(8))
    data = Data(1)
    first = _batch(pool)
    first.update_and_fetch(*data.kv(1, 10))  # 2 full blocks and a partly filled one
    prefix = first.extract(0)
    del first
    shared = list(prefix.table.ids)
    before = [np.array(a[mx.array(shared)]) for a in (*pool.keys.parts, *pool.values.parts)]
    # Sixteen sequences start from the prefix, each writing its own tokens.
    rows = [copy.deepcopy(prefix) for _ in range(16)]
    batch = KVQPagedSequence.merge(rows)
    for _ in range(3):
        batch.update_and_fetch(*data.kv(16, 1))
        batch.update_and_fetch(*data.kv(16, 3))
    mx.eval(batch.state)
    after = [np.array(a[mx.array(shared)]) for a in (*pool.keys.parts, *pool.values.parts)]
    for a, b in zip(before, after, strict=True):
        assert np.array_equal(a, b)
    # the two full prefix blocks are held once; each row copied the partial one
    for t in batch.tables:
        assert t.ids[:2] == shared[:2] and t.ids[2] != shared[2]
    assert pool.refs[shared[0]] == 17 and pool.refs[shared[2]] == 1
    # what each row reads is the prefix, then its own tokens
    k, _ = batch.keys_and_values()
    want = PagedKV(k.pool, (tuple(shared),), (0,), (10,), 4).row(0)
    for b in range(16):
        got = k.row(b).map(lambda a: a[:, :, :10])
        for x, y in zip((got.data, got.scales), (want.data, want.scales), strict=True):
            assert mx.array_equal(x, y).item()


def test_window_rows_return_blocks_beyond_the_window():
    pool = BlockPool(4, QuantSpec(4), QuantSpec(4))
    data = Data(2)
    batch = _batch(pool, window=8, rows=3)
    batch.update_and_fetch(*data.kv(3, 5))
    for _ in range(60):
        batch.update_and_fetch(*data.kv(3, 1))
        for t in batch.tables:
            # the window's 7 earlier tokens and the new one, within whole blocks
            assert len(t.ids) <= -(-(8 + 4 - 1) // 4)
            assert t.length - t.base <= 8 + 4 - 1
    assert pool.used <= 3 * 3


def test_window_rows_read_again_after_a_write_see_what_it_saw():
    """KV-shared layers (gemma3n) read their owner's window after it wrote a
    chunk, for the same queries: the blocks the write returned are still read,
    until the pool gives one of them to another table."""
    pool = BlockPool(4, QuantSpec(4), QuantSpec(4))
    data = Data(3)
    batch = _batch(pool, window=8, rows=2)
    written, _ = batch.update_and_fetch(*data.kv(2, 20))
    assert [t.base for t in batch.tables] == [12, 12]  # the next query sees 13..20
    again, _ = batch.keys_and_values()
    assert again.ends == written.ends == (20, 20) and again.bases == written.bases == (0, 0)
    for b in range(2):
        x, y = again.row(b), written.row(b)
        assert mx.array_equal(x.data, y.data).item() and mx.array_equal(x.scales, y.scales).item()
    other = _batch(pool, window=8)
    other.update_and_fetch(*data.kv(1, 1))  # takes a block the window returned
    now, _ = batch.keys_and_values()
    assert now.bases == (12, 12) and _table_rows(now) == [t.ids for t in batch.tables]
    batch.update_and_fetch(*data.kv(2, 1))
    batch.filter([1])
    assert _table_rows(batch.keys_and_values()[0]) == [batch.tables[0].ids]


def test_a_window_row_trims_back_exactly_the_tokens_it_holds_past_its_window():
    """A finished window row keeps its next query's `window - 1` tokens to the
    start of a block: those past them come off exactly (what a prompt cache
    entry cut back to a shorter prompt gives), and no more."""
    pool = BlockPool(4, QuantSpec(4), QuantSpec(4))
    k, v = Data(4).kv(1, 31)
    batch = _batch(pool, window=8)
    for i in range(30):
        batch.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    entry = batch.extract(0)
    assert (entry.table.base, entry.table.length) == (20, 30)  # holds 10: 7 + 3 more
    assert entry.exact_trim() == 3 and entry.is_trimmable()
    assert entry.trim(3) == 3 and entry.offset == 27
    fresh = _batch(pool, window=8)
    for i in range(27):
        fresh.update_and_fetch(k[:, :, i : i + 1], v[:, :, i : i + 1])
    rows = KVQPagedSequence.merge([entry])
    got, _ = rows.update_and_fetch(k[:, :, 30:31], v[:, :, 30:31])
    want, _ = fresh.update_and_fetch(k[:, :, 30:31], v[:, :, 30:31])
    assert got.ends == want.ends == (28,)
    a, b = (x.row(0).map(lambda t: t[:, :, -8:]) for x in (got, want))
    assert mx.array_equal(a.data, b.data).item() and mx.array_equal(a.scales, b.scales).item()
    assert rows.extract(0).exact_trim() == 1  # holds 8: one more than its next query needs


def _table_rows(view: PagedKV) -> list[list[int]]:
    """The block ids each row of a view reads (its table array's used entries)."""
    bs = view.block_size
    return [
        view.tables[i, : -(-(e - b) // bs)].tolist()
        for i, (b, e) in enumerate(zip(view.bases, view.ends, strict=True))
    ]


def test_compaction_gives_back_free_blocks_and_renumbers_tables():
    pool = BlockPool(4, QuantSpec(4), QuantSpec(8))
    data = Data(5)
    batch = _batch(pool, rows=3)
    batch.update_and_fetch(*data.kv(3, 40))  # 10 blocks a row, interleaved
    entry = batch.extract(2)
    before = [batch.keys_and_values()[0].row(i) for i in (0, 2)]
    batch.filter([0, 2])  # row 1's blocks are free, between used ones
    capacity = pool.capacity
    pool.compact()
    assert pool.capacity == pool.used == 20 < capacity
    after = [batch.keys_and_values()[0].row(i) for i in (0, 1)]
    for a, b in zip(before, after, strict=True):
        assert mx.array_equal(a.data, b.data).item() and mx.array_equal(a.scales, b.scales).item()
    assert entry.table.ids == batch.tables[1].ids  # the entry was renumbered alike
    _check_pool(pool, [batch, entry])
    assert pool.refs == [2 if b in entry.table.ids else 1 for b in range(20)]


def test_decode_after_compaction_reads_the_renumbered_blocks():
    """A batch keeps its block tables as an array between steps; compaction
    renumbering the blocks under it (another batch's blocks freed in between)
    must not leave the next step reading the old ids."""
    pool = BlockPool(4, QuantSpec(4), QuantSpec(8))
    data = Data(6)
    batch, other = _batch(pool, rows=2), _batch(pool, rows=1)
    for _ in range(5):  # interleaved blocks: the other batch's fall between ours
        batch.update_and_fetch(*data.kv(2, 4))
        other.update_and_fetch(*data.kv(1, 4))
    kk, _ = batch.update_and_fetch(*data.kv(2, 1))
    before = [kk.row(i) for i in range(2)]
    other.filter([])
    pool.compact()
    assert pool.capacity == pool.used == 12
    kk, _ = batch.update_and_fetch(*data.kv(2, 1))
    for i, t in enumerate(batch.tables):
        assert kk.tables[i, : len(t.ids)].tolist() == t.ids
        got = kk.row(i).map(lambda a: a[..., :-1, :])
        assert mx.array_equal(got.data, before[i].data).item()
        assert mx.array_equal(got.scales, before[i].scales).item()
    _check_pool(pool, [batch])


@pytest.mark.skipif(not NATIVE, reason="native kernels not built")
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("sinks", [False, True])
def test_native_and_mlx_paths_agree(L, sinks):
    """Both paths on rows of mixed lengths, long enough to be split in chunks."""
    pool = BlockPool(16, QuantSpec(4, 64, "hadamard"), QuantSpec(8))
    data = Data(4)
    batch = _batch(pool, rows=3)
    batch.prepare(lengths=[1100, 40, 600], right_padding=[0, 1060, 500])
    batch.update_and_fetch(*data.kv(3, 1100))
    batch.finalize()
    for window in (None, 300):
        batch.window = window
        k, v = data.kv(3, L)
        kk, vv = batch.update_and_fetch(k, v)
        q = data.q(3, L)
        s = mx.array(np.linspace(-1, 1, NQ).astype(np.float32)) if sinks else None
        outs = []
        was = attention._native
        for native in (True, False):
            attention._native = lambda n=native: n
            try:
                outs.append(attention.paged_attention(q, kk, vv, D**-0.5, None, s))
            finally:
                attention._native = was
        assert mx.abs(outs[0] - outs[1]).max().item() < 1e-3


def test_paged_caches_have_their_kinds():
    pool = BlockPool(4, QuantSpec(4), QuantSpec(4))
    assert type(_batch(pool)) is KVQPagedFullCache
    assert type(_batch(pool, window=8)) is KVQPagedWindowCache


# -- the pools as the memory accounting --------------------------------------------
def _pages_batch(pages, key, rows, window=None, account=None):
    pool = pages.pool(key, QuantSpec(4), QuantSpec(4), window)
    seqs = [KVQPagedSequence(pool, window) for _ in range(rows)]
    for s in seqs:
        s.table.hold_for(account)
    return pool, KVQPagedSequence.merge(seqs)


def test_the_allocator_knows_who_holds_each_block():
    """References belong to accounts: a request's tables, the prompt cache's
    entries (their blocks yield first), copies in passing; a copy of a
    request's table is still its own."""
    pages = Pages(4)
    data = Data(7)
    pool, batch = _pages_batch(pages, (0, None), rows=2, account=1)
    batch.update_and_fetch(*data.kv(2, 10))  # 3 blocks a row
    a = pool.allocator
    assert a.held == {1: 6} and a.live == a.used == 6 and a.cached == 0
    split = copy.deepcopy(batch)  # mlx-lm splits a prompt batch by copying it
    assert a.held == {1: 12} and a.live == 6
    del split
    entry = batch.extract(0)
    keep_in_prompt_cache([entry], list(range(10)))
    assert a.held == {1: 6} and a.live == 6 and a.cached == 0  # shared with its row: live
    batch.filter([1])
    assert a.held == {1: 3} and a.live == 3 and a.cached == 3  # only the entry holds row 0's
    fetched = copy.deepcopy(entry)  # what the prompt cache hands a new request
    assert fetched.table.account is None and a.live == 6
    fetched.table.hold_for(2)
    assert a.held == {1: 3, 2: 3}
    del fetched, entry
    assert a.used == 3 and a.cached == 0


def _cached_entry(pages: Pages, tokens: list[int]):
    """A full-attention pool and a 6-token window pool of `pages`, a one-row
    batch of each filled with `tokens`, and their rows' copies kept in the
    prompt cache: (full pool, window pool, the two batches, the entries)."""
    data = Data(8)
    full, fb = _pages_batch(pages, (0, None), rows=1, account=1)
    win, wb = _pages_batch(pages, (1, None), rows=1, window=6, account=1)
    fb.update_and_fetch(*data.kv(1, len(tokens)))
    wb.update_and_fetch(*data.kv(1, len(tokens)))
    entries = [fb.extract(0), wb.extract(0)]
    keep_in_prompt_cache(entries, tokens)
    return full, win, fb, wb, entries


def test_full_blocks_are_found_by_the_tokens_they_hold():
    """An entry's full blocks are registered under the chained hash of their
    tokens; a prompt with the same prefix finds them (not the partly filled
    last one, not after a different token), windows only what their next
    token sees; a block cut back or freed is forgotten."""
    pages = Pages(4)
    tokens = list(range(100, 114))  # 3 full blocks and 2 tokens
    full, win, fb, wb, entries = _cached_entry(pages, tokens)
    found = pages.match(tokens + [7, 8, 9])
    assert found[(0, None)] == entries[0].table.ids[:3]
    assert found[(1, None)] == [b for b in entries[1].table.ids if b in win.allocator.in_use()][:1]
    assert pages.match(tokens[:5] + [999] * 9)[(0, None)] == entries[0].table.ids[:1]
    assert pages.match(tokens[:12])[(0, None)] == entries[0].table.ids[:2]  # the last token left
    # a claim holds them for an admitted request until its tables do
    assert pages.claim(3, tokens + [7]) == {(0, None): 3, (1, None): 1}
    assert full.allocator.held[3] == 3
    pages.unclaim(3)
    assert 3 not in full.allocator.held
    entries[0].trim(3)  # 11 tokens: its third block is partly filled again, its own
    del fb
    assert pages.match(tokens + [7])[(0, None)] == entries[0].table.ids[:2]
    del entries
    assert pages.match(tokens + [7]) == {(0, None): [], (1, None): []}


def test_a_request_claims_the_blocks_of_its_entry_and_leaving_rows_free_theirs():
    """A request starting from a prompt-cache entry claims that
    entry's own blocks, cut where it starts (the window's partly filled last
    block too, which hashes cannot find: a cut on no block boundary). The
    rows of a preempted request leave the batch before the next step: the
    blocks only they refer to (besides the prompt cache) count as free at
    once, those another request maps do not."""
    pages = Pages(4)
    tokens = list(range(100, 114))  # 3 full blocks and 2 tokens
    full, win, fb, wb, entries = _cached_entry(pages, tokens)
    full_ids, window_ids = entries[0].table.ids, entries[1].table.ids
    assert len(window_ids) == 2 and pages.match(tokens + [7])[(1, None)] == window_ids[:1]
    kept = blocks_kept(entries, pages, 14)
    assert kept == {(0, None): full_ids, (1, None): window_ids}
    assert blocks_kept(entries, pages, 9)[(0, None)] == full_ids[:3]  # a copy cut back
    assert pages.claim_blocks(3, kept) == {(0, None): 4, (1, None): 2}
    pages.unclaim(3)
    assert pages.use()[(0, None)].live == 4  # the row's, the entry's too
    pages.leave(1)
    assert pages.use()[(0, None)].live == 0  # the row goes; the entry's yield
    fetched = copy.deepcopy(entries[0])
    fetched.table.hold_for(2)  # another request maps them
    assert pages.use()[(0, None)].live == 4
    del fetched
    pages.promise(1, {})  # admitted again: its rows are back
    assert pages.use()[(0, None)].live == 4


def test_a_claim_survives_a_compaction_before_it_is_released():
    """A request claims its entry's blocks when admitted and releases them
    once its tables hold them; the pools may compact in between (another
    admission reading a prefix from disk stores it, and the budget is
    measured): the claim is renumbered with every table, and its release
    drops the blocks it took, not those now under their numbers."""
    pages = Pages(4)
    data = Data(10)
    tokens = list(range(100, 114))
    pool, batch = _pages_batch(pages, (0, None), rows=2, account=1)
    batch.update_and_fetch(*data.kv(2, len(tokens)))  # 4 blocks a row, interleaved
    entry = batch.extract(1)
    keep_in_prompt_cache([entry], tokens)
    batch.filter([1])  # row 0's blocks are free, below the entry's
    kept = blocks_kept([entry], pages, len(tokens))
    pages.claim_blocks(3, kept)
    pool.compact(everything=True)
    assert entry.table.ids == batch.tables[0].ids != kept[(0, None)]  # renumbered
    assert pool.refs == [3] * 4 and pool.allocator.held[3] == 4
    pages.unclaim(3)
    assert pool.refs == [2] * 4 and 3 not in pool.allocator.held
    _check_pool(pool, [batch, entry])


def test_promises_and_the_storage_limit():
    """What a request was promised and does not hold yet is counted as
    promised; storage never grows past the limit the budget leaves, and a
    block made past it is counted."""
    pages = Pages(4)
    data = Data(9)
    pool, batch = _pages_batch(pages, (0, None), rows=1, account=5)
    pages.promise(5, {(0, None): 4})
    assert pages.use()[(0, None)].promised == 4
    batch.update_and_fetch(*data.kv(1, 6))  # 2 blocks
    use = pages.use()[(0, None)]
    assert (use.live, use.promised) == (2, 2)
    pages.limit = pages.nbytes + pool.block_bytes  # room for one more block
    batch.update_and_fetch(*data.kv(1, 8))  # 2 more: one fits, one is past the limit
    assert pool.capacity == 4 and pages.overdrafts == 1
    pages.close(5)
    assert pages.use()[(0, None)].promised == 0


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("sinks", [False, True])
def test_raw_rows_attended_in_groups_match_one_row_at_a_time(L, sinks):
    """Raw blocks: rows of mixed lengths gathered by groups give each row what
    attending its own gathered tokens gives (windowed too)."""
    pool = BlockPool(16, QuantSpec(None), QuantSpec(None))
    data = Data(5)
    batch = _batch(pool, rows=4)
    batch.prepare(lengths=[700, 40, 650, 90], right_padding=[0, 660, 50, 610])
    batch.update_and_fetch(*data.kv(4, 700))
    batch.finalize()
    assert attention._row_groups([44, 3, 41, 6]) == [[0, 2], [3], [1]]
    assert attention._row_groups([5, 5, 4, 5]) == [[0, 1, 3, 2]]
    for window in (None, 300):
        batch.window = window
        kk, vv = batch.update_and_fetch(*data.kv(4, L))
        assert not kk.quantized
        q = data.q(4, L)
        s = mx.array(np.linspace(-1, 1, NQ).astype(np.float32)) if sinks else None
        got = attention.paged_attention(q, kk, vv, D**-0.5, None, s)
        for b in range(4):
            base, end = kk.bases[b], kk.ends[b]
            m = attention.Causal((end - base - L,), window or 0).array(L, end - base)
            want = mx.fast.scaled_dot_product_attention(
                q[b : b + 1], kk.row(b), vv.row(b), scale=D**-0.5, mask=m, sinks=s
            )
            assert mx.abs(got[b : b + 1] - want).max().item() < 1e-4

"""The paged form of the split layout (full attention): blocks of whole key
groups, shared by prefix, and each row's exact tokens beside them.

A row holds positions `[0, length)` as

- blocks of the pool (`SplitBlockStorage`), `[0, table.length)`: whole
  blocks, each quantized once (keys per channel over whole groups, values
  per token) when the row moved `residual` tokens past its end, and never
  changed again, so a full block is shared as it is (prefix sharing, the
  prompt cache) and registered by the tokens it covers like any block;
- its exact tail, `[table.length, length)`, 16-bit: the newest `residual`
  tokens at least, fewer than `residual + block_size`. A sequence holds it
  as arrays of its own; a batch holds its rows' tails in one buffer
  `(rows, H, capacity, D)` (at most `residual + block_size` slots a row), so
  a decode step writes every row's new token in one operation;
- the sinks: the first `sinks` tokens, exact, held beside the row's first
  block in the pool (shared with it) once that block is written (before,
  they are in the tail).

Against the padded split cache (`caches/split.py`): both keep at least the
`residual` newest tokens exact, and without sinks, in blocks of one key
group, they hold the same tokens exact in the same groups (the same
logits). With sinks the body's groups here start at position 0 (blocks are
aligned to positions, as the prefix hashes are) instead of after the
sinks: the first group holds `group - sinks` real tokens (the sinks' slots
are quantized as copies of the first token after them and never read),
and which tokens are exact shifts by up to a group. A block size of
several groups keeps up to a block more tokens exact.

Attention receives `PagedSplitKV`: the pool, the tables, and each row's
exact sinks and tail, which the native CPU kernel reads in place (decode).
Other paths lay each row out (`SplitRows`): a head (the sinks, and the rest
of the first key group dequantized), the gathered blocks after it (a copy
of the row's packed blocks, not dequantized) and the tail, one run of
positions.
"""

from __future__ import annotations

from functools import cache
from typing import ClassVar

import mlx.core as mx
import numpy as np

from ...config import QuantSpec
from ...quant import PagedSplitKV, QuantizedKV, Reread, SplitKV, SplitRows, scale_dtype
from ...split import least_trim
from .base import KVQPagedSequence, PagedBatch
from .blocks import BlockTable
from .pool import BlockPool

Tail = tuple[mx.array | None, mx.array | None]  # a row's exact keys, values (1, H, n, D)
EMPTY: Tail = (None, None)


def exact_tokens_held(block_size: int, key_spec: QuantSpec, value_spec: QuantSpec) -> int:
    """The most tokens a row holds exact beside its blocks: its slots of a
    batch's tail buffer (`residual + block_size`: a tail of fewer, and the
    token being written), and its sinks."""
    residual = max(key_spec.residual, value_spec.residual)
    return residual + block_size + max(key_spec.sinks, value_spec.sinks)


TAIL_STEP = 32  # a batch's tail buffer grows by this many slots a row


def tail_capacity(need: int, residual: int, block_size: int) -> int:
    """Slots a row of a batch's tail buffer gets when its longest tail needs
    `need`: in steps of TAIL_STEP, never past a decode step's most
    (`residual + block_size`) unless `need` is (a prompt chunk before its flush)."""
    most = residual + block_size
    return need if need >= most else min(most, -(-need // TAIL_STEP) * TAIL_STEP)


def tail_slots(longest: int, residual: int, block_size: int) -> int:
    """The most slots a row holds in its batch's tail buffer between steps
    when the batch's longest row holds `longest` tokens: a tail holds no more
    tokens than its row, and fewer than `residual + block_size`, and the
    buffer is cut back to its longest tail when rows leave."""
    return tail_capacity(min(longest, residual + block_size), residual, block_size)


def _tail_len(tail: Tail) -> int:
    return 0 if tail[0] is None else tail[0].shape[2]


def _cat(a: mx.array | None, b: mx.array) -> mx.array:
    return b if a is None else mx.concatenate([a, b], axis=2)


def _cut(tail: Tail, start: int, stop: int | None = None) -> Tail:
    k, v = tail
    if k is None:
        return EMPTY
    stop = k.shape[2] if stop is None else stop
    if stop <= start:
        return EMPTY
    return mx.contiguous(k[..., start:stop, :]), mx.contiguous(v[..., start:stop, :])


def _tail_bytes(tail: Tail) -> int:
    return sum(a.nbytes for a in tail if a is not None)


def _sinks_bytes(pool: BlockPool, table: BlockTable) -> int:
    sink = pool.storage.sinks.get(table.ids[0]) if table.ids else None
    return 0 if sink is None else sink[0].nbytes + sink[1].nbytes


def flush(pool: BlockPool, rows: list[tuple[BlockTable, Tail, int | None]]) -> list[Tail]:
    """Move every whole block of each row's tail that lies `residual` tokens
    or more before its end (before `limit`, a right-padded prompt's end, when
    given) into new blocks of `pool`, all rows' blocks quantized together;
    returns the rows' tails after."""
    st = pool.storage
    bs, R, S = pool.block_size, st.residual, st.sink_count
    keys, values, owners, out = [], [], [], []
    for i, (t, tail, limit) in enumerate(rows):
        n = _tail_len(tail)
        end = t.length + n if limit is None else min(t.length + n, limit)
        m = max(0, end - R - t.length) // bs
        out.append(tail)
        if not m:
            continue
        k, v = tail
        H, D, Dv = k.shape[1], k.shape[3], v.shape[3]
        kb = k[0, :, : m * bs].reshape(H, m, bs, D).transpose(1, 0, 2, 3)
        vb = v[0, :, : m * bs].reshape(H, m, bs, Dv).transpose(1, 0, 2, 3)
        if t.length == 0 and S and st.key_spec.per_channel:
            # the sinks are read exact: their slots copy the next token, so
            # they stretch no channel's range in the first group
            first = mx.concatenate(
                [mx.repeat(kb[:1, :, S : S + 1], S, axis=2), kb[:1, :, S:]], axis=2
            )
            kb = first if m == 1 else mx.concatenate([first, kb[1:]], axis=0)
        keys.append(kb)
        values.append(vb)
        owners.append((i, m))
        out[i] = _cut(tail, m * bs)
    if not owners:
        return out
    k_store, v_store = st.encode(mx.concatenate(keys), mx.concatenate(values))
    one_k, one_v = k_store.map(lambda a: a[:1]), v_store.map(lambda a: a[:1])
    ids, sinks = [], {}
    for i, m in owners:
        t, tail, _ = rows[i]
        for _ in range(m):
            b = pool.allocate(one_k, one_v, t.account)
            if t.length == 0 and S:
                sinks[b] = (mx.contiguous(tail[0][..., :S, :]), mx.contiguous(tail[1][..., :S, :]))
            t.ids.append(b)
            t.length += bs
            ids.append(b)
    st.write_blocks(ids, k_store, v_store, sinks)
    return out


def trim(pool: BlockPool, table: BlockTable, tail: Tail, n: int) -> tuple[Tail, int]:
    """Forget a row's last `n` tokens: from its tail, then whole blocks, whose
    tokens it keeps come back to the tail dequantized (the sinks exact)."""
    have = _tail_len(tail)
    n = max(0, min(n, table.length + have))
    cut = min(n, have)
    tail = _cut(tail, 0, have - cut)
    left = n - cut
    if not left:
        return tail, n
    bs = pool.block_size
    nb = -(-left // bs)
    ids = table.ids[-nb:]
    st = pool.storage
    dtype = st.exact_dtype
    bk, bv = st.body(ids)
    k = bk.astype(dtype) if isinstance(bk, mx.array) else bk.dequantize(mx.float32).astype(dtype)
    v = bv.astype(dtype) if isinstance(bv, mx.array) else bv.dequantize(mx.float32).astype(dtype)
    sink = st.sinks.get(ids[0]) if nb == len(table.ids) else None
    if sink is not None:
        s = sink[0].shape[2]
        k = mx.concatenate([sink[0].astype(dtype), k[..., s:, :]], axis=2)
        v = mx.concatenate([sink[1].astype(dtype), v[..., s:, :]], axis=2)
    table.trim(nb * bs)
    keep = nb * bs - left
    return _cut((k, v), 0, keep), n


def exact_trim(table: BlockTable, tail: Tail, residual: int) -> int | None:
    """The most tokens a row trims back to what a decode to the shorter
    length holds: its exact tokens past the last `residual` (blocks come back
    dequantized); None before its first block."""
    return None if not table.length else max(0, _tail_len(tail) - residual)


def _first(sink: mx.array, body, cut: int) -> mx.array:
    """The head a row hands attention: its exact sinks, then the rest of its
    first `cut` tokens as stored (dequantized: a group's worth, per step)."""
    first = body[..., :cut, :] if isinstance(body, mx.array) else body.tokens(0, cut)
    if not isinstance(first, mx.array):
        first = first.dequantize(mx.float32)
    s = sink.shape[2]
    return mx.concatenate([sink.astype(first.dtype), first[..., s:, :]], axis=2)


def _after(body, cut: int):
    n = body.shape[2]
    if n == cut:
        return None
    return body[..., cut:, :] if isinstance(body, mx.array) else body.tokens(cut, n)


def row_kv(pool: BlockPool, table: BlockTable, tail: Tail) -> tuple[SplitKV, SplitKV, int]:
    """A row's keys and values as `SplitKV` (head, gathered blocks, tail) and
    the head's length. With sinks the head is the first key group (a token,
    for per-token keys, past the sinks): the exact sinks and the group's
    other tokens dequantized, so attention reads one run of positions and
    never the quantized slots under the sinks."""
    hk = hv = bk = bv = None
    if table.ids:
        st = pool.storage
        bk, bv = st.body(table.ids)
        sink = st.sinks.get(table.ids[0])
        if sink is not None:
            cut = st.key_spec.group_size if st.key_spec.per_channel else sink[0].shape[2]
            hk, hv = _first(sink[0], bk, cut), _first(sink[1], bv, cut)
            bk, bv = _after(bk, cut), _after(bv, cut)
    head = 0 if hk is None else hk.shape[2]
    return SplitKV(hk, bk, tail[0]), SplitKV(hv, bv, tail[1]), head


class KVQPagedSplitCache(PagedBatch):
    """A batch of split-layout full-attention rows over one pool (see the
    module docstring): blocks in the pool, the rows' exact tails in one
    buffer here (row `i`'s first `counts[i]` slots)."""

    kind = "full"
    shares_storage = True

    def __init__(self, pool: BlockPool, window: int | None = None):
        if window is not None:
            raise ValueError("the split layout has no paged form for sliding windows")
        super().__init__(pool, None)
        self.buffer: Tail = EMPTY  # (rows, H, capacity, D) exact keys, values
        self.counts: list[int] = []  # each row's tail length
        self.dtype: mx.Dtype | None = None

    @property
    def tails(self) -> list[Tail]:
        """Each row's exact tail `(1, H, n, D)` (slices of the buffer)."""
        bk, bv = self.buffer
        return [
            EMPTY if not n else (bk[i : i + 1, :, :n], bv[i : i + 1, :, :n])
            for i, n in enumerate(self.counts)
        ]

    def _hold(self, tails: list[Tail]) -> None:
        """Hold `tails` (one per row) in a new buffer."""
        self.counts = [_tail_len(x) for x in tails]
        filled = next((x for x in tails if x[0] is not None), None)
        self.buffer = EMPTY
        if filled is not None:
            cap = self._capacity(max(self.counts))

            def rows(side: int) -> mx.array:
                H, D, dtype = filled[side].shape[1], filled[side].shape[3], filled[side].dtype
                parts = [
                    mx.zeros((1, H, cap, D), dtype) if not n
                    else mx.pad(x[side], [(0, 0), (0, 0), (0, cap - n), (0, 0)])
                    for x, n in zip(tails, self.counts, strict=True)
                ]  # fmt: skip
                return mx.concatenate(parts) if len(parts) > 1 else parts[0]

            self.buffer = (rows(0), rows(1))
        self._sync()

    def _capacity(self, need: int) -> int:
        return tail_capacity(need, self.pool.storage.residual, self.pool.block_size)

    def _sync(self) -> None:
        self._table_array = None
        self.offset = mx.array(self._lengths(), dtype=mx.int32)

    def _after_copy(self) -> None:
        self.counts = list(self.counts)
        self._sync()

    def _lengths(self) -> list[int]:
        return [t.length + n for t, n in zip(self.tables, self.counts, strict=True)]

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks (and sinks) its rows reference, shared ones
        counted by each holder, and of the tail buffer."""
        held = sum(t.nbytes + _sinks_bytes(self.pool, t) for t in self.tables)
        return held + _tail_bytes(self.buffer)

    @property
    def own_nbytes(self) -> int:
        """Bytes beside the pool's blocks: the tail buffer, and the sinks of
        each row's first block (shared ones counted by each holder)."""
        return _tail_bytes(self.buffer) + sum(_sinks_bytes(self.pool, t) for t in self.tables)

    def empty(self) -> bool:
        return all(n == 0 for n in self._lengths())

    # -- the model's calls ----------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, _, N, _ = keys.shape
        if B != len(self.tables):
            raise ValueError(f"paged batch has {len(self.tables)} rows, got {B}")
        self.dtype = self.dtype or keys.dtype
        exact = scale_dtype(keys.dtype)
        keys, values = keys.astype(exact), values.astype(exact)
        if N == 1 and self._limits is None and self.buffer[0] is not None:
            self._append_one(keys, values)
        else:
            limits = self._limits or [None] * B
            rows = []
            for i, (t, (tk, tv)) in enumerate(zip(self.tables, self.tails, strict=True)):
                tail = (_cat(tk, keys[i : i + 1]), _cat(tv, values[i : i + 1]))
                rows.append((t, tail, limits[i]))
            starts = [t.length for t in self.tables]
            self._hold(flush(self.pool, rows))
            if N > 1:
                return self._paged_view(self._lengths(), self._rereads(rows, starts))
        return self._paged_view(self._lengths())

    def _rereads(self, rows: list, starts: list[int]) -> tuple:
        """Each row's `Reread` after a write of several tokens that moved
        some of them into blocks (None for the others; () for none)."""
        R, bs = self.pool.storage.residual, self.pool.block_size
        out = tuple(
            None if t.length == s else Reread(*tail, s, t.length, R, bs)
            for (t, tail, _), s in zip(rows, starts, strict=True)
        )
        return out if any(out) else ()

    def _append_one(self, keys: mx.array, values: mx.array) -> None:
        """A decode step: every row's token written into the buffer at once;
        the rows whose tail then reaches `residual + block_size` move their
        oldest block into the pool and their rest to the buffer's front."""
        bk, bv = self.buffer
        need = max(self.counts) + 1
        if need > bk.shape[2]:
            grow = [(0, 0), (0, 0), (0, self._capacity(need) - bk.shape[2]), (0, 0)]
            bk, bv = mx.pad(bk, grow), mx.pad(bv, grow)
        at = mx.array(self.counts, dtype=mx.int32)[:, None, None, None]
        bk = mx.put_along_axis(bk, mx.broadcast_to(at, keys.shape), keys, axis=2)
        bv = mx.put_along_axis(bv, mx.broadcast_to(at, values.shape), values, axis=2)
        self.counts = [n + 1 for n in self.counts]
        self.buffer = (bk, bv)
        st = self.pool.storage
        due = [i for i, n in enumerate(self.counts) if n - st.residual >= self.pool.block_size]
        if due:
            tails = self.tails
            rows = [(self.tables[i], tails[i], None) for i in due]
            for i, (rk, rv) in zip(due, flush(self.pool, rows), strict=True):
                n = _tail_len((rk, rv))
                if n:
                    bk[i : i + 1, :, :n] = rk
                    bv[i : i + 1, :, :n] = rv
                self.counts[i] = n
            self.buffer = (bk, bv)
        self._sync()

    def _paged_view(
        self, ends: list[int], rereads: tuple = ()
    ) -> tuple[PagedSplitKV, PagedSplitKV]:
        """The rows as they are held (`PagedSplitKV`): the pool, the tables,
        each row's exact sinks and tail; laid out per row only if asked (and
        always after a write whose queries read tokens it quantized exact)."""
        st = self.pool.storage
        bk, bv = self.buffer
        if st.keys is not None:
            pool_k, pool_v = st.keys, st.values
        elif bk is not None:  # no block yet: every row is its tail
            pool_k, pool_v = st.no_blocks(bk.shape[1], bk.shape[3], bv.shape[3], bk.dtype)
        else:
            return self._view(ends, rereads)
        blocks = tuple(len(t.ids) for t in self.tables)
        tables = np.zeros((len(blocks), max((1, *blocks))), dtype=np.int32)
        for i, t in enumerate(self.tables):
            tables[i, : len(t.ids)] = t.ids
        tables.flags.writeable = False
        sinks = [st.sinks.get(t.ids[0]) if t.ids else None for t in self.tables]
        per_row = cache(lambda: self._view(ends, rereads))
        ends = tuple(ends)

        def view(side: int, pool) -> PagedSplitKV:
            if pool.quantized:
                spec = pool.spec
                parts = QuantizedKV(*pool.parts, spec.bits, spec.group_size,
                                    spec.rotation == "hadamard", spec.per_channel)  # fmt: skip
            else:
                parts = pool.parts[0]
            return PagedSplitKV(
                parts, self.pool.block_size, tables, blocks, ends,
                tuple(None if s is None else s[side] for s in sinks),
                self.buffer[side], lambda: per_row()[side], bool(rereads),
            )  # fmt: skip

        return view(0, pool_k), view(1, pool_v)

    def _view(self, ends: list[int], rereads: tuple = ()) -> tuple[SplitRows, SplitRows]:
        ks, vs, heads = [], [], []
        for t, tail in zip(self.tables, self.tails, strict=True):
            k, v, head = row_kv(self.pool, t, tail)
            ks.append(k)
            vs.append(v)
            heads.append(head)
        heads = tuple(heads)  # one run of positions: the head, then the rest
        return (
            SplitRows(tuple(ks), heads, heads, tuple(ends), rereads=rereads),
            SplitRows(tuple(vs), heads, heads, tuple(ends), rereads=rereads),
        )

    def keys_and_values(self):
        return self._view(self._lengths())

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_):
        if window_size is not None:
            raise NotImplementedError("a windowed mask over a full-attention paged cache")
        return super().make_mask(N, return_array)

    @property
    def state(self):
        return super().state + [a for a in self.buffer if a is not None]

    # -- BatchGenerator's calls -----------------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """A right-padded chunk: its padding is written to the tails (never
        into blocks, which stop at each row's real end) and cut in `finalize`."""
        if left_padding is not None and max(left_padding) > 0:
            raise ValueError("paged caches take no left padding")
        if right_padding is not None and max(right_padding) > 0:
            self._limits = [n + int(m) for n, m in zip(self._lengths(), lengths, strict=True)]

    def finalize(self) -> None:
        if self._limits is not None:
            lengths, tails = self._lengths(), self.tails
            for i, limit in enumerate(self._limits):
                tails[i], _ = trim(self.pool, self.tables[i], tails[i], lengths[i] - limit)
            self._limits = None
            self._hold(tails)

    def size(self) -> int:
        return max(self._lengths(), default=0)

    def is_trimmable(self) -> bool:
        return True

    def exact_trim(self) -> int | None:
        R = self.pool.storage.residual
        return least_trim(
            exact_trim(t, tail, R) for t, tail in zip(self.tables, self.tails, strict=True)
        )

    def trim(self, n: int) -> int:
        if n > 0 and self._limits is None and min(self.counts, default=0) >= n:
            # within every row's tail (a rejected draft): the slots are left for
            # the next writes
            self.counts = [c - n for c in self.counts]
            self._sync()
            return n
        done, tails = [], self.tails
        for i, t in enumerate(self.tables):
            tails[i], d = trim(self.pool, t, tails[i], n)
            done.append(d)
        self._hold(tails)
        return min(done, default=0)

    def _keep_rows(self, keep: list[int]) -> None:
        """Only the rows `keep` stay; the buffer is cut back to their longest
        tail (what the budget prices the rows left at, `tail_slots`)."""
        self.counts = [self.counts[i] for i in keep]
        if not keep:
            self.buffer = EMPTY
        elif self.buffer[0] is not None:
            rows = mx.array(keep, dtype=mx.int32)
            cap = min(self.buffer[0].shape[2], self._capacity(max(max(self.counts), 1)))
            self.buffer = tuple(mx.contiguous(a[rows][:, :, :cap]) for a in self.buffer)

    def _take_rows(self, other: KVQPagedSplitCache) -> None:
        self._hold(self.tails + other.tails)
        other.buffer, other.counts = EMPTY, []

    def extract(self, idx: int) -> KVQPagedSplitSequence:
        tail = _cut(self.tails[idx], 0)  # its own arrays, not a view of the buffer
        return KVQPagedSplitSequence(self.pool, None, self.tables[idx].copy(), tail)

    @classmethod
    def merge(cls, caches: list[KVQPagedSplitSequence]) -> KVQPagedSplitCache:
        return KVQPagedSplitSequence.merge(caches)

    def describe(self) -> str:
        st = self.pool.storage
        text = super().describe()
        if st.sink_count:
            text += f", {st.sink_count} sinks"
        if st.residual:
            text += f", last {st.residual} exact"
        return text


class KVQPagedSplitSequence(KVQPagedSequence):
    """One split-layout sequence: its table (whole blocks) and its exact tail."""

    kind = "full"
    batch_form: ClassVar[type] = KVQPagedSplitCache

    def __init__(
        self,
        pool: BlockPool,
        window: int | None = None,
        table: BlockTable | None = None,
        tail: Tail = EMPTY,
    ):
        if window is not None:
            raise ValueError("the split layout has no paged form for sliding windows")
        super().__init__(pool, None, table)
        self.tail = tail

    def _after_copy(self) -> None:
        pass  # the tail's arrays are immutable: the copy shares them

    @property
    def offset(self) -> int:
        return self.table.length + _tail_len(self.tail)

    def size(self) -> int:
        return self.offset

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + _sinks_bytes(self.pool, self.table) + _tail_bytes(self.tail)

    @property
    def own_nbytes(self) -> int:
        return _tail_bytes(self.tail) + _sinks_bytes(self.pool, self.table)

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        self.tail, n = trim(self.pool, self.table, self.tail, n)
        return n

    def exact_trim(self) -> int | None:
        return exact_trim(self.table, self.tail, self.pool.storage.residual)

    def write(self, keys: mx.array, values: mx.array) -> None:
        """Append exact tokens `keys`/`values` (1, H, n, D) after the held ones
        (what a cache of another layout held: its quantized tokens come here
        dequantized and are quantized again in this form's groups)."""
        exact = scale_dtype(keys.dtype)
        tail = (_cat(self.tail[0], keys.astype(exact)), _cat(self.tail[1], values.astype(exact)))
        (self.tail,) = flush(self.pool, [(self.table, tail, None)])

    def hold(self, keys, values, end: int) -> None:
        raise NotImplementedError("a split-layout sequence is written with `write`")

    def held(self) -> tuple[mx.array, mx.array]:
        """Every token it holds, `(1, H, n, D)` arrays (the blocks dequantized,
        the sinks and tail exact): for caches of another layout."""
        k, v, _ = row_kv(self.pool, self.table, self.tail)
        dtype = self.tail[0].dtype if self.pool.storage.keys is None else None
        dtype = dtype or self.pool.storage.exact_dtype
        return k.dequantize(dtype), v.dequantize(dtype)

    @classmethod
    def merge(cls, caches: list[KVQPagedSplitSequence]) -> KVQPagedSplitCache:
        c0 = caches[0]
        batch = KVQPagedSplitCache(c0.pool)
        tails: list[Tail] = []
        for c in caches:
            if c.pool is not c0.pool:
                raise ValueError("paged caches merge only within one pool")
            batch.tables.append(c.table)
            tails.append(c.tail)
            c.tables = [BlockTable(c.pool)]
            c.tail = EMPTY
        batch._hold(tails)
        return batch


KVQPagedSplitCache.sequence_form = KVQPagedSplitSequence

__all__ = [
    "KVQPagedSplitCache",
    "KVQPagedSplitSequence",
    "exact_tokens_held",
    "tail_slots",
    "tail_capacity",
]

"""What the paged cache forms share: a pool and row tables, the one-sequence
form, and the batch form that mlx-lm's `BatchGenerator` drives.

A batch (`PagedBatch`) holds nothing padded: each row holds its own tokens,
its `offset` is its own length, and attention receives `PagedKV` views (the
pool and the tables) whose masks come from positions. A block is written
only by a table that holds its only reference: writing into a shared block
(the partly filled last block of a shared prefix) first copies it (copy on
write). The one-sequence forms (`KVQPagedSequence`, what `extract` returns
and the prompt cache keeps) only hold tables: the batch computes. The full
and sliding kinds (`full.py`, `window.py`) differ in what a row keeps.
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx
import numpy as np

from ...config import QuantSpec
from ...mlx_lm_internals import BaseCache
from ...quant import PagedKV, Store
from .blocks import BlockTable
from .pool import BlockPool


def _depending(value, current: Store | None) -> Store | None:
    """A pool store given back as `mx.depends` returns it (its arrays)."""
    if value is None or isinstance(value, Store):
        return value
    if current is not None and isinstance(value, (list, tuple)):
        if len(value) == len(current.parts):
            return Store(value, current.spec)
    raise TypeError(f"a paged cache's keys/values take the pool's arrays back, got {type(value)}")


class PagedCache(BaseCache):
    """What the one-sequence and batch forms share: a pool and row tables."""

    kind = "full"
    bounded = False
    shares_storage = True  # its bytes are the pool's: counted there, once
    window: int | None = None
    pool: BlockPool
    tables: list[BlockTable]

    def __deepcopy__(self, memo):
        """A copy that shares the pool and references the same blocks."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        new.tables = [t.copy() for t in self.tables]
        new._after_copy()
        return new

    def _after_copy(self) -> None:
        pass

    def exact_trim(self) -> int | None:
        """The most tokens `trim` takes back leaving exactly what a decode to
        the shorter length would hold (None: whatever it can trim)."""
        return None

    @property
    def key_spec(self) -> QuantSpec:
        return self.pool.key_spec

    @property
    def value_spec(self) -> QuantSpec:
        return self.pool.value_spec

    @property
    def quantized(self) -> bool:
        return self.key_spec.quantized or self.value_spec.quantized

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this cache references (shared blocks are
        counted by each holder; the pool counts each block once)."""
        return sum(t.nbytes for t in self.tables)

    @property
    def own_nbytes(self) -> int:
        """Bytes it holds outside the pool (none: the split form's exact tails)."""
        return 0

    def empty(self) -> bool:
        return all(t.length == 0 for t in self.tables)

    # Model code that orders work by dependencies (mlx-lm's pipeline stages,
    # sparse-attention indexers) reads `cache.keys` and writes back
    # `mx.depends(cache.keys, x)`: the pool's arrays, with the dependency.
    @property
    def keys(self) -> Store | None:
        return self.pool.keys

    @keys.setter
    def keys(self, value) -> None:
        self.pool.keys = _depending(value, self.pool.keys)

    @property
    def values(self) -> Store | None:
        return self.pool.values

    @values.setter
    def values(self, value) -> None:
        self.pool.values = _depending(value, self.pool.values)

    def blocks(self) -> set[int]:
        return {b for t in self.tables for b in t.ids}

    def describe(self) -> str:
        return (
            f"{self.kind} paged ({self.pool.block_size}-token blocks) "
            f"K {self.key_spec.describe()} V {self.value_spec.describe()}"
        )

    @property
    def state(self):
        """The pool's arrays (what `mx.eval` must evaluate after a step); paged
        caches are not written to prompt-cache files."""
        if self.pool.keys is None:
            return []
        return [*self.pool.keys.parts, *self.pool.values.parts]

    @state.setter
    def state(self, v) -> None:
        raise AttributeError("paged caches share a block pool: they have no state of their own")


class KVQPagedSequence(PagedCache):
    """One sequence's table in a pool: what the batch's `extract` returns, what
    the prompt cache keeps, and what a sequence enters the batch with.
    `KVQPagedSequence(pool, window)` makes the form of its kind
    (`KVQPagedFullSequence`, or `KVQPagedWindowSequence` with a window)."""

    _FORMS: ClassVar[dict[bool, type]] = {}  # windowed -> the form of that kind
    batch_form: ClassVar[type]  # the batch form its rows go into

    def __init_subclass__(cls, windowed: bool | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if windowed is not None:
            KVQPagedSequence._FORMS[windowed] = cls

    def __new__(cls, *args, **kwargs):
        if cls is KVQPagedSequence:
            window = kwargs.get("window", args[1] if len(args) > 1 else None)
            cls = KVQPagedSequence._FORMS[window is not None]
        return super().__new__(cls)

    def __init__(self, pool: BlockPool, window: int | None = None, table: BlockTable | None = None):
        self.pool = pool
        self.window = window
        self.tables = [table or BlockTable(pool)]

    def hold(self, keys: Store, values: Store, end: int) -> None:
        """Hold tokens `[end - n, end)`, `keys`/`values` (1, H, n, D), written into
        new blocks of the pool (what a cache of another layout held); the
        table is empty before."""
        n = keys.length
        start = end - n
        pool = self.pool
        t = self.table
        t.base, t.length = start - start % pool.block_size, start
        k = keys.quantize(pool.key_spec)
        v = values.quantize(pool.value_spec)
        if n:
            blocks, slots = t.reserve(n, k, v)

            def tokens(a: mx.array) -> mx.array:
                return a[0].transpose(1, 0, 2)

            pool.write(blocks, slots, k.map(tokens), v.map(tokens))

    def held(self) -> tuple[Store, Store]:
        """The tokens this sequence holds, `(1, H, n, D)` stores in pool order
        (a gathered copy: for caches of another layout)."""
        t = self.table
        return self.pool.storage.gather(t.ids, t.base, t.length)

    @property
    def table(self) -> BlockTable:
        return self.tables[0]

    @property
    def offset(self) -> int:
        return self.table.length

    def size(self) -> int:
        return self.table.length - self.table.base

    def is_trimmable(self) -> bool:
        return self.table.base == 0

    def trim(self, n: int) -> int:
        return self.table.trim(n)

    @classmethod
    def merge(cls, caches: list[KVQPagedSequence]):
        """The batch of these sequences; their tables move into it."""
        c0 = caches[0]
        batch = c0.batch_form(c0.pool, c0.window)
        for c in caches:
            if c.pool is not c0.pool:
                raise ValueError("paged caches merge only within one pool")
            batch.tables.append(c.table)
            c.tables = [BlockTable(c.pool)]
        batch._sync()
        return batch


class _TableArray:
    """A batch's block tables as one int32 array `(rows, width)`: what attention
    reads, built once and kept in step with the `BlockTable`s (which stay the
    truth: references, copy on write, renumbering). A row is copied in again
    only when its blocks change (a new block, a copy on write, a window's
    blocks going back); a step that only appends tokens changes nothing here.
    Views share the array until the next change, which copies it first."""

    __slots__ = ("ids", "lent", "renumbered")

    def __init__(self, tables: list[BlockTable], renumbered: int, width: int = 0):
        width = max(width, max((len(t.ids) for t in tables), default=0))
        self.renumbered = renumbered
        self.ids = np.zeros((len(tables), width + 8), dtype=np.int32)
        self.lent = False
        for i, t in enumerate(tables):
            self.ids[i, : len(t.ids)] = t.ids

    def set_row(self, i: int, t: BlockTable) -> None:
        n = len(t.ids)
        if self.lent or n > self.ids.shape[1]:
            width = max(self.ids.shape[1], n + n // 4 + 8)
            ids = np.zeros((self.ids.shape[0], width), dtype=np.int32)
            ids[:, : self.ids.shape[1]] = self.ids
            self.ids, self.lent = ids, False
        self.ids[i, :n] = t.ids
        self.ids[i, n:] = 0

    def lend(self) -> np.ndarray:
        """The array, read-only, for views made now."""
        self.lent = True
        out = self.ids.view()
        out.flags.writeable = False
        return out


class PagedBatch(PagedCache):
    """A batch of rows over one pool: writes, views and mlx-lm's batch calls.
    The kinds decide what a row keeps: `_keep` runs before and after each
    write, `_kept` cuts an extracted row's table."""

    sequence_form: ClassVar[type]  # what `extract` returns

    def __init__(self, pool: BlockPool, window: int | None = None):
        self.pool = pool
        self.window = window
        self.tables: list[BlockTable] = []
        # between prepare and finalize (a prompt chunk right-padded to its longest
        # row): each row's real end, and the padding positions passed so far,
        # which are never written (a row holds its own tokens only)
        self._limits: list[int] | None = None
        self._padded: list[int] | None = None
        self._table_array: _TableArray | None = None
        self.offset = mx.array([], dtype=mx.int32)

    def _sync(self) -> None:
        """After the tables changed shape (rows in or out, trimmed): the table
        array is rebuilt when next needed."""
        self._table_array = None
        self.offset = mx.array([t.length for t in self.tables], dtype=mx.int32)

    def _tables(self, width: int = 0) -> _TableArray:
        """The table array, at least `width` blocks wide (a padded row's view
        reaches past its blocks: those entries are read for padding queries only)."""
        ta = self._table_array
        if ta is None or ta.renumbered != self.pool.renumbered or ta.ids.shape[1] < width:
            ta = self._table_array = _TableArray(self.tables, self.pool.renumbered, width)
        return ta

    def _row_changed(self, i: int) -> None:
        """Row `i`'s blocks changed outside `_reserve` (the kind dropped some)."""
        if self._table_array is not None:
            self._table_array.set_row(i, self.tables[i])

    def _after_copy(self) -> None:
        self._sync()

    # -- what a kind keeps ----------------------------------------------------
    def _keep(self) -> None:
        """Before a write, and after it once its view is made: give back what
        no query needs any more (nothing, for full attention)."""

    def _written(self, view: tuple[PagedKV, PagedKV]) -> None:
        """The view a write returned (a kind that drops blocks keeps it)."""

    def _kept(self, table: BlockTable) -> BlockTable:
        """What a row extracted as one sequence keeps of `table` (a copy)."""
        return table

    # -- the model's calls ----------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, _, N, _ = keys.shape
        if B != len(self.tables):
            raise ValueError(f"paged batch has {len(self.tables)} rows, got {B}")
        self._keep()
        k, v = self.pool.encode(keys, values)

        def tokens(a: mx.array) -> mx.array:
            return a.transpose(0, 2, 1, 3).reshape(B * N, a.shape[1], a.shape[-1])

        if self._limits is None:
            blocks, slots = self._reserve(N, k, v)
            self.pool.write(blocks, slots, k.map(tokens), v.map(tokens))
            ends = [t.length for t in self.tables]
        else:
            ends = self._write_padded(N, k.map(tokens), v.map(tokens))
        self.offset = mx.array(ends, dtype=mx.int32)
        out = self._view(ends)
        # The view above holds its own copy of the tables and the pool's arrays
        # as written now: blocks no later query needs can go back at once.
        self._keep()
        self._written(out)
        return out

    def _reserve(self, N: int, k: Store, v: Store) -> tuple[list[int], list[int]]:
        """Blocks and slots for every row's next `N` tokens, row after row. A
        decode step (one token) only reads each row's last block and moves its
        length, unless the row needs a new block or writes into a shared one
        (then its table's `reserve` allocates or copies on write); the table
        array changes only for those rows."""
        if N != 1:
            blocks, slots = [], []
            for t in self.tables:
                b, s = t.reserve(N, k, v)
                blocks += b
                slots += s
            self._table_array = None
            return blocks, slots
        ta = self._tables()
        refs = self.pool.refs
        bs = self.pool.block_size
        blocks, slots = [], []
        for i, t in enumerate(self.tables):
            j, slot = divmod(t.length - t.base, bs)
            if j < len(t.ids) and refs[t.ids[j]] == 1:
                t.length += 1
            else:
                t.reserve(1, k, v)
                ta.set_row(i, t)
            blocks.append(t.ids[j])
            slots.append(slot)
        return blocks, slots

    def _write_padded(self, N: int, k: Store, v: Store) -> list[int]:
        """Write a right-padded chunk (`k`/`v`: its B * N tokens, row after row):
        each row's real tokens only; returns where each row's positions end,
        padding included (its queries' positions)."""
        blocks, slots, taken, ends = [], [], [], []
        for i, t in enumerate(self.tables):
            at = t.length + self._padded[i]
            real = max(0, min(N, self._limits[i] - at))
            if real:
                b, s = t.reserve(real, k, v)
                blocks += b
                slots += s
                taken += range(i * N, i * N + real)
            self._padded[i] += N - real
            ends.append(at + N)
        if taken:
            rows = mx.array(taken, dtype=mx.int32)
            self.pool.write(blocks, slots, k.map(lambda a: a[rows]), v.map(lambda a: a[rows]))
        self._table_array = None
        return ends

    def _view(self, ends: list[int]) -> tuple[PagedKV, PagedKV]:
        bases = [t.base for t in self.tables]
        bs = self.pool.block_size
        width = max((-(-(e - b) // bs) for b, e in zip(bases, ends, strict=True)), default=0)
        return self.pool.view(self._tables(width).lend(), bases, ends, self.window)

    def keys_and_values(self):
        """The rows as attention receives them."""
        return self._view([t.length for t in self.tables])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_):
        """ "causal" (or None for one token): attention derives each row's mask
        from positions (`PagedKV`), so no mask is laid out here."""
        if return_array:
            raise NotImplementedError(
                "paged caches derive masks from positions; this model asks for mask arrays: "
                "serve it with the padded layout"
            )
        return "causal" if N > 1 else None

    # -- BatchGenerator's calls -----------------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        if left_padding is not None and max(left_padding) > 0:
            raise ValueError("paged caches take no left padding")
        if right_padding is not None and max(right_padding) > 0:
            self._limits = [t.length + n for t, n in zip(self.tables, lengths, strict=True)]
            self._padded = [0] * len(self.tables)

    def finalize(self) -> None:
        if self._limits is not None:  # the padding was never written: nothing to cut
            self._padded = self._limits = None
            self._sync()

    def size(self) -> int:
        return max((t.length - t.base for t in self.tables), default=0)

    def is_trimmable(self) -> bool:
        return all(t.base == 0 for t in self.tables)

    def trim(self, n: int) -> int:
        done = min(t.trim(n) for t in self.tables) if self.tables else 0
        self._sync()
        return done

    def filter(self, batch_indices) -> None:
        if isinstance(batch_indices, mx.array):
            batch_indices = batch_indices.tolist()
        keep = [int(i) for i in np.asarray(batch_indices).reshape(-1)]
        kept = set(keep)
        for i, t in enumerate(self.tables):
            if i not in kept:
                t.release()
        self.tables = [self.tables[i] for i in keep]
        self._keep_rows(keep)
        self._sync()

    def extend(self, other: PagedBatch) -> None:
        if other.pool is not self.pool:
            raise ValueError("paged caches extend only within one pool")
        self.tables += other.tables
        other.tables = []
        self._take_rows(other)
        other._sync()

    def _keep_rows(self, keep: list[int]) -> None:
        """What a subclass holds per row beside its table, filtered like the tables."""

    def _take_rows(self, other: PagedBatch) -> None:
        """What a subclass holds per row beside its table, moved from `other` like the tables."""
        self._sync()

    def extract(self, idx: int) -> KVQPagedSequence:
        """Row `idx` as one sequence sharing its blocks (what the kind keeps)."""
        return self.sequence_form(self.pool, self.window, self._kept(self.tables[idx].copy()))

    @classmethod
    def merge(cls, caches: list[KVQPagedSequence]):
        return KVQPagedSequence.merge(caches)


__all__ = ["KVQPagedSequence", "PagedBatch", "PagedCache"]

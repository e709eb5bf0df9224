"""Paged K/V: per-layer pools of fixed-size blocks, and the caches that map them.

A `BlockPool` holds one layer's keys and values, packed (or raw, as the
layer's specs say), in blocks of `block_size` tokens with a reference count
each. A sequence's `BlockTable` lists the blocks holding its tokens. Tables
are copied by reference (`BlockTable.copy` adds a reference to every
block), so a prompt-cache entry and every sequence that starts with its
tokens hold those blocks once. A block is written only by a table that holds
its only reference: writing into a shared block (the partly filled last
block of a shared prefix) first copies it (copy on write). A block returns
to the pool when its last reference goes.

`KVQPagedFullCache` and `KVQPagedWindowCache` are the batch forms that
mlx-lm's `BatchGenerator` drives (`merge`, `extend`, `filter`, `extract`,
`prepare`/`finalize`), with nothing padded: each row holds its own tokens,
its `offset` is its own length, and attention receives `PagedKV` views
(the pool and the tables) whose masks come from positions. A window row
keeps the blocks its next query can see (`window - 1` tokens before it)
and returns older blocks to the pool as soon as the chunk it wrote has its
view. Their one-sequence
forms (`KVQPagedSequence`, what `extract` returns and the prompt cache
keeps) only hold tables: the batch computes.
"""

from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..config import QuantSpec
from ..mlx_lm_internals import BaseCache
from ..quant import PagedKV, Store

DEFAULT_BLOCK_SIZE = 32


@dataclass(frozen=True)
class PoolStats:
    """Blocks of one pool: allocated, used by some table, shared by several."""

    capacity: int
    used: int
    shared: int
    block_bytes: int

    @property
    def free(self) -> int:
        return self.capacity - self.used


class BlockPool:
    """One layer's K/V blocks with reference counts; see the module docstring.

    Storage is `(blocks, block_size, heads, dim)` per part, made at the first
    allocation (heads, dims and dtypes come from the first tokens written)
    and grown by a sixteenth (at least `min_growth` blocks) when no block is
    free; `compact` gives back what is free between steps.
    """

    def __init__(
        self,
        block_size: int,
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        *,
        min_growth: int = 1,
    ):
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.key_spec = key_spec
        self.value_spec = value_spec
        self.min_growth = max(1, min_growth)
        self.keys: Store | None = None
        self.values: Store | None = None
        self.refs: list[int] = []
        self._free: list[int] = []
        # bumped whenever a freed block may hold other tokens or move (allocation,
        # compaction, storage released): a remembered table of freed blocks is stale
        self.generation = 0
        self._tables: weakref.WeakSet[BlockTable] = weakref.WeakSet()  # to renumber
        self.renumbered = 0  # counts renumberings: arrays of block ids made before are stale

    # -- storage --------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return len(self.refs)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def block_bytes(self) -> int:
        if self.keys is None or not self.capacity:
            return 0
        return (self.keys.nbytes + self.values.nbytes) // self.capacity

    @property
    def nbytes(self) -> int:
        """Bytes the pool's storage holds (used and free blocks)."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def stats(self) -> PoolStats:
        shared = sum(1 for r in self.refs if r > 1)
        return PoolStats(self.capacity, self.used, shared, self.block_bytes)

    def encode(self, keys: mx.array, values: mx.array) -> tuple[Store, Store]:
        """`keys`/`values` (B, H, N, D) stored as this pool stores them."""
        return Store.encode(keys, self.key_spec), Store.encode(values, self.value_spec)

    def _grow(self, k: Store, v: Store) -> None:
        cap = self.capacity
        add = max(self.min_growth, cap // 16)

        def zeros(a: mx.array) -> mx.array:
            return mx.zeros((add, self.block_size, a.shape[1], a.shape[-1]), a.dtype)

        new_k, new_v = k.map(zeros), v.map(zeros)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = Store.concat([self.keys, new_k], axis=0)
            self.values = Store.concat([self.values, new_v], axis=0)
        self.refs.extend([0] * add)
        for b in range(cap, cap + add):
            heapq.heappush(self._free, b)

    # -- blocks ---------------------------------------------------------------
    def allocate(self, k: Store, v: Store) -> int:
        """A free block with one reference (`k`/`v`: stores shaped like what is written)."""
        if not self._free:
            self._grow(k, v)
        block = heapq.heappop(self._free)  # the lowest: used blocks gather at the front
        self.refs[block] = 1
        self.generation += 1
        return block

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def decref(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                heapq.heappush(self._free, b)
            elif self.refs[b] < 0:
                raise RuntimeError(f"block {b} released more often than referenced")
        if blocks and len(self._free) == len(self.refs):
            # nothing refers to any block: the storage goes
            self.keys = self.values = None
            self.refs, self._free = [], []
            self.renumbered += 1
            self.generation += 1

    def compact(self) -> None:
        """Give back free blocks once they are more than a growth step (a
        prefill's transient, sequences that left): the used blocks move to the
        front (a copy of the storage) and every table is renumbered. Call it
        between steps, never while a table's block ids are being used."""
        if self.keys is None:
            return
        used = [b for b, r in enumerate(self.refs) if r]
        if len(self.refs) - len(used) <= max(self.min_growth, len(used) // 16):
            return
        self.generation += 1
        if used == list(range(len(used))):  # the free blocks are the tail
            self.keys = self.keys.map(lambda a: mx.array(a[: len(used)]))
            self.values = self.values.map(lambda a: mx.array(a[: len(used)]))
        else:
            ids = mx.array(used, dtype=mx.int32)
            self.keys = self.keys.map(lambda a: a[ids])
            self.values = self.values.map(lambda a: a[ids])
            new = {b: i for i, b in enumerate(used)}
            for t in list(self._tables):
                t.ids = [new[b] for b in t.ids]
            self.renumbered += 1
        self.refs = [self.refs[b] for b in used]
        self._free = []

    def copy_block(self, block: int, k: Store, v: Store) -> int:
        """A private copy of `block` (copy on write); the caller drops its reference."""
        new = self.allocate(k, v)
        self.keys[new : new + 1] = self.keys[block : block + 1]
        self.values[new : new + 1] = self.values[block : block + 1]
        return new

    def write(self, blocks: list[int], slots: list[int], k: Store, v: Store) -> None:
        """Write token `i` of `k`/`v` (tokens, H, D') at `slots[i]` of `blocks[i]`."""
        ids = mx.array(blocks, dtype=mx.int32)
        pos = mx.array(slots, dtype=mx.int32)
        self.keys[ids, pos] = k
        self.values[ids, pos] = v

    def view(self, tables, bases, ends, window: int | None) -> tuple[PagedKV, PagedKV]:
        """What attention receives for rows with these tables (see `PagedKV`)."""
        return (
            PagedKV(self.keys.fetch(), tables, bases, ends, self.block_size, window),
            PagedKV(self.values.fetch(), tables, bases, ends, self.block_size, window),
        )


class BlockTable:
    """One sequence's blocks in one pool: tokens `[base, length)`, `base` a
    multiple of the block size. Returns its blocks to the pool when released
    or dropped."""

    __slots__ = ("__weakref__", "base", "ids", "length", "pool")

    def __init__(
        self, pool: BlockPool, ids: list[int] | None = None, base: int = 0, length: int = 0
    ):
        self.pool = pool
        self.ids = ids or []
        self.base = base
        self.length = length
        pool._tables.add(self)

    def copy(self) -> BlockTable:
        """A table sharing these blocks (one more reference to each)."""
        self.pool.incref(self.ids)
        return BlockTable(self.pool, list(self.ids), self.base, self.length)

    def release(self) -> None:
        ids, self.ids = self.ids, []
        self.pool.decref(ids)

    def __del__(self) -> None:
        if self.ids:
            self.release()

    def drop_before(self, position: int) -> int:
        """Return the blocks holding only tokens before `position`; how many."""
        bs = self.pool.block_size
        n = max(0, position // bs - self.base // bs)
        n = min(n, len(self.ids))
        if n:
            dropped, self.ids = self.ids[:n], self.ids[n:]
            self.base += n * bs
            self.pool.decref(dropped)
        return n

    def trim(self, n: int) -> int:
        """Forget the last `n` tokens (never before `base`); returns how many."""
        n = max(0, min(n, self.length - self.base))
        self.length -= n
        bs = self.pool.block_size
        keep = -(-(self.length - self.base) // bs)
        if keep < len(self.ids):
            dropped, self.ids = self.ids[keep:], self.ids[:keep]
            self.pool.decref(dropped)
        return n

    def reserve(self, n: int, k: Store, v: Store) -> tuple[list[int], list[int]]:
        """Blocks and slots for the next `n` tokens: new blocks as needed, and a
        private copy of a shared block before writing into it."""
        bs = self.pool.block_size
        start = self.length
        first = (start - self.base) // bs
        if first < len(self.ids) and self.pool.refs[self.ids[first]] > 1:
            old = self.ids[first]
            self.ids[first] = self.pool.copy_block(old, k, v)
            self.pool.decref([old])
        need = -(-(start + n - self.base) // bs)
        while len(self.ids) < need:
            self.ids.append(self.pool.allocate(k, v))
        rel = range(start - self.base, start + n - self.base)
        blocks = [self.ids[i // bs] for i in rel]
        slots = [i % bs for i in rel]
        self.length = start + n
        return blocks, slots

    @property
    def nbytes(self) -> int:
        return len(self.ids) * self.pool.block_bytes


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
    """One sequence's tables in a pool: what the batch's `extract` returns, what
    the prompt cache keeps, and what a sequence enters the batch with.
    `KVQPagedSequence(pool, window)` makes the form of its kind
    (`KVQPagedFullSequence`, or `KVQPagedWindowSequence` with a window)."""

    def __new__(cls, *args, **kwargs):
        if cls is KVQPagedSequence:
            window = kwargs.get("window", args[1] if len(args) > 1 else None)
            cls = KVQPagedFullSequence if window is None else KVQPagedWindowSequence
        return super().__new__(cls)

    def __init__(self, pool: BlockPool, window: int | None = None, table: BlockTable | None = None):
        self.pool = pool
        self.window = window
        self.tables = [table or BlockTable(pool)]

    @classmethod
    def holding(cls, pool: BlockPool, window: int | None, keys: Store, values: Store, end: int):
        """A sequence whose tokens `[end - n, end)` are `keys`/`values` (1, H, n, D),
        written into new blocks of `pool` (a cache of another layout, paged)."""
        n = keys.length
        start = end - n
        table = BlockTable(pool, [], start - start % pool.block_size, start)
        k = keys.quantize(pool.key_spec)
        v = values.quantize(pool.value_spec)
        if n:
            blocks, slots = table.reserve(n, k, v)

            def tokens(a: mx.array) -> mx.array:
                return a[0].transpose(1, 0, 2)

            pool.write(blocks, slots, k.map(tokens), v.map(tokens))
        return cls(pool, window, table)

    def held(self) -> tuple[Store, Store]:
        """The tokens this sequence holds, `(1, H, n, D)` stores in pool order
        (a gathered copy: for caches of another layout)."""
        t = self.table
        parts = []
        for store in (self.pool.keys, self.pool.values):
            view = PagedKV(store.fetch(), (t.ids,), (t.base,), (t.length,), self.pool.block_size)
            row = view.row(0)
            parts.append(
                Store((row.data, row.scales, row.biases) if view.quantized else (row,), store.spec)
            )
        return parts[0], parts[1]

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
        if c0.window is None:
            batch = KVQPagedFullCache(c0.pool)
        else:
            batch = KVQPagedWindowCache(c0.pool, c0.window)
        for c in caches:
            if c.pool is not c0.pool:
                raise ValueError("paged caches merge only within one pool")
            batch.tables.append(c.table)
            c.tables = [BlockTable(c.pool)]
        batch._sync()
        return batch


class KVQPagedFullSequence(KVQPagedSequence):
    kind = "full"


class KVQPagedWindowSequence(KVQPagedSequence):
    kind = "sliding"
    bounded = True

    @property
    def max_size(self) -> int:
        return self.window


class _TableArray:
    """A batch's block tables as one int32 array `(rows, width)`: what attention
    reads, built once and kept in step with the `BlockTable`s (which stay the
    truth: references, copy on write, renumbering). A row is copied in again
    only when its blocks change (a new block, a copy on write, a window's
    blocks going back); a step that only appends tokens changes nothing here.
    Views share the array until the next change, which copies it first."""

    __slots__ = ("ids", "lent", "renumbered")

    def __init__(self, tables: list[BlockTable], renumbered: int):
        width = max((len(t.ids) for t in tables), default=0)
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


class KVQPagedFullCache(PagedCache):
    """A batch of full-attention rows over one pool; see the module docstring."""

    kind = "full"

    def __init__(self, pool: BlockPool, window: int | None = None):
        self.pool = pool
        self.window = window
        self.tables: list[BlockTable] = []
        self._limits: list[int] | None = None  # real row ends between prepare and finalize
        self._pad: list[int] | None = None
        self._table_array: _TableArray | None = None
        self._written: tuple | None = None  # (pool generation, the last write's view rows)
        self.offset = mx.array([], dtype=mx.int32)

    def _sync(self) -> None:
        """After the tables changed shape (rows in or out, trimmed): the table
        array is rebuilt when next needed."""
        self._table_array = None
        self.offset = mx.array([t.length for t in self.tables], dtype=mx.int32)
        self._written = None

    def _tables(self) -> _TableArray:
        ta = self._table_array
        if ta is None or ta.renumbered != self.pool.renumbered:
            ta = self._table_array = _TableArray(self.tables, self.pool.renumbered)
        return ta

    def _after_copy(self) -> None:
        self._sync()

    # -- the model's calls ----------------------------------------------------
    def _drop_old(self) -> None:
        if self.window is None:
            return
        for i, t in enumerate(self.tables):
            end = t.length if self._limits is None else min(t.length, self._limits[i])
            if t.drop_before(end - self.window + 1) and self._table_array is not None:
                self._table_array.set_row(i, t)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, _, N, _ = keys.shape
        if B != len(self.tables):
            raise ValueError(f"paged batch has {len(self.tables)} rows, got {B}")
        self._drop_old()
        k, v = self.pool.encode(keys, values)
        blocks, slots = self._reserve(N, k, v)

        def tokens(a: mx.array) -> mx.array:
            return a.transpose(0, 2, 1, 3).reshape(B * N, a.shape[1], a.shape[-1])

        self.pool.write(blocks, slots, k.map(tokens), v.map(tokens))
        ends = [t.length for t in self.tables]
        self.offset = mx.array(ends, dtype=mx.int32)
        out = self._view(ends)
        # A window keeps only what its next query sees: the view above holds its
        # own copy of the tables and the pool's arrays as written now, so blocks
        # go back at once (a prompt chunk's do not wait for the next step).
        self._drop_old()
        if self.window is not None:
            self._written = (self.pool.generation, out[0].tables, out[0].bases, out[0].ends)
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

    def _view(self, ends: list[int]) -> tuple[PagedKV, PagedKV]:
        bases = [t.base for t in self.tables]
        return self.pool.view(self._tables().lend(), bases, ends, self.window)

    def keys_and_values(self):
        """The rows as attention receives them. Right after a write, a window row
        returns the blocks only that write's queries see; until the rows change or
        the pool hands one of those blocks out again, this is still the last
        write's view, which KV-shared layers (gemma3n) read after their owner for
        the same queries."""
        if self._written is not None and self._written[0] == self.pool.generation:
            return self.pool.view(*self._written[1:], self.window)
        return self._view([t.length for t in self.tables])

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_):
        """ "causal" (or None for one token): attention derives each row's mask
        from positions (`PagedKV`), so no mask is laid out here."""
        if return_array:
            raise NotImplementedError(
                "paged caches derive masks from positions; this model asks for mask arrays: "
                "serve it with the padded layout"
            )
        if window_size is not None and window_size != self.window and self.window is None:
            raise NotImplementedError("a windowed mask over a full-attention paged cache")
        return "causal" if N > 1 else None

    # -- BatchGenerator's calls -----------------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        if left_padding is not None and max(left_padding) > 0:
            raise ValueError("paged caches take no left padding")
        if right_padding is not None and max(right_padding) > 0:
            self._pad = list(right_padding)
            self._limits = [t.length + n for t, n in zip(self.tables, lengths, strict=True)]

    def finalize(self) -> None:
        if self._pad is not None:
            for t, p in zip(self.tables, self._pad, strict=True):
                t.trim(p)
            self._pad = self._limits = None
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
        self._sync()

    def extend(self, other: KVQPagedFullCache) -> None:
        if other.pool is not self.pool:
            raise ValueError("paged caches extend only within one pool")
        self.tables += other.tables
        other.tables = []
        other._sync()
        self._sync()

    def extract(self, idx: int) -> KVQPagedSequence:
        """Row `idx` as one sequence sharing its blocks; a window keeps only what
        its next token sees (a row holds a whole prompt chunk until its next step)."""
        table = self.tables[idx].copy()
        if self.window is not None:
            table.drop_before(table.length - self.window + 1)
        return KVQPagedSequence(self.pool, self.window, table)

    @classmethod
    def merge(cls, caches: list[KVQPagedSequence]):
        return KVQPagedSequence.merge(caches)


class KVQPagedWindowCache(KVQPagedFullCache):
    """A batch of sliding-window rows: each keeps at most `window - 1` tokens
    before what it writes (plus the rest of a block), older blocks go back."""

    kind = "sliding"
    bounded = True

    def __init__(self, pool: BlockPool, window: int):
        super().__init__(pool, window)

    @property
    def max_size(self) -> int:
        return self.window

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_):
        if window_size is not None and window_size < self.window:
            raise NotImplementedError(
                f"a mask window ({window_size}) narrower than the cache's ({self.window})"
            )
        return super().make_mask(N, return_array)


@dataclass(frozen=True)
class PagesStats:
    """Blocks of every pool together."""

    pools: int
    capacity: int
    used: int
    shared: int
    nbytes: int  # storage allocated
    used_bytes: int  # bytes of the used blocks, each once

    @property
    def free(self) -> int:
        return self.capacity - self.used


class Pages:
    """The block pools of one model: one per paged cache slot (slot, member)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE):
        self.block_size = block_size
        self.pools: dict[tuple[int, int | None], BlockPool] = {}

    def pool(self, key: tuple[int, int | None], key_spec: QuantSpec, value_spec: QuantSpec):
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = BlockPool(self.block_size, key_spec, value_spec)
        return pool

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values())

    def compact(self) -> None:
        """Every pool gives back its free blocks beyond a growth step (between steps)."""
        for p in self.pools.values():
            p.compact()

    def held_bytes(self, caches: list) -> int:
        """Bytes of the blocks `caches` (and their members) refer to, each once."""
        blocks: dict[int, set[int]] = {}
        pools: dict[int, BlockPool] = {}
        stack = list(caches)
        while stack:
            c = stack.pop()
            if isinstance(c, PagedCache):
                pools[id(c.pool)] = c.pool
                blocks.setdefault(id(c.pool), set()).update(c.blocks())
            elif hasattr(c, "caches"):
                stack.extend(c.caches)
        return sum(len(ids) * pools[k].block_bytes for k, ids in blocks.items())

    def stats(self) -> PagesStats:
        s = [p.stats() for p in self.pools.values()]
        return PagesStats(
            len(s), sum(x.capacity for x in s), sum(x.used for x in s),
            sum(x.shared for x in s), self.nbytes, sum(x.used * x.block_bytes for x in s),
        )  # fmt: skip

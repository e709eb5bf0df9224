"""Block bookkeeping: ids, reference counts, the free list, and block tables.

Nothing here holds K/V (`storage.py` does): a `BlockAllocator` knows which
of a pool's blocks are free and how many tables refer to each one, and a
`BlockTable` is the list of blocks one sequence's tokens occupy in one pool.
Tables are copied by reference (`BlockTable.copy` adds a reference to each
block), so a prompt-cache entry and every sequence that starts with its
tokens hold those blocks once; a block is free again when its last
reference goes.
"""

from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass
from typing import Any, Protocol


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


class BlockAllocator:
    """The blocks of one pool: a reference count each, and the free ones
    (handed out lowest first, so used blocks gather at the front)."""

    def __init__(self) -> None:
        self.refs: list[int] = []
        self._free: list[int] = []
        # bumped whenever a freed block may hold other tokens or move (allocation,
        # compaction, storage released): a remembered table of freed blocks is stale
        self.generation = 0
        self.renumbered = 0  # counts renumberings: arrays of block ids made before are stale
        self._tables: weakref.WeakSet[BlockTable] = weakref.WeakSet()  # to renumber

    @property
    def capacity(self) -> int:
        return len(self.refs)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def shared(self) -> int:
        return sum(1 for r in self.refs if r > 1)

    def add(self, n: int) -> None:
        """`n` more blocks exist (the storage grew), all free."""
        cap = self.capacity
        self.refs.extend([0] * n)
        for b in range(cap, cap + n):
            heapq.heappush(self._free, b)

    def take(self) -> int:
        """The lowest free block, now with one reference (there must be one free)."""
        block = heapq.heappop(self._free)
        self.refs[block] = 1
        self.generation += 1
        return block

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def decref(self, blocks: list[int]) -> bool:
        """Drop one reference to each block; True when no block is referenced
        any more (then every block is forgotten: the storage can go)."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                heapq.heappush(self._free, b)
            elif self.refs[b] < 0:
                raise RuntimeError(f"block {b} released more often than referenced")
        if blocks and len(self._free) == len(self.refs):
            self.refs, self._free = [], []
            self.renumbered += 1
            self.generation += 1
            return True
        return False

    def in_use(self) -> list[int]:
        """The referenced blocks, in id order."""
        return [b for b, r in enumerate(self.refs) if r]

    def keep_only(self, used: list[int]) -> None:
        """After the storage kept only the blocks `used` (in this order, now
        `0 .. len(used) - 1`): every table is renumbered alike."""
        self.generation += 1
        if used != list(range(len(used))):
            new = {b: i for i, b in enumerate(used)}
            for t in list(self._tables):
                t.ids = [new[b] for b in t.ids]
            self.renumbered += 1
        self.refs = [self.refs[b] for b in used]
        self._free = []

    def track(self, table: BlockTable) -> None:
        self._tables.add(table)


class TablePool(Protocol):
    """What a table asks of its pool (`pool.BlockPool`)."""

    block_size: int
    allocator: BlockAllocator

    @property
    def refs(self) -> list[int]: ...

    @property
    def block_bytes(self) -> int: ...

    def allocate(self, k: Any, v: Any) -> int: ...

    def copy_block(self, block: int, k: Any, v: Any) -> int: ...

    def incref(self, blocks: list[int]) -> None: ...

    def decref(self, blocks: list[int]) -> None: ...


class BlockTable:
    """One sequence's blocks in one pool: tokens `[base, length)`, `base` a
    multiple of the block size. Returns its blocks to the pool when released
    or dropped."""

    __slots__ = ("__weakref__", "base", "ids", "length", "pool")

    def __init__(
        self, pool: TablePool, ids: list[int] | None = None, base: int = 0, length: int = 0
    ):
        self.pool = pool
        self.ids = ids or []
        self.base = base
        self.length = length
        pool.allocator.track(self)

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

    def reserve(self, n: int, k, v) -> tuple[list[int], list[int]]:
        """Blocks and slots for the next `n` tokens: new blocks as needed, and a
        private copy of a shared block before writing into it (`k`/`v`: stores
        shaped like what is written, for the pool's first allocation)."""
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


__all__ = ["BlockAllocator", "BlockTable", "PoolStats", "TablePool"]

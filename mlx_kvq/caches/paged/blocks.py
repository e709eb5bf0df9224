"""Block bookkeeping: ids, reference counts, who holds them, prefix hashes.

Nothing here holds K/V (`storage.py` does). A `BlockAllocator` is the truth
about one pool's blocks (nano-vllm's `BlockManager`, vLLM's block pool):

- which blocks are free, and how many references each used one has;
- who holds them: every reference belongs to an *account*, a request's id
  (its tables, and the blocks it claimed when admitted), `CACHE` (the
  prompt cache's entries) or None (a copy in passing). A used block is
  *live* when something other than the prompt cache refers to it, and
  *cached* when only the prompt cache does (that one yields first);
- which full blocks hold which tokens: a block is registered under the
  chained hash of every token up to its end (`chain_hashes`), so a prompt
  finds the blocks already holding its prefix (`lookup`). A block forgets
  its hash when it is freed or cut back.

A `BlockTable` is the list of blocks one sequence's tokens occupy in one
pool. Tables are copied by reference (`BlockTable.copy`), so a prompt-cache
entry and every sequence that starts with its tokens hold those blocks
once. `blocks_held` is how many blocks a table holds at most, the one
formula the KV budget prices paged rows with.
"""

from __future__ import annotations

import heapq
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

CACHE = "prompt cache"  # the account of the prompt cache's entries

Account = int | str | None


def blocks_held(tokens: int, block_size: int, window: int | None = None, chunk: int = 1) -> int:
    """The most blocks a row of `tokens` tokens holds in one pool: a block for
    every `block_size` of its tokens; under a window, only those of the
    `window - 1` tokens before a write of `chunk` tokens and of the chunk, with
    a partly used first block (what the window form keeps, `window.py`)."""
    blocks = -(-tokens // block_size)
    if window is None:
        return blocks
    return min(blocks, -(-(window - 1 + chunk) // block_size) + 1)


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block of `tokens`, each covering every token up to the
    block's end (the previous block's hash and this block's tokens)."""
    out, h = [], 0
    for i in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tuple(tokens[i : i + block_size])))
        out.append(h)
    return out


@dataclass(frozen=True)
class PoolStats:
    """Blocks of one pool: allocated, used by some table, shared by several."""

    capacity: int
    used: int
    shared: int
    block_bytes: int
    live: int = 0  # used blocks something besides the prompt cache refers to

    @property
    def free(self) -> int:
        return self.capacity - self.used


_FREE, _CACHED, _LIVE = 0, 1, 2


class BlockAllocator:
    """The blocks of one pool; see the module docstring. Free blocks are
    handed out lowest first, so used blocks gather at the front."""

    def __init__(self) -> None:
        self.refs: list[int] = []
        self.cache_refs: list[int] = []  # references from the prompt cache's entries
        self._free: list[int] = []
        self.held: dict[Account, int] = {}  # references by request account
        self.live = 0  # used blocks referred to by something besides the prompt cache
        self._hash_of: dict[int, int] = {}  # block -> the chained hash of its tokens
        self._by_hash: dict[int, int] = {}  # chained hash -> block
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
    def cached(self) -> int:
        """Used blocks only the prompt cache refers to."""
        return self.used - self.live

    @property
    def shared(self) -> int:
        return sum(1 for r in self.refs if r > 1)

    def add(self, n: int) -> None:
        """`n` more blocks exist (the storage grew), all free."""
        cap = self.capacity
        self.refs.extend([0] * n)
        self.cache_refs.extend([0] * n)
        for b in range(cap, cap + n):
            heapq.heappush(self._free, b)

    # -- references -------------------------------------------------------------
    def _state(self, b: int) -> int:
        r = self.refs[b]
        return _FREE if r == 0 else _CACHED if r == self.cache_refs[b] else _LIVE

    def _count(self, account: Account, n: int) -> None:
        if account is CACHE or account is None or not n:
            return
        held = self.held.get(account, 0) + n
        if held:
            self.held[account] = held
        else:
            self.held.pop(account, None)

    def take(self, account: Account = None) -> int:
        """The lowest free block, now with one reference (there must be one free)."""
        block = heapq.heappop(self._free)
        self.refs[block] = 1
        self.cache_refs[block] = int(account is CACHE)
        self.live += account is not CACHE
        self._count(account, 1)
        self.generation += 1
        return block

    def incref(self, blocks: list[int], account: Account = None) -> None:
        cache = account is CACHE
        for b in blocks:
            was = self._state(b)
            self.refs[b] += 1
            self.cache_refs[b] += cache
            if was != _LIVE and not cache:
                self.live += 1
        self._count(account, len(blocks))

    def decref(self, blocks: list[int], account: Account = None) -> bool:
        """Drop one reference to each block; True when no block is referenced
        any more (then every block is forgotten: the storage can go)."""
        cache = account is CACHE
        for b in blocks:
            if self.refs[b] <= 0:
                raise RuntimeError(f"block {b} released more often than referenced")
            was = self._state(b)
            self.refs[b] -= 1
            self.cache_refs[b] -= cache
            now = self._state(b)
            self.live += (now == _LIVE) - (was == _LIVE)
            if now == _FREE:
                self.forget(b)
                heapq.heappush(self._free, b)
        self._count(account, -len(blocks))
        if blocks and len(self._free) == len(self.refs):
            self.refs, self.cache_refs, self._free = [], [], []
            self.renumbered += 1
            self.generation += 1
            return True
        return False

    def move(self, blocks: list[int], old: Account, new: Account) -> None:
        """References to `blocks` change account (a table kept by the prompt cache)."""
        if old == new:
            return
        self.incref(blocks, new)
        self.decref(blocks, old)

    # -- prefix hashes ------------------------------------------------------------
    def register(self, blocks: list[int], hashes: list[int]) -> None:
        """Full blocks holding the tokens `hashes` cover (the first one found
        for a hash stays)."""
        for b, h in zip(blocks, hashes, strict=False):
            if self.refs[b] and b not in self._hash_of and h not in self._by_hash:
                self._hash_of[b] = h
                self._by_hash[h] = b

    def lookup(self, h: int) -> int | None:
        """The block holding the tokens chain hash `h` covers, if any."""
        return self._by_hash.get(h)

    def forget(self, block: int) -> None:
        """`block` no longer holds what it was registered for."""
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._by_hash[h]

    def live_only_for(self, accounts: set) -> int:
        """Live blocks that only tables of `accounts` refer to, besides the
        prompt cache (they are live no more once those tables go)."""
        refs: dict[int, int] = {}
        for t in list(self._tables):
            if t.account in accounts:
                for b in t.ids:
                    refs[b] = refs.get(b, 0) + 1
        return sum(1 for b, n in refs.items() if n == self.refs[b] - self.cache_refs[b])

    # -- compaction ---------------------------------------------------------------
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
            self._hash_of = {new[b]: h for b, h in self._hash_of.items()}
            self._by_hash = {h: b for b, h in self._hash_of.items()}
            self.renumbered += 1
        self.refs = [self.refs[b] for b in used]
        self.cache_refs = [self.cache_refs[b] for b in used]
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

    def allocate(self, k: Any, v: Any, account: Account = None) -> int: ...

    def copy_block(self, block: int, k: Any, v: Any, account: Account = None) -> int: ...

    def incref(self, blocks: list[int], account: Account = None) -> None: ...

    def decref(self, blocks: list[int], account: Account = None) -> None: ...


class BlockTable:
    """One sequence's blocks in one pool: tokens `[base, length)`, `base` a
    multiple of the block size, referenced on behalf of `account`. Returns its
    blocks to the pool when released or dropped."""

    __slots__ = ("__weakref__", "account", "base", "ids", "length", "pool")

    def __init__(
        self, pool: TablePool, ids: list[int] | None = None, base: int = 0, length: int = 0
    ):
        self.pool = pool
        self.ids = ids or []
        self.base = base
        self.length = length
        self.account: Account = None
        pool.allocator.track(self)

    def copy(self) -> BlockTable:
        """A table sharing these blocks (one more reference to each) for the same
        request (mlx-lm's batch splits by copying); a copy of a prompt-cache
        entry's is in passing until someone takes it (`hold_for`)."""
        account = None if self.account is CACHE else self.account
        self.pool.incref(self.ids, account)
        new = BlockTable(self.pool, list(self.ids), self.base, self.length)
        new.account = account
        return new

    def hold_for(self, account: Account) -> None:
        """Its references are `account`'s from now on."""
        self.pool.allocator.move(self.ids, self.account, account)
        self.account = account

    def release(self) -> None:
        ids, self.ids = self.ids, []
        self.pool.decref(ids, self.account)

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
            self.pool.decref(dropped, self.account)
        return n

    def trim(self, n: int) -> int:
        """Forget the last `n` tokens (never before `base`); returns how many."""
        n = max(0, min(n, self.length - self.base))
        self.length -= n
        bs = self.pool.block_size
        keep = -(-(self.length - self.base) // bs)
        if keep < len(self.ids):
            dropped, self.ids = self.ids[keep:], self.ids[:keep]
            self.pool.decref(dropped, self.account)
        if n and (self.length - self.base) % bs:
            # partly filled again: this table will write into it (the only way a
            # registered block's tokens can change)
            self.pool.allocator.forget(self.ids[-1])
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
            self.ids[first] = self.pool.copy_block(old, k, v, self.account)
            self.pool.decref([old], self.account)
        need = -(-(start + n - self.base) // bs)
        while len(self.ids) < need:
            self.ids.append(self.pool.allocate(k, v, self.account))
        rel = range(start - self.base, start + n - self.base)
        blocks = [self.ids[i // bs] for i in rel]
        slots = [i % bs for i in rel]
        self.length = start + n
        return blocks, slots

    def full_blocks(self) -> tuple[list[int], int]:
        """Its blocks holding a whole block of tokens, and the index of the
        first of them in the sequence's block order."""
        bs = self.pool.block_size
        whole = (self.length - self.base) // bs
        return self.ids[:whole], self.base // bs

    @property
    def nbytes(self) -> int:
        return len(self.ids) * self.pool.block_bytes


__all__ = [
    "CACHE",
    "Account",
    "BlockAllocator",
    "BlockTable",
    "PoolStats",
    "TablePool",
    "blocks_held",
    "chain_hashes",
]

"""Block pools: one layer's allocator and storage together, and a model's pools.

A `BlockPool` is what tables and paged caches hold: its `BlockAllocator`
(`blocks.py`) says which blocks are free and who holds the others, its
`BlockStorage` (`storage.py`) holds them. Storage grows by a sixteenth (at
least `min_growth` blocks) when no block is free, never past what its
`Pages` allows, and `compact` gives back what is free between steps.

`Pages` holds one pool per paged cache slot of a model and is the paged
layout's memory: what the pools hold (live, or kept by the prompt cache
only), what admitted requests were promised (`promise`: the blocks each
pool will hold for them at most, of which they hold some already), the
blocks an admitted request claims before its tables exist (`claim_blocks`:
those of the prompt-cache entry it starts from), and the rows leaving the
batch before the next step, whose blocks count as free (`leave`). The KV
budget asks it "are there N blocks"; it never prices blocks itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from ...config import PAGED_BLOCK_SIZE, QuantSpec
from ...quant import PagedKV, Store
from .blocks import Account, BlockAllocator, BlockTable, PoolStats, chain_hashes
from .storage import storage_for

PoolKey = tuple[int, int | None]  # (cache slot, member of a CacheList slot)


class BlockPool:
    """One layer's K/V blocks with reference counts; see the module docstring."""

    def __init__(
        self,
        block_size: int,
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        *,
        min_growth: int = 1,
        window: int | None = None,
        pages: Pages | None = None,
    ):
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.min_growth = max(1, min_growth)
        self.window = window
        self.pages = pages
        self.allocator = BlockAllocator()
        self.storage = storage_for(block_size, key_spec, value_spec)

    # -- what the caches read -------------------------------------------------
    @property
    def key_spec(self) -> QuantSpec:
        return self.storage.key_spec

    @property
    def value_spec(self) -> QuantSpec:
        return self.storage.value_spec

    @property
    def keys(self) -> Store | None:
        return self.storage.keys

    @keys.setter
    def keys(self, value: Store | None) -> None:
        self.storage.keys = value

    @property
    def values(self) -> Store | None:
        return self.storage.values

    @values.setter
    def values(self, value: Store | None) -> None:
        self.storage.values = value

    @property
    def refs(self) -> list[int]:
        return self.allocator.refs

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def used(self) -> int:
        return self.allocator.used

    @property
    def generation(self) -> int:
        return self.allocator.generation

    @property
    def renumbered(self) -> int:
        return self.allocator.renumbered

    @property
    def block_bytes(self) -> int:
        return self.storage.block_bytes

    @property
    def nbytes(self) -> int:
        """Bytes the pool's storage holds (used and free blocks)."""
        return self.storage.nbytes

    def stats(self) -> PoolStats:
        a = self.allocator
        return PoolStats(a.capacity, a.used, a.shared, self.block_bytes, a.live)

    def encode(self, keys: mx.array, values: mx.array) -> tuple[Store, Store]:
        return self.storage.encode(keys, values)

    # -- blocks ---------------------------------------------------------------
    def allocate(self, k: Store, v: Store, account: Account = None) -> int:
        """A free block with one reference, held for `account` (`k`/`v`:
        stores shaped like what is written, for the storage's first growth)."""
        if not self.allocator.free:
            add = max(self.min_growth, self.capacity // 16)
            if self.pages is not None:
                add = self.pages.growth(add, self.storage.bytes_per_block(k, v))
            self.storage.grow(add, k, v)
            self.allocator.add(add)
        return self.allocator.take(account)

    def make_free(self, n: int, k: Store, v: Store) -> None:
        """At least `n` free blocks, the storage grown at once (within what its
        `Pages` allows): for writing many blocks together, as reading a cached
        prefix back does, instead of growing block by block."""
        short = n - self.allocator.free
        if short <= 0:
            return
        if self.pages is not None:
            short = self.pages.growth(short, self.storage.bytes_per_block(k, v))
        self.storage.grow(short, k, v)
        self.allocator.add(short)

    def incref(self, blocks: list[int], account: Account = None) -> None:
        self.allocator.incref(blocks, account)

    def decref(self, blocks: list[int], account: Account = None) -> None:
        if self.allocator.decref(blocks, account):  # nothing refers to any block
            self.storage.release()

    def copy_block(self, block: int, k: Store, v: Store, account: Account = None) -> int:
        """A private copy of `block` (copy on write); the caller drops its reference."""
        new = self.allocate(k, v, account)
        self.storage.copy_block(block, new)
        return new

    def write(self, blocks: list[int], slots: list[int], k: Store, v: Store) -> None:
        self.storage.write(blocks, slots, k, v)

    def view(self, tables, bases, ends, window: int | None) -> tuple[PagedKV, PagedKV]:
        return self.storage.view(tables, bases, ends, window)

    def compact(self, everything: bool = False) -> None:
        """Give back free blocks once they are more than a growth step (a
        prefill's transient, sequences that left), or all of them: the used
        blocks move to the front (a copy of the storage) and every table is
        renumbered. Call it between steps, never while a table's block ids
        are being used."""
        if self.storage.keys is None:
            return
        used = self.allocator.in_use()
        free = self.capacity - len(used)
        if not free or (not everything and free <= max(self.min_growth, len(used) // 16)):
            return
        self.storage.keep(used)
        self.allocator.keep_only(used)


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


@dataclass(frozen=True)
class BlockUse:
    """One pool's blocks as the KV budget counts them."""

    live: int  # used, by something besides the prompt cache
    cached: int  # used by the prompt cache alone (it yields them first)
    capacity: int  # blocks the storage holds
    promised: int  # blocks admitted requests may still take beyond what they hold


class Pages:
    """The block pools of one model and what they hold; see the module docstring."""

    def __init__(self, block_size: int = PAGED_BLOCK_SIZE):
        self.block_size = block_size
        self.pools: dict[PoolKey, BlockPool] = {}
        self.limit: int | None = None  # bytes the storage may grow to (None: no limit)
        self.overdrafts = 0  # blocks made past the limit: a row needed one, none was free
        self._promised: dict[Account, dict[PoolKey, int]] = {}
        # what each account claimed: tables of their own, so that a compaction
        # between the claim and its release renumbers them with every table
        self._claims: dict[Account, list[BlockTable]] = {}
        self._leaving: set[Account] = set()  # rows leaving the batch before the next step

    def pool(
        self,
        key: PoolKey,
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        window: int | None = None,
    ) -> BlockPool:
        pool = self.pools.get(key)
        if pool is None:
            pool = BlockPool(self.block_size, key_spec, value_spec, window=window, pages=self)
            self.pools[key] = pool
        return pool

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools.values())

    def growth(self, want: int, block_bytes: int) -> int:
        """How many blocks a pool with none free may add (it wants `want`): as
        many as fit under `limit`, and one past it (counted) when none does."""
        if self.limit is None or not block_bytes:
            return want
        fit = (self.limit - self.nbytes) // block_bytes
        if fit < 1:
            self.overdrafts += 1
            return 1
        return min(want, fit)

    def compact(self, everything: bool = False) -> None:
        """Every pool gives back its free blocks beyond a growth step (or all of
        them), between steps."""
        for p in self.pools.values():
            p.compact(everything)

    # -- what admitted requests hold and may take ----------------------------------
    def promise(self, account: Account, blocks: dict[PoolKey, int]) -> None:
        """`account` (an admitted request) may hold up to `blocks` per pool."""
        self._leaving.discard(account)
        self._promised[account] = dict(blocks)

    def leave(self, account: Account) -> None:
        """`account`'s rows leave the batch before the next step (preempted,
        ended): the blocks only they refer to count as free from now on
        (they are freed, or go to the prompt cache, which yields them)."""
        self._leaving.add(account)

    def settle(self) -> None:
        """A step ran: the rows that were leaving have left."""
        self._leaving.clear()

    def promised(self, account: Account) -> dict[PoolKey, int]:
        return self._promised.get(account, {})

    def close(self, account: Account) -> None:
        """`account` holds what its tables hold, and is promised nothing more."""
        self._promised.pop(account, None)
        self.unclaim(account)

    def use(self) -> dict[PoolKey, BlockUse]:
        """Every pool's blocks as the budget counts them (pools not made yet: 0)."""
        owed: dict[PoolKey, int] = {}
        for account, blocks in self._promised.items():
            for key, n in blocks.items():
                pool = self.pools.get(key)
                held = pool.allocator.held.get(account, 0) if pool is not None else 0
                owed[key] = owed.get(key, 0) + max(0, n - held)
        out = {}
        for key in set(self.pools) | set(owed):
            pool = self.pools.get(key)
            a = pool.allocator if pool is not None else None
            live = 0 if a is None else a.live
            if a is not None and self._leaving:
                live -= a.live_only_for(self._leaving)
            out[key] = BlockUse(
                live, a.cached if a else 0, a.capacity if a else 0, owed.get(key, 0)
            )
        return out

    # -- prefixes --------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> dict[PoolKey, list[int]]:
        """The blocks already holding `tokens`' prefix, per pool, that a
        sequence starting from it keeps: under full attention every full block
        from the start, under a window those its next token sees. At least the
        last token is left out (the model must see it)."""
        bs = self.block_size
        hashes = chain_hashes(tokens[: max(0, len(tokens) - 1)], bs)
        out: dict[PoolKey, list[int]] = {}
        reach = len(hashes)  # whole blocks every full-attention pool holds
        for key, pool in self.pools.items():
            if pool.window is None:
                found = []
                for h in hashes[:reach]:
                    b = pool.allocator.lookup(h)
                    if b is None:
                        break
                    found.append(b)
                reach = len(found)
                out[key] = found
        for key, pool in self.pools.items():
            if pool.window is not None:
                first = max(0, (reach * bs - pool.window + 1) // bs)
                found = [pool.allocator.lookup(h) for h in hashes[first:reach]]
                out[key] = [b for b in found if b is not None]
        return out

    def claim(self, account: Account, tokens: Sequence[int]) -> dict[PoolKey, int]:
        """Take a reference, for `account`, to the blocks holding `tokens`'
        prefix (`match`): they stay until its tables hold them (`unclaim`).
        Returns how many per pool."""
        return self.claim_blocks(account, self.match(tokens))

    def claim_blocks(
        self, account: Account, blocks: dict[PoolKey, list[int]]
    ) -> dict[PoolKey, int]:
        """Take a reference, for `account`, to `blocks` (per pool; those of the
        prompt-cache entry it will start from, `caches.blocks_kept`): they stay
        until its tables hold them (`unclaim`). Returns how many per pool."""
        self.unclaim(account)
        found = {k: list(ids) for k, ids in blocks.items() if ids}
        tables = []
        for key, ids in found.items():
            pool = self.pools[key]
            pool.incref(ids, account)
            table = BlockTable(pool, list(ids))
            table.account = account
            tables.append(table)
        if tables:
            self._claims[account] = tables
        return {k: len(ids) for k, ids in found.items()}

    def key_of(self, pool: BlockPool) -> PoolKey:
        """The key `pool` is held under."""
        return next(k for k, p in self.pools.items() if p is pool)

    def unclaim(self, account: Account) -> None:
        for table in self._claims.pop(account, ()):
            table.release()

    def stats(self) -> PagesStats:
        s = [p.stats() for p in self.pools.values()]
        return PagesStats(
            len(s), sum(x.capacity for x in s), sum(x.used for x in s),
            sum(x.shared for x in s), self.nbytes, sum(x.used * x.block_bytes for x in s),
        )  # fmt: skip


__all__ = ["BlockPool", "BlockUse", "Pages", "PagesStats", "PoolKey"]

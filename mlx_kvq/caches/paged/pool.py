"""Block pools: one layer's allocator and storage together, and a model's pools.

A `BlockPool` is what tables and paged caches hold: its `BlockAllocator`
(`blocks.py`) says which blocks are free, its `BlockStorage` (`storage.py`)
holds them. Storage grows by a sixteenth (at least `min_growth` blocks)
when no block is free, and `compact` gives back what is free between steps.
`Pages` holds one pool per paged cache slot of a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ...config import PAGED_BLOCK_SIZE, QuantSpec
from ...quant import PagedKV, Store
from .blocks import BlockAllocator, PoolStats
from .storage import BlockStorage


class BlockPool:
    """One layer's K/V blocks with reference counts; see the module docstring."""

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
        self.min_growth = max(1, min_growth)
        self.allocator = BlockAllocator()
        self.storage = BlockStorage(block_size, key_spec, value_spec)

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
        return PoolStats(a.capacity, a.used, a.shared, self.block_bytes)

    def encode(self, keys: mx.array, values: mx.array) -> tuple[Store, Store]:
        return self.storage.encode(keys, values)

    # -- blocks ---------------------------------------------------------------
    def allocate(self, k: Store, v: Store) -> int:
        """A free block with one reference (`k`/`v`: stores shaped like what is
        written, for the storage's first growth)."""
        if not self.allocator.free:
            add = max(self.min_growth, self.capacity // 16)
            self.storage.grow(add, k, v)
            self.allocator.add(add)
        return self.allocator.take()

    def incref(self, blocks: list[int]) -> None:
        self.allocator.incref(blocks)

    def decref(self, blocks: list[int]) -> None:
        if self.allocator.decref(blocks):  # nothing refers to any block: the storage goes
            self.storage.release()

    def copy_block(self, block: int, k: Store, v: Store) -> int:
        """A private copy of `block` (copy on write); the caller drops its reference."""
        new = self.allocate(k, v)
        self.storage.copy_block(block, new)
        return new

    def write(self, blocks: list[int], slots: list[int], k: Store, v: Store) -> None:
        self.storage.write(blocks, slots, k, v)

    def view(self, tables, bases, ends, window: int | None) -> tuple[PagedKV, PagedKV]:
        return self.storage.view(tables, bases, ends, window)

    def compact(self) -> None:
        """Give back free blocks once they are more than a growth step (a
        prefill's transient, sequences that left): the used blocks move to the
        front (a copy of the storage) and every table is renumbered. Call it
        between steps, never while a table's block ids are being used."""
        if self.storage.keys is None:
            return
        used = self.allocator.in_use()
        if self.capacity - len(used) <= max(self.min_growth, len(used) // 16):
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


class Pages:
    """The block pools of one model: one per paged cache slot (slot, member)."""

    def __init__(self, block_size: int = PAGED_BLOCK_SIZE):
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

    def stats(self) -> PagesStats:
        s = [p.stats() for p in self.pools.values()]
        return PagesStats(
            len(s), sum(x.capacity for x in s), sum(x.used for x in s),
            sum(x.shared for x in s), self.nbytes, sum(x.used * x.block_bytes for x in s),
        )  # fmt: skip


__all__ = ["BlockPool", "Pages", "PagesStats"]

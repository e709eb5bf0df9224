"""Block storage: one layer's keys and values, block by block.

`BlockStorage` holds `(blocks, block_size, heads, dim)` per part of a
`Store` (packed data, scales and biases, or the raw array), as the layer's
specs say; block `b` of every part is one block's K or V. It knows nothing
of references or tables (`blocks.py`): it grows, writes token slots, copies
a block, keeps a subset of blocks (compaction) and hands attention views.
Another storage form (say keys quantized per channel over a block) is
another class with these methods (`BlockStore`), chosen for a layer's specs
in `storage_for`, the one place a pool's storage is made.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from ...config import QuantSpec
from ...quant import PagedKV, Store


class BlockStore(Protocol):
    """What a pool asks of its storage."""

    block_size: int
    key_spec: QuantSpec
    value_spec: QuantSpec
    keys: Store | None
    values: Store | None
    blocks: int

    @property
    def nbytes(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...

    def encode(self, keys: mx.array, values: mx.array) -> tuple[Store, Store]: ...

    def bytes_per_block(self, k: Store, v: Store) -> int: ...

    def grow(self, add: int, k: Store, v: Store) -> None: ...

    def release(self) -> None: ...

    def keep(self, blocks: list[int]) -> None: ...

    def copy_block(self, src: int, dst: int) -> None: ...

    def write(self, blocks: list[int], slots: list[int], k: Store, v: Store) -> None: ...

    def view(self, tables, bases, ends, window: int | None) -> tuple[PagedKV, PagedKV]: ...

    def gather(self, ids: list[int], base: int, length: int) -> tuple[Store, Store]: ...


class BlockStorage:
    """One layer's K/V blocks, each part of a `Store` laid out block by block;
    made at the first growth (heads, dims and dtypes come from the first
    tokens written)."""

    def __init__(self, block_size: int, key_spec: QuantSpec, value_spec: QuantSpec):
        self.block_size = block_size
        self.key_spec = key_spec
        self.value_spec = value_spec
        self.keys: Store | None = None
        self.values: Store | None = None
        self.blocks = 0

    @property
    def nbytes(self) -> int:
        """Bytes held (every block, used or free)."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    @property
    def block_bytes(self) -> int:
        return self.nbytes // self.blocks if self.blocks else 0

    def encode(self, keys: mx.array, values: mx.array) -> tuple[Store, Store]:
        """`keys`/`values` (B, H, N, D) stored as this storage stores them."""
        return Store.encode(keys, self.key_spec), Store.encode(values, self.value_spec)

    def bytes_per_block(self, k: Store, v: Store) -> int:
        """Bytes one block takes, for tokens stored like `k`/`v` (B, H, N, D')."""
        return self.block_size * sum(
            a.shape[1] * a.shape[-1] * a.itemsize for a in (*k.parts, *v.parts)
        )

    def grow(self, add: int, k: Store, v: Store) -> None:
        """`add` more (zeroed) blocks, shaped like `k`/`v` per token."""

        def zeros(a: mx.array) -> mx.array:
            return mx.zeros((add, self.block_size, a.shape[1], a.shape[-1]), a.dtype)

        new_k, new_v = k.map(zeros), v.map(zeros)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = Store.concat([self.keys, new_k], axis=0)
            self.values = Store.concat([self.values, new_v], axis=0)
        self.blocks += add

    def release(self) -> None:
        """Drop every block."""
        self.keys = self.values = None
        self.blocks = 0

    def keep(self, blocks: list[int]) -> None:
        """Keep only `blocks`, in this order (a copy of the storage)."""
        if blocks == list(range(len(blocks))):  # the dropped blocks are the tail
            self.keys = self.keys.map(lambda a: mx.array(a[: len(blocks)]))
            self.values = self.values.map(lambda a: mx.array(a[: len(blocks)]))
        else:
            ids = mx.array(blocks, dtype=mx.int32)
            self.keys = self.keys.map(lambda a: a[ids])
            self.values = self.values.map(lambda a: a[ids])
        self.blocks = len(blocks)

    def copy_block(self, src: int, dst: int) -> None:
        self.keys[dst : dst + 1] = self.keys[src : src + 1]
        self.values[dst : dst + 1] = self.values[src : src + 1]

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

    def gather(self, ids: list[int], base: int, length: int) -> tuple[Store, Store]:
        """The tokens `[base, length)` held in blocks `ids`, as `(1, H, n, D)`
        stores (a gathered copy: for caches of another layout)."""
        parts = []
        for store in (self.keys, self.values):
            view = PagedKV(store.fetch(), (ids,), (base,), (length,), self.block_size)
            row = view.row(0)
            parts.append(
                Store((row.data, row.scales, row.biases) if view.quantized else (row,), store.spec)
            )
        return parts[0], parts[1]


def storage_for(block_size: int, key_spec: QuantSpec, value_spec: QuantSpec) -> BlockStore:
    """The storage of a pool whose layer stores keys and values as these specs say."""
    return BlockStorage(block_size, key_spec, value_spec)


__all__ = ["BlockStorage", "BlockStore", "storage_for"]

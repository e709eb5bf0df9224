"""Block storage: one layer's keys and values, block by block.

`BlockStorage` holds `(blocks, block_size, heads, dim)` per part of a
`Store` (packed data, scales and biases, or the raw array), as the layer's
specs say; block `b` of every part is one block's K or V. It knows nothing
of references or tables (`blocks.py`): it grows, writes token slots, copies
a block, keeps a subset of blocks (compaction) and hands attention views.
Another storage form is another class, chosen for a layer's specs in
`storage_for`, the one place a pool's storage is made: `SplitBlockStorage`
holds the split layout's blocks (`mlx_kvq/split.py`; keys per channel over
whole groups of a block, values per token, a first block's exact sinks
beside it), written a whole block at a time and never again.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from ...config import QuantSpec, is_split
from ...quant import PagedKV, QuantizedKV, Store, rotate, scale_dtype


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


def _append_blocks(storage: BlockStorage | SplitBlockStorage, k: Store, v: Store, add: int) -> None:
    """Append `add` blocks `k`/`v` to a storage's pools (the first ones make
    them, and fix the bytes a block takes)."""
    storage._block_bytes = (k.nbytes + v.nbytes) // add
    if storage.keys is None:
        storage.keys, storage.values = k, v
    else:
        storage.keys = Store.concat([storage.keys, k], axis=0)
        storage.values = Store.concat([storage.values, v], axis=0)
    storage.blocks += add


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
        self._block_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes held (every block, used or free)."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    @property
    def block_bytes(self) -> int:
        return self._block_bytes if self.blocks else 0

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

        _append_blocks(self, k.map(zeros), v.map(zeros), add)

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


def split_refusal(block_size: int, key_spec: QuantSpec, value_spec: QuantSpec) -> str | None:
    """Why split-layout specs cannot page in blocks of `block_size` tokens
    (None: they can): a block must be whole key groups (it is quantized once,
    when full, and shared as it is) and hold the sinks in its first tokens."""
    if key_spec.per_channel and block_size % key_spec.group_size:
        return (
            f"--kv-block-size {block_size} is not a multiple of --kv-key-group-size "
            f"{key_spec.group_size}: a block must be whole key groups, pass --kv-block-size "
            f"{key_spec.group_size} to page them"
        )
    sinks = max(key_spec.sinks, value_spec.sinks)
    if sinks >= block_size:
        return (
            f"--kv-sinks {sinks} does not fit in a block of --kv-block-size {block_size} "
            "tokens: the sinks are held beside the first block"
        )
    return None


class SplitBlockStorage:
    """One layer's blocks in the split layout: every block is `block_size`
    tokens quantized once, when the sequence that wrote it moved past it
    (exact tokens stay with each sequence, `split.py` of this package).

    Keys per channel (`key_spec.per_channel`) are held channel-major,
    `(blocks, heads, dim, block_size * bits / 32)` and a scale and bias per
    channel for each group of the block (whole groups: `split_refusal`);
    per-token keys and values as `BlockStorage` holds them, `(blocks,
    block_size, heads, dim')`. `sinks[b]`: the exact first tokens of a
    sequence, beside its first block `b` (shared with the block; the slots of
    the block under them are never read)."""

    def __init__(self, block_size: int, key_spec: QuantSpec, value_spec: QuantSpec):
        refusal = split_refusal(block_size, key_spec, value_spec)
        if refusal:
            raise ValueError(f"the split layout cannot page: {refusal}")
        self.block_size = block_size
        self.key_spec = key_spec
        self.value_spec = value_spec
        self.sink_count = max(key_spec.sinks, value_spec.sinks)
        self.residual = max(key_spec.residual, value_spec.residual)
        self.keys: Store | None = None
        self.values: Store | None = None
        self.sinks: dict[int, tuple[mx.array, mx.array]] = {}
        self.blocks = 0
        self._block_bytes = 0
        self._none = None  # `no_blocks`, made once

    @property
    def nbytes(self) -> int:
        """Bytes held: every block (used or free) and the sinks beside them."""
        if self.keys is None:
            return 0
        sinks = sum(k.nbytes + v.nbytes for k, v in self.sinks.values())
        return self.keys.nbytes + self.values.nbytes + sinks

    @property
    def block_bytes(self) -> int:
        return self._block_bytes if self.blocks else 0

    @property
    def exact_dtype(self) -> mx.Dtype:
        """The 16-bit type exact tokens are held in (the scales'), once a block exists."""
        return (self.keys.parts[1] if self.keys.quantized else self.keys.parts[0]).dtype

    # -- encoding -------------------------------------------------------------
    def encode(self, keys: mx.array, values: mx.array) -> tuple[Store, Store]:
        """Whole blocks `keys`/`values` (n, H, block_size, D), exact 16-bit
        tokens, as stored: `(n, ...)` parts for `write_blocks`."""
        sd = scale_dtype(keys.dtype)
        k = self.key_spec
        if k.per_channel:
            x = keys.astype(mx.float32)
            if k.rotation == "hadamard":
                x = rotate(x)
            w, s, b = mx.quantize(x.swapaxes(-1, -2), group_size=k.group_size, bits=k.bits)
            key_store = Store((w, s.astype(sd), b.astype(sd)), k)
        else:
            key_store = self._tokens(keys, k, sd)
        return key_store, self._tokens(values, self.value_spec, sd)

    def no_blocks(self, heads: int, key_dim: int, value_dim: int, dtype: mx.Dtype):
        """Stores of no block, shaped as this layer's blocks of `dtype` exact
        tokens: attention reads rows that hold only exact tokens through them."""
        key = (heads, key_dim, value_dim, dtype)
        if self._none is None or self._none[0] != key:
            shape = (1, heads, self.block_size)
            k, v = self.encode(
                mx.zeros((*shape, key_dim), dtype), mx.zeros((*shape, value_dim), dtype)
            )
            self._none = (key, k.map(lambda a: a[:0]), v.map(lambda a: a[:0]))
        return self._none[1], self._none[2]

    @staticmethod
    def _tokens(x: mx.array, spec: QuantSpec, sd: mx.Dtype) -> Store:
        s = Store.encode(x.astype(mx.float32), spec, sd) if spec.quantized else Store((x,), spec)
        return s.map(lambda a: a.transpose(0, 2, 1, 3))  # (n, block_size, H, D')

    def bytes_per_block(self, k: Store, v: Store) -> int:
        """Bytes one block takes, for blocks encoded like `k`/`v`."""
        return (k.nbytes + v.nbytes) // k.parts[0].shape[0]

    # -- blocks ---------------------------------------------------------------
    def grow(self, add: int, k: Store, v: Store) -> None:
        """`add` more (zeroed) blocks, shaped like the blocks of `k`/`v`."""

        def zeros(a: mx.array) -> mx.array:
            return mx.zeros((add, *a.shape[1:]), a.dtype)

        _append_blocks(self, k.map(zeros), v.map(zeros), add)

    def release(self) -> None:
        self.keys = self.values = None
        self.sinks = {}
        self.blocks = 0

    def keep(self, blocks: list[int]) -> None:
        """Keep only `blocks`, in this order (their sinks follow them)."""
        ids = mx.array(blocks, dtype=mx.int32)
        self.keys = self.keys.map(lambda a: a[ids])
        self.values = self.values.map(lambda a: a[ids])
        self.sinks = {i: self.sinks[b] for i, b in enumerate(blocks) if b in self.sinks}
        self.blocks = len(blocks)

    def copy_block(self, src: int, dst: int) -> None:
        raise RuntimeError("split-layout blocks are written once, full, and never copied")

    def write(self, blocks: list[int], slots: list[int], k: Store, v: Store) -> None:
        raise RuntimeError("split-layout blocks are written whole (write_blocks)")

    def write_blocks(self, ids: list[int], k: Store, v: Store, sinks: dict) -> None:
        """Blocks `ids` get the encoded blocks `k`/`v` (`encode`), and
        `sinks` (block -> exact (1, H, S, D) keys and values) beside the first
        blocks of sequences (a block reused without sinks drops its old ones)."""
        at = mx.array(ids, dtype=mx.int32)
        self.keys[at] = k
        self.values[at] = v
        for b in ids:
            self.sinks.pop(b, None)
        self.sinks.update(sinks)

    def body(self, ids: list[int]) -> tuple:
        """Blocks `ids` (a row's, oldest first) gathered as one quantized body
        `(1, H, n, D)` of keys and of values (`QuantizedKV`, or arrays when
        unquantized): a copy of those blocks, packed as they are."""
        ix = mx.array(ids, dtype=mx.int32)
        return self._gather(self.keys, ix, self.key_spec), self._gather(
            self.values, ix, self.value_spec
        )

    @staticmethod
    def _gather(store: Store, ix: mx.array, spec: QuantSpec):
        if spec.per_channel:

            def one(a: mx.array) -> mx.array:  # (n, H, D, w) -> (1, H, D, n * w)
                g = a[ix].transpose(1, 2, 0, 3)
                return mx.contiguous(g.reshape(1, *g.shape[:2], -1))
        else:

            def one(a: mx.array) -> mx.array:  # (n, bs, H, D') -> (1, H, n * bs, D')
                g = a[ix]
                return g.reshape(-1, *g.shape[2:]).transpose(1, 0, 2)[None]  # read strided

        parts = [one(a) for a in store.parts]
        if len(parts) == 1:
            return parts[0]
        return QuantizedKV(*parts, spec.bits, spec.group_size, spec.rotation == "hadamard",
                           spec.per_channel)  # fmt: skip

    def view(self, tables, bases, ends, window: int | None):
        raise RuntimeError("split-layout rows are read through their batch (paged/split.py)")

    def gather(self, ids: list[int], base: int, length: int):
        raise RuntimeError("split-layout rows are read through their batch (paged/split.py)")


def storage_for(
    block_size: int, key_spec: QuantSpec, value_spec: QuantSpec
) -> BlockStore | SplitBlockStorage:
    """The storage of a pool whose layer stores keys and values as these specs say."""
    if is_split(key_spec, value_spec):
        return SplitBlockStorage(block_size, key_spec, value_spec)
    return BlockStorage(block_size, key_spec, value_spec)


__all__ = [
    "BlockStorage",
    "BlockStore",
    "SplitBlockStorage",
    "split_refusal",
    "storage_for",
]

"""The one quantized-storage helper every cache uses.

A `Store` is a key or value tensor laid out like mlx-lm's cache buffers,
`(batch, heads, tokens, dim)`, held either raw (one array in the model's
dtype) or quantized (packed uint32 plus 16-bit scales and biases). Every
structural operation a cache needs (slice, write a slot, append, roll, pad,
take batch rows) indexes only the leading axes, so it applies unchanged to
each part: the cache classes are written once and work in both forms.

`QuantizedKV` is what a quantized cache hands to attention: the packed parts
plus the numbers needed to use them (bits, group size, rotation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .config import QuantSpec


def scale_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """16-bit type of the scales and biases for inputs of `dtype`.

    bfloat16 inputs keep bfloat16 scales: their range is float32's, so a
    group with values past float16's 65504 (large activations are common in
    bfloat16-trained models) cannot turn into inf, and the scales are as
    precise as the inputs. Everything else gets float16, whose three extra
    mantissa bits matter at 8 bits. Either way 16 bits: `bits/8 + 4/group`
    bytes per element.
    """
    return mx.bfloat16 if dtype == mx.bfloat16 else mx.float16


def rotate(x: mx.array) -> mx.array:
    """Orthonormal Hadamard transform over the last axis (its own inverse);
    an empty array (a row extracted with no tokens) stays as it is."""
    if x.size == 0:
        return x
    return mx.hadamard_transform(x, scale=1.0 / math.sqrt(x.shape[-1]))


@dataclass(frozen=True)
class QuantizedKV:
    """Packed keys or values as attention receives them.

    Per token (the default): `data` is (B, H, N, D * bits / 32), a scale and
    a bias per `group_size` channels of each token. `per_channel` (keys of
    the split layout): channel-major, `data` (B, H, D, N * bits / 32) packed
    along the tokens, a scale and a bias per channel for each `group_size`
    tokens (KIVI); `shape` is still (B, H, N, D).
    """

    data: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int
    rotated: bool = False
    per_channel: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, packed = self.data.shape
        if self.per_channel:
            *lead, dim = lead
            return (*lead, packed * 32 // self.bits, dim)
        return (*lead, packed * 32 // self.bits)

    def map(self, fn: Callable[[mx.array], mx.array]) -> QuantizedKV:
        """`fn` applied to every part (along leading axes only: per-channel
        data keeps the tokens on its last axis)."""
        return QuantizedKV(
            fn(self.data),
            fn(self.scales),
            fn(self.biases),
            self.bits,
            self.group_size,
            self.rotated,
            self.per_channel,
        )

    def tokens(self, start: int, stop: int) -> QuantizedKV:
        """Tokens [start, stop) (whole groups, for per-channel data)."""
        if not self.per_channel:
            return self.map(lambda a: a[..., start:stop, :])
        g = self.group_size
        if start % g or (stop % g and stop != self.shape[-2]):
            raise ValueError(f"per-channel tokens [{start}, {stop}) cut a group of {g}")
        w = self.bits
        return QuantizedKV(
            self.data[..., start * w // 32 : stop * w // 32],
            self.scales[..., start // g : -(-stop // g)],
            self.biases[..., start // g : -(-stop // g)],
            self.bits, g, self.rotated, True,
        )  # fmt: skip

    def dequantize(self, dtype: mx.Dtype = mx.float16) -> mx.array:
        """Full-precision copy in the original (unrotated) basis, token-major
        (B, H, N, D), computed in `dtype` (float32 output is not rounded
        through 16 bits)."""
        x = mx.dequantize(
            self.data,
            self.scales.astype(dtype),
            self.biases.astype(dtype),
            group_size=self.group_size,
            bits=self.bits,
        )
        if self.per_channel:
            x = x.swapaxes(-1, -2)
        return rotate(x) if self.rotated else x


@dataclass(frozen=True)
class SplitKV:
    """Keys or values of a split-layout cache (`mlx_kvq/split.py`) as
    attention receives them, in token order: `head` (the first tokens,
    unquantized), `body` (quantized), `tail` (the newest, unquantized).
    Parts may be None; raw parts are (B, H, n, D) arrays."""

    head: mx.array | None
    body: QuantizedKV | mx.array | None
    tail: mx.array | None

    def parts(self) -> list:
        """The parts present, in token order."""
        return [p for p in (self.head, self.body, self.tail) if p is not None]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        parts = self.parts()
        B, H, _, D = parts[0].shape
        return (B, H, sum(p.shape[2] for p in parts), D)

    @property
    def lengths(self) -> tuple[int, int, int]:
        return tuple(0 if p is None else p.shape[2] for p in (self.head, self.body, self.tail))

    def map(self, fn: Callable[[mx.array], mx.array]) -> SplitKV:
        """`fn` (over leading axes) applied to every part."""

        def one(p):
            if p is None:
                return None
            return p.map(fn) if isinstance(p, QuantizedKV) else fn(p)

        return SplitKV(one(self.head), one(self.body), one(self.tail))

    def reach(self, n: int) -> int:
        """The fewest leading tokens, `n` or more, that `upto` can keep (a
        per-channel body is cut at whole groups)."""
        h, b, t = self.lengths
        if n >= h + b + t:
            return h + b + t
        if n <= h:
            return h
        body = self.body
        if n < h + b and isinstance(body, QuantizedKV) and body.per_channel:
            g = body.group_size
            return h + min(b, -(-(n - h) // g) * g)
        return n

    def upto(self, n: int) -> SplitKV:
        """Its first `n` tokens (`n` from `reach`): what a block of causal
        queries that sees no later key reads."""
        h, b, t = self.lengths
        if n >= h + b + t:
            return self
        if n <= h:
            return SplitKV(self.head, None, None)
        if n <= h + b:
            body = self.body
            m = n - h
            cut = body.tokens(0, m) if isinstance(body, QuantizedKV) else body[..., :m, :]
            return SplitKV(self.head, cut, None)
        return SplitKV(self.head, self.body, self.tail[..., : n - h - b, :])

    def dequantize(self, dtype: mx.Dtype) -> mx.array:
        """All tokens as one (B, H, N, D) array of `dtype`."""
        parts = [
            p.dequantize(dtype) if isinstance(p, QuantizedKV) else p.astype(dtype)
            for p in self.parts()
        ]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


@dataclass(frozen=True, eq=False)
class Reread:
    """What one multi-token write of a split-layout row quantized while it
    ran, kept exact for that write's own queries: the query at position `q`
    reads the body before `body_end(q)` quantized and every later key exact,
    as a token-by-token decode would have at `q`. So what a prompt's tokens
    see does not depend on where its chunks end (docs/server.md, "Same
    input, same output").

    `keys`/`values` (1, H, n, D) are the row's exact tokens `[start, end)`
    before the write quantized any: `start` is where its body ended before
    the write, `stop` where it ends after. A decode moves a `unit` of tokens
    to the body each time `residual + unit` are exact, so that is the rule."""

    keys: mx.array
    values: mx.array
    start: int
    stop: int
    residual: int
    unit: int

    def body_end(self, position: int) -> int:
        """Where the body ends for the query at `position` (a decode's, after
        writing it)."""
        moved = max(0, position + 1 - self.start - self.residual) // self.unit * self.unit
        return min(self.stop, self.start + moved)

    def runs(self, first: int, end: int) -> list[tuple[int, int, int]]:
        """The queries at positions `[first, end)` as runs `(q0, q1, body
        end)` of queries that read the same body."""
        out: list[tuple[int, int, int]] = []
        q = first
        while q < end:
            e = self.body_end(q)
            q1 = end if e >= self.stop else min(end, e + self.unit + self.residual - 1)
            out.append((q, q1, e))
            q = q1
        return out


@dataclass(frozen=True, eq=False)
class SplitRows:
    """A batch of split-layout rows as attention receives them: row `b`
    (`rows[b]`, batch axis of size 1) holds its first `heads[b]` positions,
    then the run `[firsts[b], ends[b])`. Its queries are the last positions
    before `ends[b]`; they see the keys at or before their own position, the
    head always and the rest within `window` positions when a window is set
    (the mask is derived from positions, as for `PagedKV`)."""

    rows: tuple[SplitKV, ...]
    heads: tuple[int, ...]
    firsts: tuple[int, ...]
    ends: tuple[int, ...]
    window: int | None = None
    rereads: tuple[Reread | None, ...] = ()  # per row, after a write that quantized

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Logical (rows, heads, longest row, dim); nothing has this shape in memory."""
        _, H, _, D = self.rows[0].shape
        return (len(self.rows), H, max(r.shape[2] for r in self.rows), D)

    def positions(self, b: int) -> mx.array:
        """The positions row `b`'s keys hold, in order."""
        return mx.concatenate([mx.arange(self.heads[b]), mx.arange(self.firsts[b], self.ends[b])])


@dataclass(frozen=True, eq=False)
class PagedSplitKV:
    """Keys or values of a batch of split-layout rows in blocks
    (`caches/paged/split.py`), as attention receives them.

    Row `b` holds positions `[0, ends[b])`: the first `blocks[b] *
    block_size` in the blocks `tables[b]` of `pool` (quantized once, in the
    body's basis), then its exact tail: the first `ends[b] - blocks[b] *
    block_size` slots of row `b` of `tail` `(rows, H, capacity, D)` (None:
    no row has one). Its exact
    `sinks[b]` stand for the first slots of its first block (None: no block
    yet, or no sinks). Its queries are the last positions before `ends[b]`
    and see the keys at or before their own. `rows()` lays the same rows
    out one by one (`SplitRows`, a copy of each row's blocks) for the paths
    that read them so; it reads the cache as it is until the next write.
    """

    pool: QuantizedKV | mx.array
    block_size: int
    tables: np.ndarray  # (rows, width) int32 block ids, oldest first
    blocks: tuple[int, ...]
    ends: tuple[int, ...]
    sinks: tuple[mx.array | None, ...]
    tail: mx.array | None  # (rows, H, capacity, D): each row's exact tail first
    rows: Callable[[], SplitRows]
    rereads: bool = False  # a row's write quantized tokens its queries read exact (`Reread`)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Logical (rows, heads, longest row, dim); nothing has this shape in memory."""
        p = self.pool
        if not isinstance(p, QuantizedKV):
            heads, dim = p.shape[2], p.shape[3]
        elif p.per_channel:  # (blocks, heads, dim, packed tokens)
            heads, dim = p.data.shape[1], p.data.shape[2]
        else:  # (blocks, block_size, heads, dim / group_size) scales
            heads, dim = p.scales.shape[2], p.scales.shape[3] * p.group_size
        return (len(self.ends), heads, max(self.ends, default=0), dim)


@dataclass(frozen=True, eq=False)
class PagedKV:
    """Keys or values held in fixed-size blocks, as attention receives them.

    `pool` is the layer's whole block pool, `(blocks, block_size, heads,
    dim)` (a `QuantizedKV` of packed parts, or a raw array). Row `b` of the
    batch holds the tokens at positions `[bases[b], ends[b])`, slot `j` of
    them in block `tables[b, j // block_size]`; nothing is laid out per row.
    Its queries are the last positions before `ends[b]`, and they see the
    keys at or before their own position, within `window` positions when a
    window is set (the mask is derived from positions, never padded).

    `tables` is one read-only int32 array `(rows, width)` (entries past a
    row's blocks are unused): a batch keeps it between steps instead of
    rebuilding it for every layer call. A sequence of row tables is taken
    too (and made into one).
    """

    pool: QuantizedKV | mx.array
    tables: np.ndarray  # (rows, width) block ids per row, oldest first
    bases: tuple[int, ...]  # position of each row's first table slot
    ends: tuple[int, ...]  # tokens each row holds up to (exclusive)
    block_size: int
    window: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tables, np.ndarray):
            width = max((len(t) for t in self.tables), default=0)
            rows = np.zeros((len(self.tables), max(1, width)), dtype=np.int32)
            for i, t in enumerate(self.tables):
                rows[i, : len(t)] = t
            rows.flags.writeable = False
            object.__setattr__(self, "tables", rows)
        object.__setattr__(self, "bases", tuple(self.bases))
        object.__setattr__(self, "ends", tuple(self.ends))

    @property
    def quantized(self) -> bool:
        return isinstance(self.pool, QuantizedKV)

    @property
    def rotated(self) -> bool:
        return self.quantized and self.pool.rotated

    @property
    def rows(self) -> int:
        return self.tables.shape[0]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Logical (rows, heads, longest row, dim); nothing has this shape in memory."""
        _, _, heads, dim = self.pool.shape
        longest = max((e - b for b, e in zip(self.bases, self.ends, strict=True)), default=0)
        return (self.rows, heads, longest, dim)

    def row(self, b: int) -> QuantizedKV | mx.array:
        """Row `b`'s tokens `[bases[b], ends[b])` gathered into `(1, heads, n, dim)`
        (a copy of that row's blocks only)."""
        n = self.ends[b] - self.bases[b]
        ids = mx.array(self.tables[b, : -(-n // self.block_size)])

        def gather(a: mx.array) -> mx.array:
            g = a[ids]
            g = g.reshape(-1, *g.shape[2:])[:n]
            return g.transpose(1, 0, 2)[None]

        if isinstance(self.pool, QuantizedKV):
            return self.pool.map(gather)
        return gather(self.pool)


class Store:
    """A K or V buffer along the token axis (-2), raw or quantized."""

    __slots__ = ("parts", "spec")

    # A sequence of its arrays (data, scales, biases; or the raw array), so
    # that `mx.depends(cache.keys, x)` in model code takes a store and returns
    # the list of its arrays with the dependency (the cache turns that back
    # into a store). An integer index picks an array; slices and other
    # indices act on the tensor (`store[..., :n, :]`, `store[rows]`).
    def __len__(self) -> int:
        return len(self.parts)

    def __iter__(self):
        return iter(self.parts)

    def __init__(self, parts: Sequence[mx.array], spec: QuantSpec):
        self.parts = tuple(parts)
        self.spec = spec

    # -- construction -------------------------------------------------------
    @classmethod
    def encode(cls, x: mx.array, spec: QuantSpec, scales: mx.Dtype | None = None) -> Store:
        """Store `x` (B, H, N, D) under `spec` (raw when `spec.bits` is None,
        or when there is nothing to pack: zero-width tensors), scales and
        biases in `scales` (default: `scale_dtype(x.dtype)`)."""
        if not spec.quantized or x.shape[-1] == 0:
            return cls((x,), QuantSpec(None, spec.group_size))
        sd = scales or scale_dtype(x.dtype)
        if spec.rotation == "hadamard":
            x = rotate(x)
        w, s, b = mx.quantize(x, group_size=spec.group_size, bits=spec.bits)
        return cls((w, s.astype(sd), b.astype(sd)), spec)

    def zeros(self, length: int, batch: int | None = None) -> Store:
        """An all-zero store shaped like this one with `length` tokens."""

        def z(a: mx.array) -> mx.array:
            b = a.shape[0] if batch is None else batch
            return mx.zeros((b, a.shape[1], length, a.shape[-1]), a.dtype)

        return self.map(z)

    @staticmethod
    def concat(stores: Sequence[Store], axis: int = 2) -> Store:
        first = stores[0]
        parts = [
            mx.concatenate([s.parts[i].astype(a.dtype) for s in stores], axis=axis)
            for i, a in enumerate(first.parts)
        ]
        return Store(parts, first.spec)

    # -- structure ----------------------------------------------------------
    def map(self, fn: Callable[[mx.array], mx.array]) -> Store:
        return Store([fn(a) for a in self.parts], self.spec)

    def __getitem__(self, idx):
        if type(idx) is int:
            return self.parts[idx]
        return self.map(lambda a: a[idx])

    def __setitem__(self, idx, other: Store) -> None:
        for a, o in zip(self.parts, other.parts, strict=True):
            a[idx] = o

    @property
    def quantized(self) -> bool:
        return len(self.parts) == 3

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Logical shape (B, H, tokens, dim)."""
        a = self.parts[0]
        dim = a.shape[-1] * 32 // self.spec.bits if self.quantized else a.shape[-1]
        return (a.shape[0], a.shape[1], a.shape[2], dim)

    @property
    def length(self) -> int:
        return self.parts[0].shape[2]

    @property
    def dtype(self) -> mx.Dtype:
        return self.parts[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.parts)

    # -- conversion ---------------------------------------------------------
    def quantize(self, spec: QuantSpec) -> Store:
        """Convert a raw store to `spec` (used when `quantized_kv_start` is reached)."""
        if self.quantized or not spec.quantized:
            return self
        return Store.encode(self.parts[0], spec)

    def fetch(self) -> mx.array | QuantizedKV:
        """What attention receives: the raw array, or a `QuantizedKV`."""
        if not self.quantized:
            return self.parts[0]
        spec = self.spec
        return QuantizedKV(*self.parts, spec.bits, spec.group_size, spec.rotation == "hadamard")

    def dequantize(self, dtype: mx.Dtype | None = None) -> mx.array:
        """Full-precision array in the original basis."""
        if not self.quantized:
            return self.parts[0] if dtype is None else self.parts[0].astype(dtype)
        return self.fetch().dequantize(dtype or self.parts[1].dtype)

    # -- serialization ------------------------------------------------------
    def to_state(self) -> list:
        """Three array slots (raw uses the first), for mlx-lm's prompt files."""
        return list(self.parts) + [None] * (3 - len(self.parts))

    @classmethod
    def from_state(cls, parts: Sequence, spec: QuantSpec) -> Store | None:
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        if len(parts) == 1:
            spec = QuantSpec(None, spec.group_size)
        return cls(parts, spec)


def dynamic_roll(x: mx.array, shifts: mx.array, axis: int) -> mx.array:
    """Roll each batch row of `x` along `axis` by its own shift."""
    n = x.shape[axis]
    expand_shifts = (...,) + (None,) * (x.ndim - axis)
    idx = (mx.arange(n)[expand_shifts[:-1]] - shifts[expand_shifts]) % n
    return mx.take_along_axis(x, idx, axis=axis)

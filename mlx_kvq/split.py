"""The split layout: keys and values as exact sinks, a quantized body and an exact tail.

Real models' keys carry a few channels of large magnitude, fixed across
tokens, and their attention leans on the first tokens (attention sinks) and
on the newest. A `SplitStore` holds one cache's keys and values, in token
order, as

- the head: the first `sinks` tokens, unquantized;
- the body: quantized. Values per token (groups of channels, as mlx-lm);
  keys per token too, or per channel (`QuantSpec.per_channel`, KIVI): each
  channel gets its own scale and bias per group of `group_size` tokens,
  stored channel-major ((B, H, D, N) packed along the tokens), so MLX's own
  quantization gives the scales and `mx.quantized_matmul` multiplies them;
- the tail: the newest tokens, unquantized: at least `residual` of them,
  and the tokens of a per-channel group not yet complete (fewer than
  `residual + group_size` in all). Tokens move from the tail to the body a
  whole group at a time, as newer ones arrive.

Unquantized tokens are held in 16 bits, like the scales (`scale_dtype`):
bfloat16 for bfloat16 models, float16 otherwise; exact for half-precision
models, a rounding far below the quantization step for float32 ones. Their
bytes count in `nbytes` like every other part.

Bounded caches (windows, chunked attention) drop whole units of the body from
the front once no query can see them (`drop_before`): the body is never cut
inside a group.
"""

from __future__ import annotations

import copy

import mlx.core as mx

from .config import QuantSpec
from .quant import QuantizedKV, Reread, SplitKV, Store, rotate, scale_dtype

GROW = 128  # tokens of body capacity added at a time: a multiple of every group
# size, so a body of whole 128-token groups wastes nothing (mlx-lm's caches grow by 256)


class _Copyable:
    """Deep copies share `mx.Dtype` values (immutable, and neither copyable
    nor picklable); everything else is copied (mlx-lm's batch and prompt
    cache copy caches with `copy.deepcopy`)."""

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            setattr(new, name, value if isinstance(value, mx.Dtype) else copy.deepcopy(value, memo))
        return new


def _cat(a: mx.array | None, b: mx.array, axis: int = 2) -> mx.array:
    return b if a is None else mx.concatenate([a, b], axis=axis)


def _length(a: mx.array | None) -> int:
    return 0 if a is None else a.shape[2]


def least_trim(limits) -> int | None:
    """The least of some `exact_trim` limits (None: no limit)."""
    known = [n for n in limits if n is not None]
    return min(known) if known else None


class TokenBody(_Copyable):
    """Token-major body (B, H, N, D): a `Store` (quantized per token, or raw)."""

    def __init__(self, spec: QuantSpec, grow: int | None):
        self.spec = spec
        self.grow = grow
        self.store: Store | None = None
        self.length = 0

    def append(self, x: mx.array) -> None:
        """Write `x` (B, H, n, D, 16-bit) after the held tokens."""
        if self.spec.quantized:
            s = Store.encode(x.astype(mx.float32), self.spec, scale_dtype(x.dtype))
        else:
            s = Store.encode(x, self.spec)
        n = x.shape[2]
        if self.grow is None:
            held = None if self.store is None else self.store[..., : self.length, :]
            self.store = s if held is None else Store.concat([held, s])
        else:
            if self.store is None or self.length + n > self.store.length:
                room = -(-(self.length + n) // self.grow) * self.grow
                held = [] if self.store is None else [self.store[..., : self.length, :]]
                self.store = Store.concat([*held, s.zeros(room - self.length)])
            self.store[..., self.length : self.length + n, :] = s
        self.length += n

    def view(self, start: int = 0, stop: int | None = None):
        stop = self.length if stop is None else stop
        return self.store[..., start:stop, :].fetch()

    def drop_front(self, n: int) -> None:
        self.store = self.store[..., n : self.length, :].map(mx.contiguous)
        self.length -= n

    def pop_back(self, n: int, dtype: mx.Dtype) -> mx.array:
        """The last `n` tokens, dequantized to `dtype`, removed."""
        out = self.store[..., self.length - n : self.length, :].dequantize(mx.float32)
        self.length -= n
        return out.astype(dtype)

    def keep_rows(self, rows) -> None:
        self.store = self.store[rows]

    @property
    def nbytes(self) -> int:
        return 0 if self.store is None else self.store.nbytes

    def parts(self) -> list:
        return [] if self.store is None else list(self.store[..., : self.length, :].parts)

    def set_parts(self, parts: list, length: int) -> None:
        self.store = Store.from_state(parts, self.spec)
        self.length = length


class ChannelBody(_Copyable):
    """Channel-major key body: (B, H, D, N) packed along the tokens, a scale
    and a bias per channel for each `group_size` tokens."""

    def __init__(self, spec: QuantSpec, grow: int | None):
        self.spec = spec
        self.grow = grow
        self.parts_: list[mx.array] | None = None  # data, scales, biases
        self.length = 0
        self.capacity = 0

    def _widths(self, tokens: int) -> tuple[int, int]:
        return tokens * self.spec.bits // 32, tokens // self.spec.group_size

    def append(self, x: mx.array) -> None:
        """Write `x` (B, H, n, D, 16-bit; n a multiple of the group size)."""
        spec = self.spec
        n = x.shape[2]
        sd = scale_dtype(x.dtype)
        x = x.astype(mx.float32)
        if spec.rotation == "hadamard":
            x = rotate(x)
        w, s, b = mx.quantize(x.swapaxes(-1, -2), group_size=spec.group_size, bits=spec.bits)
        new = [w, s.astype(sd), b.astype(sd)]
        if self.grow is None:
            if self.parts_ is None:
                self.parts_ = new
            else:
                held = self._held()
                self.parts_ = [
                    mx.concatenate([a, c], axis=-1) for a, c in zip(held, new, strict=True)
                ]
            self.capacity = self.length + n
        else:
            if self.parts_ is None or self.length + n > self.capacity:
                room = -(-(self.length + n) // self.grow) * self.grow
                wr, gr = self._widths(room)
                held = [] if self.parts_ is None else self._held()
                parts = []
                for i, a in enumerate(new):
                    width = wr if i == 0 else gr
                    used = 0 if not held else held[i].shape[-1]
                    pad = mx.zeros((*a.shape[:-1], width - used), a.dtype)
                    parts.append(pad if not held else mx.concatenate([held[i], pad], axis=-1))
                self.parts_ = parts
                self.capacity = room
            w0, g0 = self._widths(self.length)
            w1, g1 = self._widths(self.length + n)
            self.parts_[0][..., w0:w1] = new[0]
            self.parts_[1][..., g0:g1] = new[1]
            self.parts_[2][..., g0:g1] = new[2]
        self.length += n

    def _held(self) -> list[mx.array]:
        w, g = self._widths(self.length)
        d, s, b = self.parts_
        return [d[..., :w], s[..., :g], b[..., :g]]

    def view(self, start: int = 0, stop: int | None = None) -> QuantizedKV:
        stop = self.length if stop is None else stop
        spec = self.spec
        q = QuantizedKV(*self._held(), spec.bits, spec.group_size,
                        spec.rotation == "hadamard", True)  # fmt: skip
        return q if (start, stop) == (0, self.length) else q.tokens(start, stop)

    def drop_front(self, n: int) -> None:
        w, g = self._widths(n)
        d, s, b = self._held()
        self.parts_ = [mx.contiguous(d[..., w:]), mx.contiguous(s[..., g:]),
                       mx.contiguous(b[..., g:])]  # fmt: skip
        self.length -= n
        self.capacity = self.length

    def pop_back(self, n: int, dtype: mx.Dtype) -> mx.array:
        out = self.view(self.length - n, self.length).dequantize(mx.float32)
        self.length -= n
        return out.astype(dtype)

    def keep_rows(self, rows) -> None:
        self.parts_ = [a[rows] for a in self.parts_]

    @property
    def nbytes(self) -> int:
        return 0 if self.parts_ is None else sum(a.nbytes for a in self.parts_)

    def parts(self) -> list:
        return [] if self.parts_ is None else self._held()

    def set_parts(self, parts: list, length: int) -> None:
        parts = [p for p in parts if p is not None]
        self.parts_ = parts or None
        self.length = length if parts else 0
        self.capacity = self.length


def make_body(spec: QuantSpec, grow: int | None):
    return ChannelBody(spec, grow) if spec.per_channel else TokenBody(spec, grow)


class SplitStore(_Copyable):
    """One cache's keys and values in the split layout (see the module docstring).

    Rows (the leading batch axis) share one split: they hold the same number
    of tokens. `grow` is the body's capacity step in tokens (None: exactly
    what it holds, for bounded caches that drop their oldest tokens).
    `raw_until`: until that many tokens arrived everything stays in the tail
    in the model's dtype (`--quantized-kv-start`), then the split is made.
    """

    def __init__(
        self, key_spec: QuantSpec, value_spec: QuantSpec, grow: int | None = GROW,
        raw_until: int = 0, sinks: int | None = None,
    ):  # fmt: skip
        self.key_spec = key_spec
        self.value_spec = value_spec
        self.sinks = key_spec.sinks if sinks is None else sinks
        self.residual = max(key_spec.residual, value_spec.residual)
        self.unit = max(key_spec.flush_unit, value_spec.flush_unit)
        self.grow = grow
        self.raw_until = raw_until
        self.raw = raw_until > 0
        self.head_k = self.head_v = self.tail_k = self.tail_v = None
        self.body_k = make_body(key_spec, grow)
        self.body_v = make_body(value_spec, grow)
        self.dropped = 0  # tokens dropped from the front of the body
        self.dtype: mx.Dtype | None = None  # the model's K/V dtype

    # -- shape ----------------------------------------------------------------
    @property
    def head_len(self) -> int:
        return _length(self.head_k)

    @property
    def tail_len(self) -> int:
        return _length(self.tail_k)

    @property
    def body_len(self) -> int:
        return self.body_k.length

    @property
    def offset(self) -> int:
        """Tokens written so far (dropped ones included)."""
        return self.head_len + self.dropped + self.body_len + self.tail_len

    @property
    def held(self) -> int:
        return self.head_len + self.body_len + self.tail_len

    @property
    def first(self) -> int:
        """Position of the first held token after the head."""
        return self.head_len + self.dropped

    @property
    def split_made(self) -> bool:
        """Past `raw_until`: the tail's oldest tokens are quantized as they age."""
        return not self.raw

    @property
    def exact_dtype(self) -> mx.Dtype:
        return scale_dtype(self.dtype or mx.float16)

    # -- writing --------------------------------------------------------------
    def append(self, keys: mx.array, values: mx.array, limit: int | None = None) -> Reread | None:
        """Write `keys`/`values` (B, H, n, D) after the held tokens; tokens at
        or past position `limit` (a right-padded prompt's padding) are never
        quantized (they are trimmed before anything else is written).
        Returns, when the write quantized tokens and has several queries, the
        exact tokens they read (`Reread`: the queries then read what a
        token-by-token decode would have)."""
        if self.dtype is None:
            self.dtype = keys.dtype
        n = keys.shape[2]
        if not self.raw:
            keys, values = keys.astype(self.exact_dtype), values.astype(self.exact_dtype)
        if self.head_len < self.sinks and self.body_len == self.tail_len == self.dropped == 0:
            take = min(self.sinks - self.head_len, keys.shape[2])
            self.head_k = mx.contiguous(_cat(self.head_k, keys[..., :take, :]))
            self.head_v = mx.contiguous(_cat(self.head_v, values[..., :take, :]))
            keys, values = keys[..., take:, :], values[..., take:, :]
        if keys.shape[2]:
            self.tail_k, self.tail_v = _cat(self.tail_k, keys), _cat(self.tail_v, values)
        if self.raw and self.offset >= self.raw_until:
            # `--quantized-kv-start` reached: from now on in the split layout
            self.raw = False
            dt = self.exact_dtype
            for name in ("head_k", "head_v", "tail_k", "tail_v"):
                a = getattr(self, name)
                if a is not None:
                    setattr(self, name, a.astype(dt))
        if self.raw:
            return None
        start, before = self.offset - self.tail_len, (self.tail_k, self.tail_v)
        self.flush(limit)
        stop = self.offset - self.tail_len
        if stop == start or n < 2:
            return None
        return Reread(*before, start, stop, self.residual, self.unit)

    def flush(self, limit: int | None = None) -> None:
        """Move whole units from the tail to the body while more than
        `residual` tokens (before `limit`) would stay."""
        avail = self.tail_len - self.residual
        if limit is not None:
            avail = min(avail, limit - (self.offset - self.tail_len) - self.residual)
        m = max(0, avail) // self.unit * self.unit
        if m == 0:
            return
        self.body_k.append(self.tail_k[..., :m, :])
        self.body_v.append(self.tail_v[..., :m, :])
        # copies: a view would keep the whole prompt chunk alive
        if self.tail_len > m:
            self.tail_k = mx.contiguous(self.tail_k[..., m:, :])
            self.tail_v = mx.contiguous(self.tail_v[..., m:, :])
        else:
            self.tail_k = self.tail_v = None

    def droppable(self, position: int) -> int:
        """Tokens `drop_before(position)` would drop: whole body units (before
        the split is made, tail tokens) that hold only positions before
        `position`; the head stays."""
        if self.raw:
            return min(max(0, position - self.first), self.tail_len)
        return min(max(0, position - self.first), self.body_len) // self.unit * self.unit

    def drop_before(self, position: int) -> None:
        n = self.droppable(position)
        if not n:
            return
        if self.raw and n == self.tail_len:
            self.tail_k = self.tail_v = None
        elif self.raw:
            self.tail_k = mx.contiguous(self.tail_k[..., n:, :])
            self.tail_v = mx.contiguous(self.tail_v[..., n:, :])
        else:
            self.body_k.drop_front(n)
            self.body_v.drop_front(n)
        self.dropped += n

    def trim(self, n: int) -> int:
        """Forget the last `n` held tokens (a body unit cut into comes back to
        the tail dequantized)."""
        n = min(n, self.held)
        left = n
        t = min(left, self.tail_len)
        if t:
            keep = self.tail_len - t
            self.tail_k = self.tail_k[..., :keep, :] if keep else None
            self.tail_v = self.tail_v[..., :keep, :] if keep else None
            left -= t
        if left and self.body_len:
            m = min(self.body_len, -(-left // self.unit) * self.unit)
            dt = self.exact_dtype
            k, v = self.body_k.pop_back(m, dt), self.body_v.pop_back(m, dt)
            keep = m - min(left, m)
            self.tail_k = k[..., :keep, :] if keep else None
            self.tail_v = v[..., :keep, :] if keep else None
            left -= m - keep
        if left:
            keep = self.head_len - left
            self.head_k = self.head_k[..., :keep, :] if keep else None
            self.head_v = self.head_v[..., :keep, :] if keep else None
        return n

    def exact_trim(self) -> int | None:
        """The most tokens `trim` takes back leaving what a decode to the
        shorter length holds: the exact tokens past the last `residual` (a
        trim into the body brings tokens back dequantized, where a decode
        would hold them exact); None while nothing is quantized."""
        if self.raw or self.body_len == 0:
            return None
        return max(0, self.tail_len - self.residual)

    def keep_rows(self, rows) -> None:
        """Only the batch rows `rows` (indices) stay."""
        for name in ("head_k", "head_v", "tail_k", "tail_v"):
            a = getattr(self, name)
            if a is not None:
                setattr(self, name, a[rows])
        if self.body_len:
            self.body_k.keep_rows(rows)
            self.body_v.keep_rows(rows)

    # -- reading --------------------------------------------------------------
    def fetch(self) -> tuple[SplitKV, SplitKV]:
        """(keys, values) as attention receives them."""
        bk = self.body_k.view() if self.body_len else None
        bv = self.body_v.view() if self.body_len else None
        return SplitKV(self.head_k, bk, self.tail_k), SplitKV(self.head_v, bv, self.tail_v)

    def dequantize(self, dtype: mx.Dtype | None = None) -> tuple[mx.array, mx.array]:
        """Every held token as plain (B, H, n, D) arrays of `dtype` (default:
        the model's)."""
        k, v = self.fetch()
        dtype = dtype or self.dtype
        return k.dequantize(dtype), v.dequantize(dtype)

    @property
    def nbytes(self) -> int:
        raw = sum(
            a.nbytes for a in (self.head_k, self.head_v, self.tail_k, self.tail_v) if a is not None
        )
        return raw + self.body_k.nbytes + self.body_v.nbytes

    @property
    def quantized(self) -> bool:
        return self.split_made

    # -- prompt files ---------------------------------------------------------
    def to_state(self) -> list:
        """Arrays (None for an absent part) and counts, for mlx-lm's prompt files."""
        body_k = self.body_k.parts() if self.body_len else []
        body_v = self.body_v.parts() if self.body_len else []
        pad = lambda ps: ps + [None] * (3 - len(ps))  # noqa: E731
        return [
            self.head_k, self.head_v, *pad(body_k), *pad(body_v), self.tail_k, self.tail_v,
            self.body_len, self.dropped, int(self.raw),
        ]  # fmt: skip

    def set_state(self, state: list) -> None:
        hk, hv, bk0, bk1, bk2, bv0, bv1, bv2, tk, tv, body_len, dropped, raw = state
        self.head_k, self.head_v, self.tail_k, self.tail_v = hk, hv, tk, tv
        self.body_k = make_body(self.key_spec, self.grow)
        self.body_v = make_body(self.value_spec, self.grow)
        if int(body_len):
            self.body_k.set_parts([bk0, bk1, bk2], int(body_len))
            self.body_v.set_parts([bv0, bv1, bv2], int(body_len))
        self.dropped, self.raw = int(dropped), bool(int(raw))
        if _length(hk) != _length(hv) or _length(tk) != _length(tv) or self.dropped < 0:
            raise ValueError("split store state is inconsistent: keys and values differ in length")

"""Exact references for deepseek_v41's quantized `LayerCache` fields.

Both subclass mlx-lm's own `LayerCache`, so the model runs its own cache code:

- `RoundTripLayerCache` holds each planned field's new rows quantized and
  dequantized as they are written (mx.quantize, 16-bit scales, the Hadamard
  rotation undone): what attending over a quantized field must equal;
- `TwinLayerCache` holds the exact rows the model attends over, hands the
  same writes to a `KVQDeepseekV41Cache` and records, per field, its worst error
  as a fraction of the quantization bound.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx_lm.models.deepseek_v41 import LayerCache

from mlx_kvq.caches import KVQDeepseekV41Cache
from mlx_kvq.config import QuantSpec
from mlx_kvq.quant import scale_dtype

FIELDS = ("window", "compress_kv", "index_k")


def _hadamard(x: mx.array) -> mx.array:
    return mx.hadamard_transform(x, scale=1 / math.sqrt(x.shape[-1]))


def round_trip(x: mx.array, spec: QuantSpec) -> mx.array:
    """`x` quantized under `spec` and dequantized, in its own dtype and basis."""
    rotated = spec.rotation == "hadamard"
    y = _hadamard(x) if rotated else x
    w, s, b = mx.quantize(y, group_size=spec.group_size, bits=spec.bits)
    sd = scale_dtype(x.dtype)
    y = mx.dequantize(
        w, s.astype(sd).astype(x.dtype), b.astype(sd).astype(x.dtype),
        group_size=spec.group_size, bits=spec.bits,
    )  # fmt: skip
    return _hadamard(y) if rotated else y


def bound_fraction(got: mx.array, exact: mx.array, spec: QuantSpec) -> float:
    """The largest |got - exact| over the bound of affine quantization, per
    group of the stored (rotated) basis: one step (mx.quantize moves the
    scale so that the edge of larger magnitude is a whole number of steps;
    the other edge may then clip by up to a step) plus the 16-bit rounding
    of the scale and the bias (2^-11 of the range and of the edge)."""
    if spec.rotation == "hadamard":
        got, exact = _hadamard(got), _hadamard(exact)
    g = exact.reshape(*exact.shape[:-1], -1, spec.group_size)
    lo, hi = g.min(axis=-1, keepdims=True), g.max(axis=-1, keepdims=True)
    span = hi - lo
    bound = span / (2**spec.bits - 1) + (span + mx.maximum(-lo, hi)) * 2.0**-11 + 1e-7
    err = mx.abs(got.reshape(g.shape) - g)
    return float((err / bound).max())


class RoundTripLayerCache(LayerCache):
    """mlx-lm's `LayerCache` whose fields in `specs` keep their rows as
    quantized-then-dequantized at write time (the rows a field already holds
    stay as they were: they are the rows the model read). `error_scale`
    scales the quantization error (a sensitivity probe: 1 is the round trip)."""

    def __init__(self, window_size: int, specs: dict[str, QuantSpec], error_scale: float = 1.0):
        self._specs = specs
        self._error_scale = error_scale
        self._rows: dict[str, mx.array | None] = {}
        super().__init__(window_size)

    def _store(self, name: str, value: mx.array | None) -> None:
        spec = None if name == "window" else self._specs.get(name)  # see update_window
        held = self._rows.get(name)
        n = 0 if held is None else held.shape[1]
        if spec is not None and value is not None and value.shape[1] > n:
            new = self._round_trip(value[:, n:], spec)
            value = new if held is None else mx.concatenate([held, new], axis=1)
        self._rows[name] = value

    def update_window(self, kv: mx.array) -> mx.array:
        spec = self._specs.get("window")
        return super().update_window(kv if spec is None else self._round_trip(kv, spec))

    def _round_trip(self, x: mx.array, spec: QuantSpec) -> mx.array:
        y = round_trip(x, spec)
        return y if self._error_scale == 1 else x + self._error_scale * (y - x)


class TwinLayerCache(LayerCache):
    """mlx-lm's `LayerCache` (exact rows) that hands every write to `twin` too
    and keeps, per field, the worst `bound_fraction` of the twin's rows
    (`worst`); the window the twin returns from `update_window` counts as
    its window rows."""

    def __init__(self, twin: KVQDeepseekV41Cache):
        self.twin = twin
        self._rows: dict[str, mx.array | None] = {}
        self.worst = dict.fromkeys(twin.leaves, 0.0)
        super().__init__(twin.window_size)

    def _compare(self, name: str, got: mx.array, exact: mx.array) -> None:
        assert got.shape == exact.shape, (name, got.shape, exact.shape)
        spec = self.twin.leaves[name].key_spec
        self.worst[name] = max(self.worst[name], bound_fraction(got, exact, spec))

    def _store(self, name: str, value: mx.array | None) -> None:
        self._rows[name] = value
        if name != "window" and name in self.twin.leaves and value is not None:
            setattr(self.twin, name, value)
            self._compare(name, getattr(self.twin, name), value)

    def update_window(self, kv: mx.array) -> mx.array:
        self._compare("window", self.twin.update_window(kv), (out := super().update_window(kv)))
        self._compare("window", self.twin.window, self.window)
        assert self.twin.offset == self.offset
        return out


def _field(name: str) -> property:
    return property(lambda self: self._rows.get(name), lambda self, v: self._store(name, v))


for _name in FIELDS:
    setattr(RoundTripLayerCache, _name, _field(_name))
    setattr(TwinLayerCache, _name, _field(_name))


def forced_logits(model, cache: list, tokens: mx.array, chunks: tuple[int, ...]) -> mx.array:
    """Teacher-forced last-position logits (float32): the prompt in `chunks`,
    then the rest of `tokens` one at a time; one row per call."""
    out, start = [], 0
    for n in chunks:
        out.append(model(tokens[None, start : start + n], cache=cache)[0, -1])
        start += n
    for i in range(start, tokens.shape[0]):
        out.append(model(tokens[None, i : i + 1], cache=cache)[0, -1])
    return mx.stack(out).astype(mx.float32)

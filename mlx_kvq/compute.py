"""How a loaded model computes on MLX's CPU backend, where only float32
products run on the BLAS.

Two choices, made by the commands when they load a model (never by an
import, and only on the CPU backend):

- **float32 for half-precision weights.** MLX's float16 and bfloat16 products
  skip the BLAS on the CPU and run about 20x slower than float32
  (docs/performance.md); `--dtype auto` (the default) computes in float32
  there, and says so; `--dtype float16` / `bfloat16` keep the weights' dtype.
- **batches through the BLAS for quantized weights.** MLX's CPU quantized
  product is fast for one row (decode) and slow for many (prefill: 10x slower
  than float32 at 256 rows); a quantized linear layer given at least
  `DENSE_ROWS` rows multiplies them by its dequantized weight instead. The
  weights stay packed in memory; each batch dequantizes one layer at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

DTYPES = ("auto", "float32", "float16", "bfloat16")
DENSE_ROWS = 32  # rows from which dequantize + BLAS beats MLX's CPU quantized product
VOCAB_CHUNK = 32768  # vocabulary rows of a tied output layer dequantized at once
_HALF = (mx.float16, mx.bfloat16)


class BatchDenseQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` that multiplies `DENSE_ROWS` rows or more by its
    dequantized weight (the BLAS on the CPU) and fewer with the packed product."""

    def __call__(self, x: mx.array) -> mx.array:
        if math.prod(x.shape[:-1]) < DENSE_ROWS or self.mode != "affine":
            return super().__call__(x)
        biases = self.get("biases")
        weight = mx.dequantize(
            self["weight"],
            self["scales"].astype(x.dtype),
            None if biases is None else biases.astype(x.dtype),
            group_size=self.group_size,
            bits=self.bits,
        )
        y = x @ weight.T
        return y + self["bias"] if "bias" in self else y


class BatchDenseQuantizedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose `as_linear` (a tied output layer) takes
    `DENSE_ROWS` rows or more through the BLAS, `VOCAB_CHUNK` vocabulary rows
    dequantized at a time (a 262,144-token vocabulary in float32 is 0.7 GB)."""

    def as_linear(self, x: mx.array) -> mx.array:
        if math.prod(x.shape[:-1]) < DENSE_ROWS or self.mode != "affine":
            return super().as_linear(x)
        biases = self.get("biases")
        parts = []
        for start in range(0, self["weight"].shape[0], VOCAB_CHUNK):
            rows = slice(start, start + VOCAB_CHUNK)
            weight = mx.dequantize(
                self["weight"][rows],
                self["scales"][rows].astype(x.dtype),
                None if biases is None else biases[rows].astype(x.dtype),
                group_size=self.group_size,
                bits=self.bits,
            )
            parts.append(x @ weight.T)
        return mx.concatenate(parts, axis=-1)


@dataclass(frozen=True)
class CpuCompute:
    """What `prepare` did to a model: the dtype it cast from (None: none),
    and how many quantized linear layers take batches through the BLAS."""

    cast_from: str | None
    dense_batch_layers: int

    def line(self) -> str | None:
        """One line for the startup log (None when nothing changed)."""
        parts = []
        if self.cast_from is not None:
            parts.append(
                f"computing in float32 (weights were {self.cast_from}: MLX's half-precision "
                "products skip the BLAS on the CPU, about 20x slower; --dtype "
                f"{self.cast_from} keeps them)"
            )
        if self.dense_batch_layers:
            parts.append(
                f"{self.dense_batch_layers} quantized layers multiply batches of "
                f">= {DENSE_ROWS} rows by their dequantized weights on the BLAS (weights stay packed)"
            )
        return "CPU backend: " + "; ".join(parts) if parts else None


_BATCH_DENSE = {
    nn.QuantizedLinear: BatchDenseQuantizedLinear,
    nn.QuantizedEmbedding: BatchDenseQuantizedEmbedding,
}


def _half_dtype(model: nn.Module) -> mx.Dtype | None:
    for _, p in nn.utils.tree_flatten(model.parameters()):
        if p.dtype in _HALF:
            return p.dtype
    return None


def prepare(model: nn.Module, dtype: str = "auto") -> CpuCompute:
    """Set up `model` for the CPU backend as `dtype` asks (a no-op elsewhere,
    except that an explicit dtype is applied on every backend)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    on_cpu = mx.default_device() == mx.cpu
    cast_from = None
    if dtype == "auto":
        half = _half_dtype(model) if on_cpu else None
        if half is not None:
            model.set_dtype(mx.float32)
            cast_from = str(half).rsplit(".", 1)[-1]
    else:
        model.set_dtype(getattr(mx, dtype))
    layers = 0
    if on_cpu:
        for _, module in model.named_modules():
            swap = _BATCH_DENSE.get(type(module))
            if swap is not None and module.mode == "affine":
                module.__class__ = swap
                layers += 1
    return CpuCompute(cast_from, layers)

"""How a loaded model computes on MLX's CPU backend, where only float32
products run on the BLAS.

Two choices, made by the commands when they load a model (never by an
import, and only on the CPU backend):

- **float32 for half-precision weights.** MLX's float16 and bfloat16 products
  skip the BLAS on the CPU and run about 20x slower than float32
  (docs/performance.md); `--dtype auto` (the default) computes in float32
  there, and says so; `--dtype float16` / `bfloat16` keep the weights' dtype.
- **prompts through the BLAS for quantized weights.** MLX's CPU quantized
  product is fast for one row (decode) and slow for many (prefill: 10x slower
  than float32 at 256 rows); a quantized linear layer given a prompt chunk
  (two positions or more a sequence) multiplies it by its dequantized weight
  instead, and a decode step (one position a sequence) keeps the packed
  product whatever the batch size. The two give a row different roundings,
  so the choice follows the sequence, never the rows beside it: a prompt's
  result does not depend on the batch or on where its chunks end. The
  weights stay packed in memory; each chunk dequantizes one layer at a time.
- **products of at least `MIN_BLAS_ROWS` rows.** OpenBLAS multiplies a small
  matrix with other kernels than a large one (GEMV for one row, its
  small-matrix kernels for a few), which round differently: a token's K/V in
  a 5-token chunk differed in the last bits from the same token's in a
  400-token chunk on SmolLM2, and a quantized cache can turn such a bit into
  another level. Every linear layer's product through the BLAS gets zero
  rows added up to `MIN_BLAS_ROWS`, and to `MIN_BLAS_OUTPUTS` output elements
  (SkylakeX's small kernels took products of up to 1,200), so a row's result
  does not depend on how many rows share its product (float weights' decode
  steps included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

DTYPES = ("auto", "float32", "float16", "bfloat16")
DENSE_ROWS = 32  # rows of a 2-D input from which dequantize + BLAS beats the packed product
MIN_BLAS_ROWS = 16  # every product through the BLAS has at least this many rows
MIN_BLAS_OUTPUTS = 4096  # ... and at least this many output elements
VOCAB_CHUNK = 32768  # vocabulary rows of a tied output layer dequantized at once
_HALF = (mx.float16, mx.bfloat16)


def through_blas(x: mx.array) -> bool:
    """Whether a quantized product takes `x` by the dequantized weight: a
    prompt chunk `(B, L, D)` with `L >= 2` does, a decode step (`L == 1`)
    does not, whatever `B` (see the module docstring); a 2-D input of
    `DENSE_ROWS` rows or more does."""
    if x.ndim >= 3:
        return x.shape[-2] >= 2
    return math.prod(x.shape[:-1]) >= DENSE_ROWS


def stable_rows(x: mx.array, multiply, outputs: int) -> mx.array:
    """`multiply(x)` for a product `x @ W` of `outputs` columns through the
    BLAS, `x`'s rows made up by zero rows to the least that takes the large
    kernels (see the module docstring)."""
    rows = math.prod(x.shape[:-1])
    least = max(MIN_BLAS_ROWS, -(-MIN_BLAS_OUTPUTS // max(1, outputs)))
    if rows >= least:
        return multiply(x)
    flat = x.reshape(rows, x.shape[-1])
    pad = mx.zeros((least - rows, x.shape[-1]), x.dtype)
    y = multiply(mx.concatenate([flat, pad]))[:rows]
    return y.reshape(*x.shape[:-1], y.shape[-1])


class RowStableLinear(nn.Linear):
    """`nn.Linear` whose product has at least `MIN_BLAS_ROWS` rows."""

    def __call__(self, x: mx.array) -> mx.array:
        return stable_rows(x, super().__call__, self.weight.shape[0])


class RowStableEmbedding(nn.Embedding):
    """`nn.Embedding` whose `as_linear` (a tied output layer) has at least
    `MIN_BLAS_ROWS` rows."""

    def as_linear(self, x: mx.array) -> mx.array:
        return stable_rows(x, super().as_linear, self.weight.shape[0])


class BatchDenseQuantizedLinear(nn.QuantizedLinear):
    """`nn.QuantizedLinear` that multiplies prompt chunks by its dequantized
    weight (the BLAS on the CPU) and decode steps with the packed product
    (`through_blas`)."""

    def __call__(self, x: mx.array) -> mx.array:
        if not through_blas(x) or self.mode != "affine":
            return super().__call__(x)
        biases = self.get("biases")
        weight = mx.dequantize(
            self["weight"],
            self["scales"].astype(x.dtype),
            None if biases is None else biases.astype(x.dtype),
            group_size=self.group_size,
            bits=self.bits,
        )
        y = stable_rows(x, lambda a: a @ weight.T, weight.shape[0])
        return y + self["bias"] if "bias" in self else y


class BatchDenseQuantizedEmbedding(nn.QuantizedEmbedding):
    """`nn.QuantizedEmbedding` whose `as_linear` (a tied output layer) takes
    prompt chunks through the BLAS (`through_blas`), `VOCAB_CHUNK` vocabulary
    rows dequantized at a time (a 262,144-token vocabulary in float32 is 0.7 GB)."""

    def as_linear(self, x: mx.array) -> mx.array:
        if not through_blas(x) or self.mode != "affine":
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
            parts.append(stable_rows(x, lambda a, w=weight: a @ w.T, weight.shape[0]))
        return mx.concatenate(parts, axis=-1)


@dataclass(frozen=True)
class CpuCompute:
    """What `prepare` did to a model: the dtype it cast from (None: none),
    and how many quantized linear layers take batches through the BLAS."""

    cast_from: str | None
    dense_batch_layers: int
    row_stable_layers: int = 0

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
                f"{self.dense_batch_layers} quantized layers multiply prompt chunks by their "
                "dequantized weights on the BLAS (weights stay packed)"
            )
        if self.row_stable_layers:
            parts.append(
                f"{self.row_stable_layers} float layers multiply at least {MIN_BLAS_ROWS} rows "
                "at a time on the BLAS (one kernel whatever the batch)"
            )
        return "CPU backend: " + "; ".join(parts) if parts else None


_BATCH_DENSE = {
    nn.QuantizedLinear: BatchDenseQuantizedLinear,
    nn.QuantizedEmbedding: BatchDenseQuantizedEmbedding,
}
_ROW_STABLE = {nn.Linear: RowStableLinear, nn.Embedding: RowStableEmbedding}


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
    layers = stable = 0
    if on_cpu:
        for _, module in model.named_modules():
            swap = _BATCH_DENSE.get(type(module))
            if swap is not None and module.mode == "affine":
                module.__class__ = swap
                layers += 1
            elif type(module) in _ROW_STABLE:
                module.__class__ = _ROW_STABLE[type(module)]
                stable += 1
    return CpuCompute(cast_from, layers, stable)

"""Attention over quantized K/V, and the single redirect of mlx-lm's attention.

`scaled_dot_product_attention` has mlx-lm's signature and dispatches on what
the keys and values *are*, not on the cache object: packed `QuantizedKV`
goes to `quantized_attention`, arrays go to `mx.fast`. That is what makes
KV-shared layers work (gemma4_text calls attention with `cache=None` but
hands over the owner layer's packed K/V) and attention sinks work (gpt-oss).

Compute precision is a per-backend choice: on the CPU backend
`mx.quantized_matmul` in float16/bfloat16 is many times slower than in
float32, so queries are cast up there; on Metal the native-dtype kernels are
fast, so the model's dtype is kept (assumed from MLX's kernels; not measured
here, since Metal cannot run on this project's machines).
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import sys
from collections import Counter
from collections.abc import Iterator

import mlx.core as mx
import mlx_lm.models
import mlx_lm.models.base as mlx_base

from .quant import QuantizedKV, rotate

_ORIGINAL = mlx_base.scaled_dot_product_attention
_QUERY_BLOCK = 512


def compute_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """The dtype quantized attention computes in on the current backend."""
    if mx.default_device() == mx.cpu or not mx.metal.is_available():
        return mx.float32
    return dtype


def _scores(q: mx.array, k, dtype: mx.Dtype) -> mx.array:
    if isinstance(k, QuantizedKV):
        return mx.quantized_matmul(
            q, k.data, k.scales.astype(dtype), k.biases.astype(dtype),
            transpose=True, group_size=k.group_size, bits=k.bits,
        )  # fmt: skip
    return q @ k.astype(dtype).swapaxes(-1, -2)


def _weighted(p: mx.array, v, dtype: mx.Dtype) -> mx.array:
    if isinstance(v, QuantizedKV):
        return mx.quantized_matmul(
            p, v.data, v.scales.astype(dtype), v.biases.astype(dtype),
            transpose=False, group_size=v.group_size, bits=v.bits,
        )  # fmt: skip
    return p @ v.astype(dtype)


def _expand(x, axis: int):
    if isinstance(x, QuantizedKV):
        return x.map(lambda a: mx.expand_dims(a, axis))
    return mx.expand_dims(x, axis)


def _causal(q_len: int, k_len: int, q_start: int = 0) -> mx.array:
    """mlx-lm's string mask "causal": aligned to the bottom right."""
    q_idx = mx.arange(k_len - q_len + q_start, k_len - q_len + q_start + q_len)
    return q_idx[:, None] >= mx.arange(k_len)[None]


def _attend_block(q, k, v, scale, mask, sinks, dtype, n_rep):
    """One block of queries: scores, mask, sinks, softmax, weighted values."""
    scores = _scores(q * scale, k, dtype)  # (B, Hkv, rep, L, S) or (B, H, L, S)
    if mask is not None:
        if n_rep > 1 and mask.ndim >= 3:
            if mask.shape[-3] > 1:  # one mask per query head: group like the queries
                mask = mask.reshape(*mask.shape[:-3], -1, n_rep, *mask.shape[-2:])
            else:
                mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask.astype(scores.dtype)
    if sinks is not None:
        s = sinks.astype(dtype)
        s = s.reshape(-1, n_rep, 1, 1) if n_rep > 1 else s.reshape(-1, 1, 1)
        s = mx.broadcast_to(s, (*scores.shape[:-1], 1))
        p = mx.softmax(mx.concatenate([s, scores], axis=-1), axis=-1, precise=True)[..., 1:]
    else:
        p = mx.softmax(scores, axis=-1, precise=True)
    return _weighted(p, v, dtype)


def quantized_attention(
    queries: mx.array,
    keys: QuantizedKV | mx.array,
    values: QuantizedKV | mx.array,
    scale: float,
    mask: mx.array | str | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention where keys and/or values are packed.

    Handles grouped-query heads, every mlx-lm mask form (None, "causal",
    boolean, additive, 1-D windowed, batched), sinks, rotated K/V and
    different key/value bit widths. Long query runs are split into blocks so
    the score matrix never spans the whole prefill at once.
    """
    out_dtype = queries.dtype
    dtype = compute_dtype(out_dtype)
    B, n_q, L, D = queries.shape
    n_kv = keys.shape[1]
    S = keys.shape[2]
    n_rep = n_q // n_kv
    q = queries.astype(dtype)
    if isinstance(keys, QuantizedKV) and keys.rotated:
        q = rotate(q)
    if n_rep > 1:
        q = q.reshape(B, n_kv, n_rep, L, D)
        keys, values = _expand(keys, -3), _expand(values, -3)
    if isinstance(mask, str):
        mask = _causal(L, S)

    blocks = []
    for start in range(0, L, _QUERY_BLOCK):
        stop = min(L, start + _QUERY_BLOCK)
        qb = q[..., start:stop, :] if L > _QUERY_BLOCK else q
        mb = mask
        if mask is not None and L > _QUERY_BLOCK and mask.ndim >= 2 and mask.shape[-2] == L:
            mb = mask[..., start:stop, :]
        blocks.append(_attend_block(qb, keys, values, scale, mb, sinks, dtype, n_rep))
    out = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=-2)

    if n_rep > 1:
        out = out.reshape(B, n_q, L, -1)
    if isinstance(values, QuantizedKV) and values.rotated:
        out = rotate(out)
    return out.astype(out_dtype)


# -- dispatch and its verification ------------------------------------------
_counter: Counter | None = None


def scaled_dot_product_attention(
    queries: mx.array,
    keys,
    values,
    cache,
    scale: float,
    mask,
    sinks: mx.array | None = None,
) -> mx.array:
    """Drop-in for `mlx_lm.models.base.scaled_dot_product_attention`."""
    if isinstance(keys, tuple) and hasattr(cache, "bits"):
        # mlx-lm's own QuantizedKVCache hands out plain tuples.
        keys = QuantizedKV(*keys, cache.bits, cache.group_size)
        values = QuantizedKV(*values, cache.bits, cache.group_size)
    packed = isinstance(keys, QuantizedKV) or isinstance(values, QuantizedKV)
    if _counter is not None:
        _counter["quantized" if packed else "full_precision"] += 1
        if cache is None:
            _counter["no_cache"] += 1
        if sinks is not None:
            _counter["sinks"] += 1
        _counter[("cache", id(cache), packed)] += 1
    if packed:
        return quantized_attention(queries, keys, values, scale, mask, sinks)
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )


@contextlib.contextmanager
def count_attention() -> Iterator[Counter]:
    """Count which attention path each call took while the block runs."""
    global _counter
    previous, _counter = _counter, Counter()
    try:
        yield _counter
    finally:
        _counter = previous


def _patch_module(module) -> bool:
    if getattr(module, "scaled_dot_product_attention", None) is _ORIGINAL:
        module.scaled_dot_product_attention = scaled_dot_product_attention
        return True
    return False


def install() -> list[str]:
    """Redirect mlx-lm's attention to ours, in `base` (so modules imported
    later bind ours) and in every model module already imported. Idempotent;
    returns the names of the modules patched now."""
    patched = []
    if _patch_module(mlx_base):
        patched.append(mlx_base.__name__)
    prefix = mlx_lm.models.__name__ + "."
    for name, module in list(sys.modules.items()):
        if name.startswith(prefix) and module is not None and _patch_module(module):
            patched.append(name)
    return patched


def uses_our_attention(module_name: str) -> bool:
    """Whether a model module's attention name is bound to ours (after import)."""
    module = importlib.import_module(module_name)
    install()
    fn = getattr(module, "scaled_dot_product_attention", None)
    return fn is scaled_dot_product_attention


def model_modules() -> list[str]:
    """Names of every architecture module shipped with mlx-lm."""
    return [
        m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)
        if not m.name.startswith("_")
    ]  # fmt: skip

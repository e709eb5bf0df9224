"""Attention over quantized K/V, and the single redirect of mlx-lm's attention.

Importing this module changes nothing in mlx-lm: `install()` redirects its
attention, and the planner calls it (`plan.plan_kv`, and loading a prompt
file), since only a plan's caches hand attention what mlx-lm's cannot read.

`scaled_dot_product_attention` has mlx-lm's signature and dispatches on what
the keys and values *are*, not on the cache object: packed `QuantizedKV`
goes to `quantized_attention`, arrays go to `mx.fast` (on the CPU, causal
prefill over arrays goes to `quantized_attention` too: its blocked products
and native softmax run 3x faster than `mx.fast`'s CPU path on a 4k prompt).
That is what makes KV-shared layers work (gemma4_text calls attention with
`cache=None` but hands over the owner layer's packed K/V) and attention
sinks work (gpt-oss).

Compute precision is a per-backend choice, made from the device attention
runs on (`current_backend`): on the CPU `mx.quantized_matmul` in
float16/bfloat16 is many times slower than in float32, so queries are cast
up there; on a GPU (Metal, or CUDA with `mlx[cuda]`) MLX's native-dtype
quantized kernels are fast, so the model's dtype is kept (assumed from MLX's
kernels; not measured here, since no GPU runs on this project's machines).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import Enum

import mlx.core as mx
import mlx_lm.models
import mlx_lm.models.base as mlx_base
import numpy as np

from .blas import fast_float32_products
from .kernels import causal_softmax, channel_scores, native_status, packed_scores, packed_weighted
from .kernels import log_softmax as native_log_softmax
from .kernels import paged_attention as native_paged_attention
from .kernels import paged_split_attention as native_paged_split_attention
from .quant import PagedKV, PagedSplitKV, QuantizedKV, SplitKV, SplitRows, rotate

# mlx-lm's own function, which its own QuantizedKVCache keeps using
MLX_LM_ATTENTION = mlx_base.scaled_dot_product_attention

# Queries are processed in blocks of at most _QUERY_BLOCK queries and
# _SCORE_BUDGET score elements (64 MiB in float32), so a long prefill chunk
# over a long cache never materializes its whole score matrix (mx.fast's CPU
# fallback does).
_QUERY_BLOCK = 512
_SCORE_BUDGET = 1 << 24
# raw paged K/V: rows of similar length are gathered and attended together
# while the group's slots stay within this factor of the tokens its rows hold
_GROUP_SLACK = 1.25


# CPU only: a prompt chunk (two query positions a sequence or more, and
# speculative verification) takes both products (scores and the weighted
# values) by dequantizing K/V one block of _KEY_BLOCK tokens at a time and
# multiplying densely: MLX's CPU `quantized_matmul` is 10-40x slower than a
# dense float32 product once there are more than a few rows (it is not a BLAS
# call), while the dequantization is cheap next to the product. Decode (one
# position a sequence) keeps the packed products (the native kernels), so no
# dequantized copy of a long cache ever exists. The two round differently, so
# the choice follows the sequence's positions, never the rows of the batch
# or the size of a chunk: a prompt's result does not depend on where its
# chunks end. A block is `_KEY_BLOCK` tokens, or more while its dequantized
# copy stays smaller than the score matrix of the same rows (then one block
# usually covers the cache, saving the concatenation and slicing of scores).
_PROMPT_POSITIONS = 2


def _prompt_chunk(positions: int) -> bool:
    """Whether `positions` queries a sequence take a prompt chunk's products."""
    return positions >= _PROMPT_POSITIONS


_KEY_BLOCK = 4096


# A weighted product sums this many keys at a time, in order: OpenBLAS cuts a
# product's inner dimension past 384 where the product's size says (at half
# of it up to 768), so one product over more keys than a query sees rounds
# that query's sum otherwise (a 482-token prompt's answer changed with the
# prompts beside it). Blocks under the cut make a query's sum the same
# whatever keys after it the product holds (they add exact zeros). The blocks
# start at positions that are multiples of it (`phase`: the position of the
# first key, modulo it), so they are the same whichever keys a cache dropped
# before or a query block trimmed.
_SUM_BLOCK = 128


def _sum_ranges(n: int, phase: int = 0) -> list[tuple[int, int]]:
    """The `[start, stop)` blocks of `n` keys whose first is at `phase`."""
    first = (-phase) % _SUM_BLOCK or _SUM_BLOCK
    cuts = [0, *range(first, n, _SUM_BLOCK), n]
    return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def _summed(p: mx.array, v: mx.array, phase: int = 0) -> mx.array:
    """`p @ v` over the keys axis, a `_SUM_BLOCK` block at a time, in order."""
    out = None
    for a, b in _sum_ranges(v.shape[-2], phase):
        part = p if (a, b) == (0, v.shape[-2]) else p[..., a:b]
        part = part @ (v if (a, b) == (0, v.shape[-2]) else v[..., a:b, :])
        out = part if out is None else out + part
    return out


def _key_block(rows: int, tokens: int, dim: int) -> int:
    return max(_KEY_BLOCK, rows * tokens // max(1, dim))


# CPU only: attention runs one (sequence, KV head) at a time when there are at
# most _SPLIT_LIMIT of them and at least _SPLIT_MIN_TOKENS cached tokens.
# Caches hand out `buffer[..., :offset, :]`, a strided view across heads,
# which `quantized_matmul` would first copy whole (a transient the size of
# the layer's packed K/V at every decode step); the view of one head of one
# sequence is contiguous, so it is read in place. Below the token threshold
# the copy costs less than the extra operations.
_SPLIT_LIMIT = 8
_SPLIT_MIN_TOKENS = 4096


class Backend(str, Enum):
    """Where quantized attention runs, which decides its paths."""

    CPU = "cpu"  # float32 products, dense blocks for many rows, the native kernels
    METAL = "metal"  # MLX's quantized kernels in the model's dtype
    CUDA = "cuda"  # likewise (MLX's CUDA kernels; assumed, not measured here)


def backend_for(device: mx.DeviceType, metal: bool, cuda: bool) -> Backend:
    """The backend of work placed on a `device` of this type, given which GPU
    backends this MLX build has. A pure function of its inputs, so the choice
    is testable without a GPU; `current_backend` feeds it the live values."""
    if device != mx.DeviceType.gpu:
        return Backend.CPU
    if metal:
        return Backend.METAL
    if cuda:
        return Backend.CUDA
    return Backend.CPU  # no GPU backend at all: MLX cannot run it on a GPU


def current_backend() -> Backend:
    """The backend of the device attention runs on now: the default device,
    which `with mx.stream(s)` (mlx-lm's generation stream) sets to the
    stream's device."""
    cuda = getattr(mx, "cuda", None)
    return backend_for(
        mx.default_device().type,
        mx.metal.is_available(),
        bool(cuda is not None and cuda.is_available()),
    )


def _on_cpu() -> bool:
    return current_backend() is Backend.CPU


def log_softmax(logits: mx.array) -> mx.array:
    """`logits - logsumexp(logits)` over the last axis, as mlx-lm's batch step
    normalizes its logits: float32 rows on the CPU through the native kernel
    (MLX's CPU exp is scalar: 42 ms against 2.7 ms for 16 rows of Gemma 3's
    262,144 logits, and less exact), MLX's operations otherwise."""
    if logits.ndim == 2 and logits.dtype == mx.float32 and _native():
        return native_log_softmax(logits)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _native() -> bool:
    """Few-row products on the CPU use the native fused kernels when they
    are built for this MLX (`mlx_kvq.kernels`): they read packed K/V once,
    5-10x faster than MLX's CPU `quantized_matmul`, and take the caches'
    strided views without copying them."""
    return _on_cpu() and native_status().available


def compute_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """The dtype quantized attention computes in on the current backend."""
    if _on_cpu():
        return mx.float32
    return dtype


def _dense_dtype(dtype: mx.Dtype) -> mx.Dtype | None:
    """Dtype of the dense products over dequantized K/V blocks, or None to
    use `quantized_matmul` (Metal: its native kernels are the fast path).

    On the CPU: float32 when MLX's float32 products run on a fast BLAS (the
    default on Linux, `mlx_kvq.blas`), 15-20x faster than MLX's own bfloat16
    product; with the reference BLAS, bfloat16 models multiply in bfloat16
    (then the faster of the two, and their unquantized attention's
    precision) and the others in float32."""
    if not _on_cpu():
        return None
    if dtype == mx.bfloat16 and not fast_float32_products():
        return mx.bfloat16
    return mx.float32


def _scores(q: mx.array, k, dtype: mx.Dtype, dense: mx.Dtype | None = None) -> mx.array:
    if isinstance(k, SplitKV):
        return _split_scores(q, k, dtype, dense)
    if isinstance(k, QuantizedKV):
        if k.per_channel:
            return _channel_scores(q, k, dtype, dense)
        if dense is not None:
            return _dense_scores(q, k, dtype, dense, _key_block(q.shape[-2], *k.shape[-2:]))
        if _native():
            return packed_scores(q, k).astype(dtype)
        return mx.quantized_matmul(
            q, k.data, k.scales.astype(dtype), k.biases.astype(dtype),
            transpose=True, group_size=k.group_size, bits=k.bits,
        )  # fmt: skip
    return q @ k.astype(dtype).swapaxes(-1, -2)


def _split_scores(q: mx.array, k: SplitKV, dtype: mx.Dtype, dense: mx.Dtype | None) -> mx.array:
    """Scores over the split layout's parts, in token order: the quantized
    body in its own basis (a rotated body sees rotated queries)."""
    parts = []
    for part in k.parts():
        if isinstance(part, QuantizedKV):
            parts.append(_scores(rotate(q) if part.rotated else q, part, dtype, dense))
        else:
            parts.append(q @ part.astype(dtype).swapaxes(-1, -2))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def _channel_scores(q: mx.array, k: QuantizedKV, dtype: mx.Dtype, dense: mx.Dtype | None):
    """q @ K^T for per-channel keys (channel-major (B, H, D, N), packed along
    the tokens): dense blocks of whole groups for many rows on the CPU, the
    native kernel for few, else `quantized_matmul` (q times the (D, N) matrix)."""
    if dense is not None:
        G, N = k.group_size, k.shape[-2]
        block = -(-_key_block(q.shape[-2], N, k.shape[-1]) // G) * G
        qd = q.astype(dense)
        parts = []
        for start in range(0, N, block):
            blk = k if block >= N else k.tokens(start, min(N, start + block))
            kd = mx.dequantize(
                blk.data, blk.scales.astype(dense), blk.biases.astype(dense),
                group_size=G, bits=k.bits,
            )  # fmt: skip
            parts.append(qd @ kd)
        scores = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        return scores.astype(dtype)
    if _native():
        return channel_scores(q, k).astype(dtype)
    return mx.quantized_matmul(
        q, k.data, k.scales.astype(dtype), k.biases.astype(dtype),
        transpose=False, group_size=k.group_size, bits=k.bits,
    )  # fmt: skip


def _split_weighted(p: mx.array, v: SplitKV, dtype: mx.Dtype, dense: mx.Dtype | None) -> mx.array:
    """p @ V over the split layout's parts (a rotated body's share rotated back)."""
    out, start = None, 0
    for part in v.parts():
        n = part.shape[2]
        pp = p[..., start : start + n]
        if isinstance(part, QuantizedKV):
            o = _weighted(pp, part, dtype, dense)
            o = rotate(o) if part.rotated else o
        else:
            o = _summed(pp, part.astype(dtype))
        out = o if out is None else out + o
        start += n
    return out


def _dequantized_blocks(
    x: QuantizedKV, dense: mx.Dtype, block: int
) -> Iterator[tuple[int, mx.array]]:
    """(first token, dequantized block) over `block`-token blocks, in the
    stored (possibly rotated) basis."""
    S = x.data.shape[-2]
    for start in range(0, S, block):
        stop = min(S, start + block)
        blk = x if stop - start == S else x.map(lambda a, i=start, j=stop: a[..., i:j, :])
        yield start, mx.dequantize(
            blk.data, blk.scales.astype(dense), blk.biases.astype(dense),
            group_size=x.group_size, bits=x.bits,
        )  # fmt: skip


def _dense_scores(
    q: mx.array, k: QuantizedKV, dtype: mx.Dtype, dense: mx.Dtype, block: int
) -> mx.array:
    """q @ K^T with K dequantized one block at a time."""
    qd = q.astype(dense)
    parts = [qd @ kd.swapaxes(-1, -2) for _, kd in _dequantized_blocks(k, dense, block)]
    scores = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    return scores.astype(dtype)


def _dense_weighted(
    p: mx.array, v: QuantizedKV, dtype: mx.Dtype, dense: mx.Dtype, block: int, phase: int = 0
) -> mx.array:
    """p @ V with V dequantized about `block` tokens at a time, its products
    summed a `_SUM_BLOCK` block at a time (`_sum_ranges`)."""
    pd = p.astype(dense)
    out = None
    ranges = _sum_ranges(v.shape[-2], phase)
    per = max(1, block // _SUM_BLOCK)
    for i in range(0, len(ranges), per):
        group = ranges[i : i + per]
        lo, hi = group[0][0], group[-1][1]
        blk = v if (lo, hi) == (0, v.shape[-2]) else v.tokens(lo, hi)
        vd = mx.dequantize(
            blk.data, blk.scales.astype(dense), blk.biases.astype(dense),
            group_size=v.group_size, bits=v.bits,
        )  # fmt: skip
        for a, b in group:
            part = pd[..., a:b] @ vd[..., a - lo : b - lo, :]
            out = part if out is None else out + part
    return out.astype(dtype)


def _weighted(
    p: mx.array, v, dtype: mx.Dtype, dense: mx.Dtype | None = None, phase: int = 0
) -> mx.array:
    if isinstance(v, SplitKV):
        return _split_weighted(p, v, dtype, dense)
    if isinstance(v, QuantizedKV):
        if dense is not None:
            block = _key_block(p.shape[-2], *v.shape[-2:])
            return _dense_weighted(p, v, dtype, dense, block, phase)
        if _native():
            return packed_weighted(p, v).astype(dtype)
        return mx.quantized_matmul(
            p, v.data, v.scales.astype(dtype), v.biases.astype(dtype),
            transpose=False, group_size=v.group_size, bits=v.bits,
        )  # fmt: skip
    return _summed(p, v.astype(dtype), phase)


@dataclass(frozen=True)
class Causal:
    """A causal mask by positions: query row m of a block sees the key slots
    (shift + m - window, shift + m], one shift per sequence or one for all.

    mlx-lm's "causal" (the last queries of the keys: shift S - L), a paged
    row (the keys its blocks hold) and a cache's window are all this. The
    native softmax applies it without a mask matrix, and a query block reads
    only the key range it can see (`visible`)."""

    shift: tuple[int, ...]
    window: int = 0  # 0: every earlier key

    def block(self, start: int) -> Causal:
        """The mask of the query rows from `start` on."""
        return replace(self, shift=tuple(s + start for s in self.shift))

    def visible(self, rows: int, keys: int, origin: int = 0) -> tuple[int, int]:
        """The key slots [lo, hi) that any of `rows` query rows sees, slot 0
        holding position `origin` (lo at a position that is a multiple of
        `_SUM_BLOCK`: a query's sums and the native softmax's lanes stay those
        of the whole row)."""
        hi = min(keys, max(self.shift) + rows)
        if not self.window:
            return 0, hi
        seen = max(0, min(self.shift) - self.window + 1)
        lo = max(0, (origin + seen) // _SUM_BLOCK * _SUM_BLOCK - origin)
        return min(lo, hi), hi

    def moved(self, lo: int) -> Causal:
        """The mask over the key slots from `lo` on."""
        return replace(self, shift=tuple(s - lo for s in self.shift))

    def pick(self, b: int) -> Causal:
        """The mask of sequence `b` alone."""
        return self if len(self.shift) == 1 else replace(self, shift=(self.shift[b],))

    def array(self, rows: int, keys: int) -> mx.array:
        """The boolean mask, (rows, keys) for one shift, else (B, 1, 1, rows, keys)."""
        last = mx.array(self.shift)[:, None, None] + mx.arange(rows)[None, :, None]
        slot = mx.arange(keys)[None, None]
        seen = slot <= last
        if self.window:
            seen = seen & (slot > last - self.window)
        return seen[0] if len(self.shift) == 1 else seen[:, None, None]


def _grouped_mask(mask: mx.array, n_q: int, n_rep: int) -> mx.array:
    """A mask broadcastable to (B, n_q, L, S) made broadcastable to
    (B, n_kv, n_rep, L, S): one mask per query head is grouped like the
    queries, a shared one gets a broadcast axis."""
    if mask.ndim < 3:
        return mask
    if mask.ndim == 3:
        mask = mask[None]
    heads = mask.shape[1]
    if heads == 1:
        return mx.expand_dims(mask, 2)
    return mask.reshape(mask.shape[0], heads // n_rep, n_rep, *mask.shape[2:])


def _attend_rows(q, k, v, mask, sinks, dtype, shape, dense=None, phase=0):
    """Attention for query rows grouped by KV head.

    `q` is (B, n_kv, n_rep * L, D): the queries of every head sharing a KV
    head stacked as rows, so each packed K/V head is read once per call by
    one matrix product (broadcasting K/V over the repeated heads instead
    makes `mx.quantized_matmul` read it once per query head). On the CPU the
    softmax is the native one for every mask (one arithmetic for every
    layout); a `Causal` mask is applied there without a mask matrix.
    """
    B, n_kv, n_rep, L = shape
    scores = _scores(q, k, dtype, dense)  # (B, n_kv, n_rep * L, S)
    S = scores.shape[-1]
    native = _native() and dtype == mx.float32
    if isinstance(mask, Causal) and not native:
        mask = mask.array(L, S)
    if mask is not None and not isinstance(mask, Causal):
        scores = scores.reshape(B, n_kv, n_rep, L, S)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask.astype(scores.dtype)
        scores = scores.reshape(B, n_kv, n_rep * L, S)
        mask = None
    if native:
        c = mask or Causal((S - 1,))  # no mask: every row sees every key
        p = causal_softmax(scores, c.shift, c.window, n_rep, sinks)
    elif sinks is not None:
        scores = scores.reshape(B, n_kv, n_rep, L, S)
        s = sinks.astype(dtype).reshape(n_kv, n_rep, 1, 1)
        s = mx.broadcast_to(s, (*scores.shape[:-1], 1))
        scores = mx.concatenate([s, scores], axis=-1)
        p = mx.softmax(scores, axis=-1, precise=True)[..., 1:].reshape(B, n_kv, n_rep * L, S)
    else:
        p = mx.softmax(scores, axis=-1, precise=True)
    return _weighted(p, v, dtype, dense, phase).reshape(B, n_kv, n_rep, L, -1)


def _pick(x, b: int, h: int):
    """Sequence `b`, KV head `h` of an array (or packed K/V) laid out
    (B, n_kv, ...), where an axis of size one broadcasts."""
    if isinstance(x, (QuantizedKV, SplitKV)):
        return x.map(lambda a: _pick(a, b, h))
    bs = slice(b, b + 1) if x.shape[0] > 1 else slice(None)
    hs = slice(h, h + 1) if x.shape[1] > 1 else slice(None)
    return x[bs, hs]


def _attend(q, k, v, mask, sinks, dtype, shape, dense, phase=0):
    """`_attend_rows`, split per (sequence, KV head) on the CPU (see _SPLIT_LIMIT)."""
    B, n_kv, n_rep, L = shape
    few = 1 < B * n_kv <= _SPLIT_LIMIT
    native_rows = dense is None and _native()  # reads the views in place
    if not few or k.shape[2] < _SPLIT_MIN_TOKENS or not _on_cpu() or native_rows:
        return _attend_rows(q, k, v, mask, sinks, dtype, shape, dense, phase)
    if sinks is not None:
        sinks = sinks.reshape(n_kv, n_rep)
    one = (1, 1, n_rep, L)
    out = []
    for b in range(B):
        heads = []
        for h in range(n_kv):
            qh, kh, vh = _pick(q, b, h), _pick(k, b, h), _pick(v, b, h)
            if isinstance(mask, Causal):
                mh = mask.pick(b)
            else:
                mh = mask if mask is None or mask.ndim < 5 else _pick(mask, b, h)
            sh = None if sinks is None else sinks[h]
            heads.append(_attend_rows(qh, kh, vh, mh, sh, dtype, one, dense, phase))
        out.append(mx.concatenate(heads, axis=1))
    return out[0] if B == 1 else mx.concatenate(out, axis=0)


def quantized_attention(
    queries: mx.array,
    keys: QuantizedKV | mx.array,
    values: QuantizedKV | mx.array,
    scale: float,
    mask: mx.array | str | None = None,
    sinks: mx.array | None = None,
    positions: int | None = None,
    origin: int = 0,
) -> mx.array:
    """Attention where keys and/or values are packed (`QuantizedKV`), or in
    the split layout (`SplitKV`: unquantized sinks and tail around a
    quantized body, per-channel keys included).

    Handles grouped-query heads, every mlx-lm mask form (None, "causal",
    boolean, additive, 1-D windowed, batched, per head), sinks, rotated K/V
    and different key/value bit widths. Long query runs are split into
    blocks so the score matrix never spans the whole prefill at once.
    `positions` (default: this call's) are the query positions a sequence of
    the write these queries belong to, which choose the products once for
    every block (`_prompt_chunk`). `origin`: the position key slot 0 holds,
    which aligns the weighted sums' blocks (`_SUM_BLOCK`) to positions.
    """
    out_dtype = queries.dtype
    dtype = compute_dtype(out_dtype)
    B, n_q, L, D = queries.shape
    n_kv = keys.shape[1]
    S = keys.shape[2]
    n_rep = n_q // n_kv
    dense = _dense_dtype(out_dtype) if _prompt_chunk(positions or L) else None
    q = queries.astype(dtype) * scale
    if isinstance(keys, QuantizedKV) and keys.rotated:
        q = rotate(q)
    q = q.reshape(B, n_kv, n_rep, L, D)
    if isinstance(mask, str):
        mask = Causal((S - L,))
    elif mask is not None and not isinstance(mask, Causal):
        mask = _grouped_mask(mask, n_q, n_rep)
    trim = _by_tokens(keys) and _by_tokens(values)
    split = isinstance(keys, SplitKV) and isinstance(values, SplitKV)

    block = max(1, min(L, _QUERY_BLOCK, _SCORE_BUDGET // max(1, B * n_q * S)))
    blocks = []
    for start in range(0, L, block):
        rows = min(block, L - start)
        qb = q if rows == L else q[..., start : start + rows, :]
        kb, vb, lo = keys, values, 0
        if isinstance(mask, Causal):
            mb = mask.block(start)
            lo, hi = mb.visible(rows, S, origin) if trim else (0, S)
            if (lo, hi) != (0, S):  # keys no row of the block sees are not read
                kb, vb, mb = _tokens(keys, lo, hi), _tokens(values, lo, hi), mb.moved(lo)
            elif split and mb.window == 0:  # nor later ones in the split layout
                n = keys.reach(mb.visible(rows, S)[1])
                kb, vb = keys.upto(n), values.upto(n)
        elif mask is not None and rows < L and mask.ndim >= 2 and mask.shape[-2] == L:
            mb = mask[..., start : start + rows, :]
        else:
            mb = mask
        qb = qb.reshape(B, n_kv, n_rep * rows, D)
        shape = (B, n_kv, n_rep, rows)
        phase = 0 if split else (origin + lo) % _SUM_BLOCK
        blocks.append(_attend(qb, kb, vb, mb, sinks, dtype, shape, dense, phase))
    out = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=-2)
    out = out.reshape(B, n_q, L, -1)
    if isinstance(values, QuantizedKV) and values.rotated:
        out = rotate(out)
    return out.astype(out_dtype)


def _prefill_rows(queries: mx.array) -> bool:
    """Whether there are as many query rows per KV head as prefill has."""
    return _prompt_chunk(queries.shape[2])


def _by_tokens(x) -> bool:
    """Whether `x` (keys or values) can be cut to a range of tokens as is:
    arrays and per-token packing (not per-channel groups, not the split layout)."""
    return isinstance(x, mx.array) or (isinstance(x, QuantizedKV) and not x.per_channel)


def _tokens(x, lo: int, hi: int):
    """Tokens [lo, hi) of keys or values laid out (B, H, N, ...)."""
    return x.tokens(lo, hi) if isinstance(x, QuantizedKV) else x[..., lo:hi, :]


def paged_attention(
    queries: mx.array,
    keys: PagedKV,
    values: PagedKV,
    scale: float,
    mask=None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention over K/V held in blocks (`PagedKV`), each row over its own tokens.

    Masks come from positions (causal, and the window when the cache has
    one): the model's own mask, laid out for a padded batch, does not apply,
    so only None and "causal" are accepted. On the CPU with the native
    kernels, few query rows (decode) read the blocks in place through the
    tables (`kernels.paged_attention`), packed or raw alike. Otherwise raw
    K/V are gathered for groups of rows of similar length and attended with
    `mx.fast` (`_paged_raw_grouped`).
    Otherwise (quantized prefill chunks, Metal and any other backend) each
    row's blocks are gathered into a contiguous copy of that row only and
    attended with `quantized_attention`: nothing is padded to the longest row.
    """
    if mask is not None and not isinstance(mask, str):
        raise ValueError(
            "paged K/V take masks from positions; this model passes a mask array "
            "(serve it with the padded layout)"
        )
    B, n_q, L, D = queries.shape
    n_kv = keys.pool.shape[2]
    n_rep = n_q // n_kv
    if not _prompt_chunk(L) and _native() and _native_reads(keys, values):
        q = queries.astype(mx.float32) * scale
        if keys.rotated:
            q = rotate(q)
        q = q.reshape(B, n_kv, n_rep * L, D)
        out = native_paged_attention(q, keys, values, L, sinks).reshape(B, n_q, L, -1)
        if values.rotated:
            out = rotate(out)
        return out.astype(queries.dtype)
    if not keys.quantized and not values.quantized:
        return _paged_raw_grouped(queries, keys, values, scale, sinks)
    out = []
    for b in range(B):
        base, end = keys.bases[b], keys.ends[b]
        k, v = keys.row(b), values.row(b)
        m = None
        if L > 1 or (keys.window is not None and end - base > keys.window):
            m = Causal((end - base - L,), keys.window or 0)
        out.append(quantized_attention(queries[b : b + 1], k, v, scale, m, sinks, origin=base))
    return out[0] if B == 1 else mx.concatenate(out, axis=0)


def _native_reads(keys: PagedKV, values: PagedKV) -> bool:
    """Whether the native paged kernel takes these pools: both packed, or both
    raw with head dimensions its vector loops divide (keys by 16, values by 8)."""
    if keys.quantized or values.quantized:
        return keys.quantized and values.quantized
    dk, dv = keys.pool.shape[-1], values.pool.shape[-1]
    return dk % 16 == 0 and dv % 8 == 0 and max(dk, dv) <= 512


def _row_groups(blocks: list[int], slack: float = _GROUP_SLACK) -> list[list[int]]:
    """Rows (by their block counts) in groups of similar length, longest first:
    a group's width times its rows stays within `slack` of the blocks they hold."""
    order = sorted(range(len(blocks)), key=lambda b: -blocks[b])
    groups: list[list[int]] = []
    held = 0
    for b in order:
        if groups and blocks[groups[-1][0]] * (len(groups[-1]) + 1) <= slack * (held + blocks[b]):
            groups[-1].append(b)
            held += blocks[b]
        else:
            groups.append([b])
            held = blocks[b]
    return groups


def _gather_rows(pool: mx.array, ids: mx.array) -> mx.array:
    """Blocks `ids` (rows, width) of a raw pool as contiguous (rows, heads, slots, dim)."""
    g = pool[ids]  # (rows, width, block, heads, dim)
    g = g.reshape(ids.shape[0], -1, *g.shape[3:]).transpose(0, 2, 1, 3)
    return mx.contiguous(g)  # attention reads a transposed gather ~2x slower


def _paged_raw_grouped(
    queries: mx.array, keys: PagedKV, values: PagedKV, scale: float, sinks: mx.array | None
) -> mx.array:
    """Raw paged K/V attended a group of rows at a time (one gather and one
    `mx.fast` call per group instead of per row): each group's blocks are
    gathered through its tables into a transient copy as wide as its longest
    row, and the slots a row does not hold are masked out. A row whose first
    block (a window's) starts inside a `_SUM_BLOCK` gets masked slots before
    it up to that block's start, so its sums keep their blocks."""
    B, _, L, _ = queries.shape
    bs = keys.block_size
    n = np.asarray(keys.ends) - np.asarray(keys.bases)
    blocks = [-(-int(x) // bs) for x in n]
    aligned = _SUM_BLOCK % bs == 0
    pad = [int(b) % _SUM_BLOCK // bs if aligned else 0 for b in keys.bases]
    span = [p + m for p, m in zip(pad, blocks, strict=True)]
    outs, order = [], []
    for rows in _row_groups(span):
        width = span[rows[0]]
        slots = width * bs
        table = np.zeros((len(rows), width), dtype=np.int32)
        for i, r in enumerate(rows):
            table[i, pad[r] : span[r]] = keys.tables[r, : blocks[r]]
        ids = mx.array(table)
        q = queries if rows == list(range(B)) else queries[mx.array(rows)]
        k = _gather_rows(keys.pool, ids).astype(q.dtype)
        v = _gather_rows(values.pool, ids).astype(q.dtype)
        mask = Causal(tuple(int(n[r]) - L + pad[r] * bs for r in rows), keys.window or 0)
        if _native():  # the native causal softmax (see `scaled_dot_product_attention`)
            outs.append(quantized_attention(q, k, v, scale, mask, sinks))
        else:
            seen = mask.array(L, slots)
            if seen.ndim == 5:  # one mask per row, laid out for mx.fast: (rows, 1, L, slots)
                seen = seen[:, :, 0]
            outs.append(
                mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=seen, sinks=sinks)
            )
        order += rows
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    if order == list(range(B)):
        return out
    return out[mx.array(np.argsort(order).astype(np.int32))]


def split_rows_attention(
    queries: mx.array,
    keys: SplitRows,
    values: SplitRows,
    scale: float,
    mask=None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention over a batch of split-layout rows (`SplitRows`), each over
    its own tokens with a mask from positions (causal, the window when set,
    the head always visible); only None and "causal" masks are accepted, as
    for paged K/V. A row with a `Reread` attends in runs of queries that
    read the same body, each over exactly what a decode at its queries read."""
    if mask is not None and not isinstance(mask, str):
        raise ValueError(
            "split-layout batches take masks from positions; this model passes a mask array "
            "(serve it with --kv-residual 0 --kv-sinks 0 --kv-key-scales token)"
        )
    B, n_q, L, _ = queries.shape
    out = []
    for b in range(B):
        head, first, end = keys.heads[b], keys.firsts[b], keys.ends[b]
        q, k, v = queries[b : b + 1], keys.rows[b], values.rows[b]
        reread = keys.rereads[b] if keys.rereads else None
        if reread is None:
            out.append(_split_row(q, k, v, head, first, end, keys.window, scale, sinks))
            continue
        runs = []
        for q0, q1, e in reread.runs(end - L, end):
            qr = q[:, :, q0 - end + L : q1 - end + L]
            # before the first block (and the head laid out with it) every key is exact
            h, f = (0, 0) if e < head else (head, first)
            kr = _as_decoded(k, reread.keys, h, f, e, q1, reread.start)
            vr = _as_decoded(v, reread.values, h, f, e, q1, reread.start)
            runs.append(_split_row(qr, kr, vr, h, f, q1, keys.window, scale, sinks, L))
        out.append(runs[0] if len(runs) == 1 else mx.concatenate(runs, axis=2))
    return out[0] if B == 1 else mx.concatenate(out, axis=0)


def _split_row(q, k: SplitKV, v: SplitKV, head: int, first: int, end: int,
               window: int | None, scale: float, sinks, positions: int | None = None) -> mx.array:  # fmt: skip
    """One split-layout row: it holds its first `head` positions, then the
    run `[first, end)`; its queries are the last before `end`."""
    L = q.shape[2]
    m = None
    if window is None and first == head:  # one run of positions [0, end)
        m = "causal" if L > 1 else None
    elif L > 1 or (window is not None and first < end - window):
        pos = mx.concatenate([mx.arange(head), mx.arange(first, end)])[None]
        at = mx.arange(end - L, end)[:, None]
        m = pos <= at
        if window is not None:
            m = m & ((pos > at - window) | (mx.arange(pos.size)[None] < head))
    return quantized_attention(q, k, v, scale, m, sinks, positions)


def _as_decoded(x: SplitKV, exact: mx.array, head: int, first: int, body_end: int,
                end: int, start: int) -> SplitKV:  # fmt: skip
    """Keys or values of a row as a decode at a query before `end` read them:
    the `head` first positions, the body (from `first`) before `body_end`,
    then `exact` (positions from `start`) from `body_end` to `end`."""
    tail = exact[..., body_end - start : end - start, :]
    body = None
    if body_end > first and x.body is not None:
        n = body_end - first
        body = x.body.tokens(0, n) if isinstance(x.body, QuantizedKV) else x.body[..., :n, :]
    return SplitKV(x.head if head else None, body, tail)


def paged_split_attention(
    queries: mx.array,
    keys: PagedSplitKV,
    values: PagedSplitKV,
    scale: float,
    mask=None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention over split-layout rows in blocks (`PagedSplitKV`). On the
    CPU with the native kernels, few query rows (decode) read the blocks in
    place through the tables and each row's exact sinks and tail as they are
    held (`kernels.paged_split_attention`); otherwise, and after a write that
    quantized tokens its own queries read exact (`Reread`), each row is laid
    out (`SplitRows`) for `split_rows_attention`."""
    B, n_q, L, D = queries.shape
    n_kv = keys.shape[1]
    n_rep = n_q // n_kv
    packed = isinstance(keys.pool, QuantizedKV) and isinstance(values.pool, QuantizedKV)
    if keys.rereads or not (packed and not _prompt_chunk(L) and _native()):
        return split_rows_attention(queries, keys.rows(), values.rows(), scale, mask, sinks)
    if mask is not None and not isinstance(mask, str):
        raise ValueError(
            "split-layout batches take masks from positions; this model passes a mask array "
            "(serve it with --kv-residual 0 --kv-sinks 0 --kv-key-scales token)"
        )
    q = (queries.astype(mx.float32) * scale).reshape(B, n_kv, n_rep * L, D)
    qb = rotate(q) if keys.pool.rotated else q
    out = native_paged_split_attention(q, qb, keys, values, L, sinks)
    if values.pool.rotated:
        dv = out.shape[-1] // 2
        out = out[..., :dv] + rotate(out[..., dv:])
    return out.reshape(B, n_q, L, -1).astype(queries.dtype)


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
    mlx_lm_packed = isinstance(keys, tuple | list)
    ours = (QuantizedKV, SplitKV)
    packed = mlx_lm_packed or isinstance(keys, ours) or isinstance(values, ours)
    if isinstance(keys, SplitRows | PagedSplitKV):
        if _counter is not None:
            _counter["quantized"] += 1
            _counter[("cache", id(cache), True)] += 1
        if isinstance(keys, PagedSplitKV):
            return paged_split_attention(queries, keys, values, scale, mask, sinks)
        return split_rows_attention(queries, keys, values, scale, mask, sinks)
    if isinstance(keys, PagedKV):
        if _counter is not None:
            _counter["paged"] += 1
            _counter["quantized" if keys.quantized else "full_precision"] += 1
        return paged_attention(queries, keys, values, scale, mask, sinks)
    if _counter is not None:
        _counter["quantized" if packed else "full_precision"] += 1
        if cache is None:
            _counter["no_cache"] += 1
        if sinks is not None:
            _counter["sinks"] += 1
        _counter[("cache", id(cache), packed)] += 1
    if mlx_lm_packed:
        # mlx-lm's own QuantizedKVCache (what `mx.quantize` returns, a list or
        # a tuple): mlx-lm's own function, so its results stay bit for bit;
        # with attention sinks, which mlx-lm's refuses, ours
        if sinks is None:
            return MLX_LM_ATTENTION(queries, keys, values, cache, scale=scale, mask=mask)
        keys = QuantizedKV(*keys, cache.bits, cache.group_size)
        values = QuantizedKV(*values, cache.bits, cache.group_size)
    if packed or (_prefill_rows(queries) and isinstance(mask, str) and _native()):
        # prefill over raw K/V on the CPU too: blocked products, the native
        # causal softmax, and only the keys each block sees (mx.fast's CPU
        # path materializes every score and exps them one at a time)
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
    if getattr(module, "scaled_dot_product_attention", None) is MLX_LM_ATTENTION:
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

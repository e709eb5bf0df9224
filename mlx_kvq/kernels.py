"""The native CPU kernels of quantized attention, and whether they are in use.

`mlx_kvq._native` (built by `pip install -e .` from `mlx_kvq/native/qattn.cpp`
where a C++ compiler is present) adds MLX primitives that read packed
K/V once and multiply them with a few rows at a time (per-token keys and
values; per-channel keys, `channel_scores`; block pools, `paged_attention`,
and the split layout's, `paged_split_attention`): what decode attention
needs, and what MLX's CPU `quantized_matmul` does slowly (scalar code that
re-reads the packed matrix for every row); and a softmax under a causal mask
given by positions (`causal_softmax`), what prefill needs between its two
products, where MLX's CPU softmax computes exp one element at a time
(5-8x slower); and the log-softmax of logits rows (`log_softmax`), which
every decode step takes over the vocabulary. They are used only on the CPU, only
when the module was built against the running MLX version (MLX's C++ API has
no stable ABI) and only after a self-check against `mx.dequantize` passed;
otherwise attention keeps MLX's operations, and `native_status()` says why.
`MLX_KVQ_NATIVE=0` turns them off; `MLX_KVQ_NATIVE_THREADS` caps the threads
one call uses (default: one per core; small calls run on one).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import mlx.core as mx

from .quant import PagedKV, PagedSplitKV, QuantizedKV

ENV = "MLX_KVQ_NATIVE"


@dataclass(frozen=True)
class NativeStatus:
    available: bool
    reason: str  # why (not) in use

    def summary(self) -> str:
        return ("native CPU kernels: " if self.available else "no native CPU kernels: ") + (
            self.reason
        )


_module = None
_status: NativeStatus | None = None


def _self_check(module) -> str | None:
    """None if both kernels match MLX's dequantize-then-multiply on a small
    strided case for every width; else what differed. Its inputs come from
    explicit keys: the global random state is the user's."""
    for bits in (2, 3, 4, 5, 6, 8):
        kx, kq, kp = mx.random.split(mx.random.key(bits), 3)
        x = mx.random.normal((1, 2, 40, 64), key=kx)
        w, s, b = mx.quantize(x, group_size=32, bits=bits)
        w, s, b = (a[..., :33, :] for a in (w, s, b))
        dense = mx.dequantize(w, s, b, group_size=32, bits=bits)
        q = mx.random.normal((1, 2, 3, 64), key=kq)
        p = mx.random.uniform(shape=(1, 2, 3, 33), key=kp)
        # per-channel keys: channel-major (B, H, D, N) packed along the tokens
        wc, sc, bc = mx.quantize(x.swapaxes(-1, -2)[..., :32], group_size=32, bits=bits)
        channel = mx.dequantize(wc, sc, bc, group_size=32, bits=bits)
        got = (
            module.packed_scores(q, w, s, b, 32, bits),
            module.packed_weighted(p, w, s, b, 32, bits),
            module.channel_scores(q, wc, sc, bc, 32, bits),
        )
        want = (q @ dense.swapaxes(-1, -2), p @ dense, q @ channel)
        for g, r in zip(got, want, strict=True):
            if g.shape != r.shape or not mx.allclose(g, r, atol=1e-4, rtol=1e-4).item():
                return f"self-check failed at {bits} bits"
    scores = 4 * mx.random.normal((2, 2, 3 * 5, 41), key=mx.random.key(1))
    sinks = mx.random.normal((6,), key=mx.random.key(2))
    for window, with_sinks in ((0, False), (7, True)):
        # query row m of a block sees the key slots (shift + m - window, shift + m]
        shift = mx.array([30, 36], dtype=mx.int32)
        got = module.causal_softmax(scores, shift, sinks, 5, window, 3, with_sinks)
        last = mx.array([30, 36])[:, None, None, None] + (mx.arange(15) % 5)[:, None]
        slot = mx.arange(41)
        seen = (slot <= last) & ((slot > last - window) if window else True)
        logits = mx.where(seen, scores, -mx.inf)
        if with_sinks:
            column = mx.broadcast_to(sinks.reshape(1, 2, 3, 1, 1), (2, 2, 3, 5, 1))
            logits = mx.concatenate([column.reshape(2, 2, 15, 1), logits], axis=-1)
        want = mx.softmax(logits, axis=-1)[..., 1:] if with_sinks else mx.softmax(logits, axis=-1)
        if not mx.allclose(got, want, atol=1e-5, rtol=1e-4).item():
            return f"causal softmax self-check failed (window {window}, sinks {with_sinks})"
    logits = 8 * mx.random.normal((3, 1003), key=mx.random.key(3))
    want = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if not mx.allclose(module.log_softmax(logits), want, atol=1e-4, rtol=1e-5).item():
        return "log-softmax self-check failed"
    return None


def native_status() -> NativeStatus:
    """Whether the native kernels are in use, and why (decided once)."""
    global _module, _status
    if _status is not None:
        return _status
    if os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no"):
        _status = NativeStatus(False, f"{ENV}={os.environ[ENV]} (turned off)")
        return _status
    try:
        module = importlib.import_module(f"{__package__}._native")
    except ImportError as e:
        _status = NativeStatus(
            False, f"mlx_kvq._native not built ({e}): quantized decode uses mx.quantized_matmul"
        )
        return _status
    if module.built_for_mlx != mx.__version__:
        _status = NativeStatus(
            False,
            f"mlx_kvq._native was built for MLX {module.built_for_mlx}, running "
            f"{mx.__version__}: reinstall mlx-kvq (pip install -e .) to rebuild it",
        )
        return _status
    try:
        with mx.stream(mx.cpu):
            problem = _self_check(module)
    except (TypeError, ValueError, RuntimeError, AttributeError) as e:
        # e.g. a nanobind release other than mlx.core's: MLX arrays are not
        # recognised as arguments (TypeError)
        problem = f"self-check raised {type(e).__name__}: {e}"
    if problem:
        _status = NativeStatus(False, f"mlx_kvq._native {problem}: not used")
        return _status
    _module = module
    _status = NativeStatus(True, f"mlx_kvq._native built for MLX {module.built_for_mlx}")
    return _status


def packed_scores(q: mx.array, k: QuantizedKV) -> mx.array:
    """float32 `q @ K^T` (B, H, M, N) from packed K (B, H, N, D), reading each
    packed row once for all M rows; K may be a strided view of a cache buffer."""
    return _module.packed_scores(q, k.data, k.scales, k.biases, k.group_size, k.bits)


def channel_scores(q: mx.array, k: QuantizedKV) -> mx.array:
    """float32 `q @ K^T` (B, H, M, N) from per-channel packed K (channel-major,
    (B, H, D, N * bits / 32), a scale per channel per group of tokens)."""
    return _module.channel_scores(q, k.data, k.scales, k.biases, k.group_size, k.bits)


def packed_weighted(p: mx.array, v: QuantizedKV) -> mx.array:
    """float32 `p @ V` (B, H, M, D) from packed V (B, H, N, D)."""
    return _module.packed_weighted(p, v.data, v.scales, v.biases, v.group_size, v.bits)


def causal_softmax(
    scores: mx.array, shift: tuple[int, ...], window: int, n_rep: int, sinks: mx.array | None
) -> mx.array:
    """float32 softmax of `scores` (B, H, n_rep * rows, S) where query row r
    (index m = r % rows) sees the key slots (shift[b] + m - window, shift[b] + m]
    (window 0: every earlier slot); `sinks`: one logit per query head, or None."""
    rows = scores.shape[2] // n_rep
    has_sinks = sinks is not None
    return _module.causal_softmax(
        scores, mx.array(shift, dtype=mx.int32),
        sinks.reshape(-1) if has_sinks else mx.zeros((1,)),
        rows, window, n_rep, has_sinks,
    )  # fmt: skip


def log_softmax(x: mx.array) -> mx.array:
    """float32 log-softmax of each row of `x` (N, V)."""
    return _module.log_softmax(x)


def paged_attention(
    q: mx.array, keys: PagedKV, values: PagedKV, L: int, sinks: mx.array | None
) -> mx.array:
    """float32 attention of `q` (B, H_kv, n_rep * L, Dk), scaled and in the keys'
    basis, over block pools (packed, or both raw) read in place through the
    rows' block tables: each row reads only its own blocks (see `PagedKV`).
    `sinks`: one logit per query head, or None."""
    k, v = keys.pool, values.pool
    if keys.quantized:
        kparts, kbits, kgs = (k.data, k.scales, k.biases), k.bits, k.group_size
        vparts, vbits, vgs = (v.data, v.scales, v.biases), v.bits, v.group_size
    else:  # raw rows: bits 0, the pool in place of its parts
        kparts, kbits, kgs = (k, k, k), 0, 0
        vparts, vbits, vgs = (v, v, v), 0, 0
    has_sinks = sinks is not None
    return _module.paged_attention(
        q, *kparts, *vparts,
        mx.array(keys.tables), mx.array(keys.bases, dtype=mx.int32),
        mx.array(keys.ends, dtype=mx.int32),
        sinks.reshape(-1) if has_sinks else mx.zeros((1,)),
        L, keys.window or 0, kbits, kgs, vbits, vgs, has_sinks,
    )  # fmt: skip


def paged_split_attention(
    q: mx.array, qb: mx.array, keys: PagedSplitKV, values: PagedSplitKV, L: int,
    sinks: mx.array | None,
) -> mx.array:  # fmt: skip
    """float32 attention of `q` (B, H_kv, n_rep * L, Dk), scaled, over
    split-layout rows in blocks (both pools packed): the blocks read in place
    through the tables with `qb` (`q` in the body's basis), each row's exact
    sinks and tail with `q`. With rotated values the body's share comes apart,
    (B, H_kv, M, 2 * Dv): [exact share, body share in the rotated basis]."""
    k, v = keys.pool, values.pool
    H, Dk, Dv = q.shape[1], q.shape[3], v.scales.shape[3] * v.group_size
    sd, B = k.scales.dtype, len(keys.ends)
    exact = []
    for parts in zip(keys.sinks, values.sinks, strict=True):
        for a, d in zip(parts, (Dk, Dv), strict=True):
            exact.append(mx.zeros((1, H, 0, d), sd) if a is None else a)
    for a, d in ((keys.tail, Dk), (values.tail, Dv)):
        exact.append(mx.zeros((B, H, 0, d), sd) if a is None else a)
    has_sinks = sinks is not None
    return _module.paged_split_attention(
        q, qb, k.data, k.scales, k.biases, v.data, v.scales, v.biases,
        mx.array(keys.tables), mx.array(keys.blocks, dtype=mx.int32),
        mx.array(keys.ends, dtype=mx.int32),
        sinks.reshape(-1) if has_sinks else mx.zeros((1,)), exact,
        L, keys.block_size, k.bits, k.group_size, v.bits, v.group_size,
        k.per_channel, has_sinks, v.rotated,
    )  # fmt: skip

"""Attention alone: ours, mlx-lm's quantized attention, and mx.fast.

One cell is (dtype, cached tokens, queries). Keys, values and queries are
random; the quantized K/V are made once per cell (ours through `Store`, as
our caches hold them; mlx-lm's with `mx.quantize`, as its
`QuantizedKVCache` holds them) and the three candidates are timed in the
same rounds. Errors are the max abs difference from float32 attention on
the original (unquantized) K/V.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .settings import BenchSettings
from .timing import Stat, interleave, timed

CANDIDATES = ("ours", "mlx_lm", "unquantized")


def _mlx_lm_quantized():
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    return quantized_scaled_dot_product_attention


def run(settings: BenchSettings, log=print) -> list[dict]:
    from ..attention import quantized_attention
    from ..config import QuantSpec
    from ..quant import Store

    mlx_lm_attention = _mlx_lm_quantized()
    n_q, n_kv = settings.attn_heads
    D = settings.attn_head_dim
    bits, gs = settings.attn_bits, settings.group_size
    scale = 1.0 / math.sqrt(D)
    rows: list[dict] = []
    for dtype_name in settings.dtypes:
        dtype = getattr(mx, dtype_name)
        last_mlx_lm: dict[int, tuple[int, float]] = {}  # queries -> (context, seconds per call)
        decode_mlx_lm: dict[int, float] = {}  # context -> seconds per decode call
        for S in settings.attn_contexts:
            mx.random.seed(settings.seed)
            k = mx.random.normal((1, n_kv, S, D)).astype(dtype)
            v = mx.random.normal((1, n_kv, S, D)).astype(dtype)
            ours_k = Store.encode(k, QuantSpec(bits, gs)).fetch()
            ours_v = Store.encode(v, QuantSpec(bits, gs)).fetch()
            lm_k = mx.quantize(k, group_size=gs, bits=bits)
            lm_v = mx.quantize(v, group_size=gs, bits=bits)
            mx.eval(k, v, ours_k.data, ours_k.scales, ours_k.biases, ours_v.data,
                    ours_v.scales, ours_v.biases, lm_k, lm_v)  # fmt: skip
            for L in settings.attn_queries:
                q = mx.random.normal((1, n_q, L, D)).astype(dtype)
                mask = "causal" if L > 1 else None
                mx.eval(q)
                fns = _calls(
                    quantized_attention,
                    mlx_lm_attention,
                    q,
                    (ours_k, ours_v),
                    (lm_k, lm_v),
                    (k, v),
                    scale,
                    mask,
                    gs,
                    bits,
                )
                # mlx-lm's half-precision quantized matmul is very slow on the
                # CPU: predict each call from the last measured one (time grows
                # linearly with cached tokens and queries) and skip past a cap.
                predicted = None
                if L in last_mlx_lm:
                    s0, t0 = last_mlx_lm[L]
                    predicted = t0 * S / s0
                elif L > 1 and S in decode_mlx_lm:
                    predicted = decode_mlx_lm[S] * L
                skip_mlx_lm = predicted is not None and predicted > settings.mlx_lm_max_call_s
                candidates = {n: (lambda f=f: timed(f)) for n, f in fns.items()}
                if skip_mlx_lm:
                    del candidates["mlx_lm"]
                stats = interleave(
                    candidates, settings.attn_repeats, warmup=1, budget_s=settings.attn_budget_s
                )
                if skip_mlx_lm:
                    stats["mlx_lm"] = Stat(
                        skipped=f"predicted {predicted:.0f} s per call > "
                        f"{settings.mlx_lm_max_call_s:.0f} s cap",
                        predicted=predicted,
                    )
                else:
                    last_mlx_lm[L] = (S, stats["mlx_lm"].median)
                    if L == 1:
                        decode_mlx_lm[S] = stats["mlx_lm"].median
                # errors against float32 attention on the original K/V
                ref = mx.fast.scaled_dot_product_attention(
                    q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32),
                    scale=scale, mask=mask,
                )  # fmt: skip
                outs = {"ours": fns["ours"](), "unquantized": fns["unquantized"]()}
                if not skip_mlx_lm:
                    outs["mlx_lm"] = fns["mlx_lm"]()
                err = {
                    n: mx.max(mx.abs(o.astype(mx.float32) - ref)).item() for n, o in outs.items()
                }
                if "mlx_lm" in outs:
                    d = outs["ours"].astype(mx.float32) - outs["mlx_lm"].astype(mx.float32)
                    err["ours_vs_mlx_lm"] = mx.max(mx.abs(d)).item()
                row = {
                    "dtype": dtype_name, "context": S, "queries": L,
                    "seconds": {n: s.to_dict() for n, s in stats.items()},
                    "max_abs_error": err,
                    "speedup_vs_mlx_lm": _ratio(stats["mlx_lm"], stats["ours"]),
                    "speedup_vs_mlx_lm_predicted": (
                        predicted / stats["ours"].median if skip_mlx_lm else None
                    ),
                    "speedup_vs_unquantized": _ratio(stats["unquantized"], stats["ours"]),
                }  # fmt: skip
                rows.append(row)
                log(
                    f"  attention {dtype_name:8s} S={S:6d} L={L:4d}: "
                    + "  ".join(f"{n} {_ms(stats[n])}" for n in CANDIDATES)
                    + f"  ours vs mlx-lm {_x(row['speedup_vs_mlx_lm'])}"
                    + f" vs unquantized {_x(row['speedup_vs_unquantized'])}"
                    + f"  err {err['ours']:.3g}"
                )
    return rows


def _calls(ours, mlx_lm, q, packed, lm_packed, plain, scale, mask, gs, bits) -> dict:
    return {
        "ours": lambda: ours(q, *packed, scale, mask),
        "mlx_lm": lambda: mlx_lm(q, *lm_packed, scale, mask, gs, bits),
        "unquantized": lambda: mx.fast.scaled_dot_product_attention(
            q, *plain, scale=scale, mask=mask
        ),
    }


def _ratio(slow: Stat, fast: Stat) -> float | None:
    if not (slow.ok and fast.ok) or fast.median <= 0:
        return None
    return slow.median / fast.median


def _ms(s: Stat) -> str:
    return f"{s.median * 1e3:.1f}ms" if s.ok else "skipped"


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"

"""KV bytes held against theory, and peak memory during a long decode.

Theory for affine group quantization with 16-bit scales and biases: each
stored element costs bits/8 + 4/group_size bytes; unquantized, the dtype's
size. Caches allocate in 256-token steps, so bytes are compared per held
*slot* (allocated token position), and also reported per token.
"""

from __future__ import annotations

import mlx.core as mx

from .model_bench import CacheMaker, Decoder, build_model, fill, free, kv_shapes, label
from .settings import BenchSettings


def _slots(c) -> int:
    keys = getattr(c, "keys", None)
    if keys is None:
        return 0
    return int(keys.length if hasattr(keys, "length") else keys.shape[2])


def theory_bytes_per_element(bits: int | None, group_size: int, dtype: mx.Dtype) -> float:
    if bits is None:
        return float(dtype.size)
    return bits / 8 + 4 / group_size


def layer_table(
    caches: list, shapes, bits: int | None, group_size: int, dtype: mx.Dtype
) -> list[dict]:
    from ..caches import cache_report

    report = cache_report(caches)
    rows = []
    for c, entry, (h, dk, dv) in zip(caches, report, shapes, strict=True):
        slots = _slots(c)
        per_slot = h * (dk + dv)
        measured = entry["nbytes"] / (slots * per_slot) if slots else 0.0
        theory = theory_bytes_per_element(bits if entry["quantized"] else None, group_size, dtype)
        rows.append({
            "kind": entry["kind"], "quantized": bool(entry["quantized"]),
            "nbytes": int(entry["nbytes"]), "tokens": int(entry["tokens"]), "slots": slots,
            "bytes_per_token": entry["nbytes"] / entry["tokens"] if entry["tokens"] else 0.0,
            "bytes_per_slot_element": measured, "theory_bytes_per_element": theory,
            "deviation": measured / theory - 1 if theory else 0.0,
        })  # fmt: skip
    return rows


def by_kind(layers: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in layers:
        e = out.setdefault(r["kind"], {"layers": 0, "nbytes": 0, "tokens": 0, "max_deviation": 0.0})
        e["layers"] += 1
        e["nbytes"] += r["nbytes"]
        e["tokens"] = max(e["tokens"], r["tokens"])
        e["bytes_per_token_per_layer"] = (
            e["nbytes"] / e["layers"] / e["tokens"] if e["tokens"] else 0
        )
        e["max_deviation"] = max(e["max_deviation"], abs(r["deviation"]))
        e["quantized"] = r["quantized"]
    return out


def run(settings: BenchSettings, log=print) -> dict:
    config = settings.resolved_model_config()
    dtype = getattr(mx, settings.memory_dtype)
    gs = settings.group_size
    configs = [None, *settings.bits]
    model = build_model(config, dtype, settings.seed)
    shapes = kv_shapes(model)
    make = CacheMaker(model, gs)
    out: dict = {"dtype": settings.memory_dtype, "group_size": gs, "contexts": [], "peak": []}
    for ctx in sorted(set(settings.contexts) | {settings.memory_context}):
        for b in configs:
            caches = fill(make(b), ctx, shapes, dtype, settings.seed)
            layers = layer_table(caches, shapes, b, gs, dtype)
            kinds = by_kind(layers)
            out["contexts"].append({
                "context": ctx, "config": label(b), "bits": b,
                "kv_bytes": sum(r["nbytes"] for r in layers), "by_kind": kinds,
                "layers": layers,
                "max_quantized_deviation": max(
                    (abs(r["deviation"]) for r in layers if r["quantized"]), default=None
                ),
            })  # fmt: skip
            del caches
            free()
        line = "  ".join(
            f"{e['config']} {e['kv_bytes'] / 2**20:.2f} MiB"
            for e in out["contexts"] if e["context"] == ctx
        )  # fmt: skip
        log(f"  memory {settings.memory_dtype} ctx={ctx:6d}: KV held {line}")

    # peak memory during decode at the long context, one configuration at a time
    ctx = settings.memory_context
    h, dk, dv = next(s for s, kind in zip(shapes, _kinds(model), strict=True) if kind == "full")
    full_layer_bytes = h * (dk + dv) * ctx * dtype.size
    for b in configs:
        free()
        caches = fill(make(b), ctx, shapes, dtype, settings.seed)
        dec = Decoder(model, caches)
        dec.step()  # the first step may grow buffers by a 256-token step
        free()
        active = mx.get_active_memory()
        mx.reset_peak_memory()
        for _ in range(settings.memory_decode_tokens):
            dec.step()
        peak = mx.get_peak_memory()
        kv = sum(r["nbytes"] for r in layer_table(caches, shapes, b, gs, dtype))
        out["peak"].append({
            "config": label(b), "bits": b, "context": ctx,
            "active_before": active, "peak": peak, "transient": peak - active,
            "kv_bytes": kv, "full_layer_unquantized_kv_bytes": full_layer_bytes,
        })  # fmt: skip
        log(
            f"  peak {label(b):12s} ctx={ctx}: peak {peak / 2**20:.1f} MiB "
            f"(held before {active / 2**20:.1f} MiB, transient {(peak - active) / 2**20:.2f} MiB; "
            f"one full layer's unquantized K/V {full_layer_bytes / 2**20:.2f} MiB)"
        )
        del dec, caches
    base = next(p for p in out["peak"] if p["bits"] is None)
    for p in out["peak"]:
        p["peak_ratio"] = p["peak"] / base["peak"]
    out["params_bytes"] = sum(v.nbytes for v in _params(model))
    del model, make
    free()
    return out


def _kinds(model) -> list[str]:
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    return ["full" if type(c) is KVCache else "other" for c in make_prompt_cache(model)]


def _params(model):
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(model.parameters())]

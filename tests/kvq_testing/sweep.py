"""The architecture sweep: every KV-bearing mlx-lm architecture, quantized.

For each tiny configuration in `archs.TINY_CONFIGS` it plans 4-bit KV
caches, runs a prefill (windows wrap) and decode steps through them, and
checks that every KV layer is quantized, every sliding layer stays bounded,
and the plan's bytes per token match the bytes actually held (per held token
slot, within 5%). An architecture that cannot be supported must be refused by
the plan with `UnsupportedKVConfig`; anything failing later is a bug.

`python scripts/arch_sweep.py` regenerates docs/architectures.md from it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_kvq.caches import KVQCache, cache_report
from mlx_kvq.config import KVConfig, UnsupportedKVConfig
from mlx_kvq.distributed.loading import model_module, replicates_kv_heads, sharding_support
from mlx_kvq.plan import KV_KINDS, plan_kv

from . import archs

SUPPORTED = "supported"
REFUSED = "refused at plan time"
FAILED = "FAILED after planning"


@dataclass
class SweepResult:
    name: str
    verdict: str
    kinds: str = ""
    hand_out: str = ""
    reason: str = ""
    checks: dict = field(default_factory=dict)
    seconds: float = 0.0
    module: str = ""
    tensor: bool = False  # mlx-lm can shard it by heads (shard())
    pipeline: bool = False  # mlx-lm can split it by layers (model.pipeline())


def _leaves(cache: list) -> list:
    out = []
    for c in cache:
        out.extend(c.caches if hasattr(c, "caches") and not isinstance(c, KVQCache) else [c])
    return out


def _held_slots(c) -> int:
    return c.key_store.length if c.key_store is not None else 0


def sweep_one(name: str, bits: int = 4) -> SweepResult:
    """Plan, run and check one architecture."""
    t0 = time.perf_counter()
    model = archs.build_model(name)
    tensor, pipeline = sharding_support(model)
    where = {"module": model_module(model), "tensor": tensor, "pipeline": pipeline}
    try:
        plan = plan_kv(model, KVConfig(bits=bits))
    except UnsupportedKVConfig as e:
        return SweepResult(name, REFUSED, reason=str(e), seconds=time.perf_counter() - t0, **where)
    kinds = ", ".join(sorted(plan.kinds))
    hand_out = ",".join(sorted({p.hand_out for p in plan.kv_layers})) or "-"
    result = SweepResult(name, SUPPORTED, kinds, hand_out, **where)
    if plan.max_batch is not None:
        result.reason = (
            f"serves {plan.max_batch} sequence at a time (its positions are one per batch)"
        )
    if any(p.kind == "unused" for p in plan.layers):
        result.reason = "not served with continuous batching: a cache slot is never written"
    try:
        cache = plan.make_cache()
        logits = archs.run_forward(model, cache=cache, return_logits=True)[1]
        mx.eval(logits)
        if not archs.logits_finite(model, logits):
            raise AssertionError("non-finite logits")
        report = cache_report(cache)
        kv_reports = [r for r in report if r["kind"] in KV_KINDS]
        leaves = [c for c in _leaves(cache) if isinstance(c, KVQCache)]
        layer_plans = plan.kv_layers
        checks = {
            "kv_layers": len(layer_plans),
            "quantized": sum(r["quantized"] for r in kv_reports),
        }
        if checks["quantized"] != len(layer_plans) or len(leaves) != len(layer_plans):
            raise AssertionError(f"{checks['quantized']}/{len(layer_plans)} KV layers quantized")
        worst = 0.0
        for p, c in zip(layer_plans, leaves, strict=True):
            # A chunked cache trims in front of the next pass, so it may hold
            # the window plus the last step's token.
            bound = p.window + (1 if p.kind == "chunked" else 0) if p.window else None
            if bound is not None and c.size() > bound:
                raise AssertionError(f"slot {p.slot} holds {c.size()} tokens, window {p.window}")
            slots = _held_slots(c)
            if slots and p.bytes_per_row() > 0:
                per_slot = c.nbytes / slots
                if c.nbytes == 0:
                    continue
                worst = max(worst, abs(per_slot / p.bytes_per_row() - 1))
        checks["bytes_per_token_error"] = round(worst, 4)
        if worst > 0.05:
            raise AssertionError(f"plan bytes/token off by {worst:.1%} from bytes held")
        result.checks = checks
    except Exception as e:  # noqa: BLE001 - a failure after planning is the finding
        result.verdict = FAILED
        result.reason = f"{type(e).__name__}: {e}"
    result.seconds = time.perf_counter() - t0
    return result


# What docs/architectures.md says about deepseek_v41's greedy flips at 8 bits
# (measured by scripts/layer_cache_margins.py, checked by
# tests/test_layer_cache_exact.py).
DEEPSEEK_V41_NOTE = [
    "",
    "## deepseek_v41 at 8 bits: the model's own rounding, not the cache",
    "",
    "On the tiny random weights, 8-bit KV changes deepseek_v41's greedy tokens for some",
    "weight seeds, where every other architecture agrees (a first flip changes every",
    "later token, since the decode feeds the token back). The cache is exact:",
    "",
    "- attending over its quantized fields equals attending over their dequantized rows",
    "  bit for bit (mlx-lm's `LayerCache` holding each field quantized then dequantized",
    "  at write time, at 8 bits and with the default 8-bit windows, 4-bit rows and",
    "  Hadamard rotation); each field (window, compressed rows, index keys) is within the",
    "  quantization bound of the exact rows at every write (one step, as `mx.quantize`",
    "  may clip an edge by a step, plus the 16-bit scales' rounding); below",
    "  `quantized_kv_start` the logits equal mlx-lm's (`tests/test_layer_cache_exact.py`).",
    "- The model rounds its activations to FP8 (window rows) and FP4 (compressed rows,",
    "  index keys and queries) itself, so its fields hold values that bfloat16 keeps",
    "  exactly, and a small perturbation moves values across a rounding boundary, a jump",
    "  the next layers carry to the logits. Every flip has a top-2 margin below the logit",
    "  change at that position (a tie), and with that rounding off the same seeds agree.",
    "",
    "`python scripts/layer_cache_margins.py` (weight seeds 0-7; greedy: tokens equal",
    "to the unquantized run's, of 9; teacher-forced: 10 positions per seed; the",
    "window's 8-bit error scaled by t; a position's change is its largest |logit change|,",
    "the table gives the median over positions):",
    "",
    "| model | greedy tokens equal, per seed | teacher-forced flips | median change | median change, the window's error alone x0.01 / x0.1 / x1 |",
    "|---|---|---|---|---|",
    "| deepseek_v41 | 1, 1, 3, 9, 0, 9, 9, 8 | 9 of 80 (all ties) | 0.059 | 0.0051 / 0.0173 / 0.0571 |",
    "| deepseek_v41, its FP8/FP4 rounding off | 9 for every seed | 1 of 80 (a tie) | 0.016 | 0.0001 / 0.0013 / 0.0142 |",
    "| llama | 9 for every seed | 0 of 80 | 0.009 | |",
    "",
    "With the rounding on, a hundredth of the 8-bit error moves the logits 50 times more",
    "than with it off, and the change does not scale with the error: jumps, not a",
    "slope. Storing these fields in the model's own FP8 / FP4 codes (an exponent per",
    "block of 32 or 16) would keep them exact at no more bits than the affine groups",
    "(8.25 against 8.5 bits per value for the window, 4.5 against 4.5 for the compressed",
    "rows); mlx-kvq does not do that yet.",
]


def markdown(results: list[SweepResult], skipped: dict[str, str]) -> str:
    """docs/architectures.md."""
    n_ok = sum(r.verdict == SUPPORTED for r in results)
    refused = len(results) - n_ok
    lines = [
        "# Architectures",
        "",
        "Generated by `python scripts/arch_sweep.py` (the same checks run in",
        "`tests/test_arch_sweep.py`). Every architecture module of mlx-lm 0.32.2 that keeps",
        "a key/value cache is built tiny with random weights (`tests/kvq_testing/archs.py`),",
        "planned with `--kv-bits 4`, and run through a 40-token prefill in two chunks (sliding",
        "windows of 8 wrap) and 5 decode steps with the planned caches. A row passes when",
        "every KV leaf is quantized (the sparse-attention indexers' keys included), every",
        "sliding layer stays within its window, and the plan's bytes per stored row match the",
        "bytes held per row slot within 5%.",
        "",
        f"**{n_ok} of {len(results)} configurations supported**"
        + (
            "; the rest are refused by the plan at load time (`UnsupportedKVConfig`), never later."
            if refused
            else "."
        ),
        "",
        "Layer kinds: `full`, `sliding` (a window), `chunked` (llama4), `indexer` (a sparse",
        "attention indexer's keys: deepseek_v32, glm_moe_dsa, minimax_m3_vl, deepseek_v41;",
        "keys only), `compressed` (deepseek_v41: one pooled row per `ratio` tokens), `state`",
        "(recurrent or working state, not KV: reported, never quantized), `shared` (layers that",
        "reuse an earlier layer's K/V).",
        "",
        "K/V hand-out: `packed` layers give quantized attention the packed tensors;",
        "`dequantized` layers (model code that needs arrays: latent attention, sparse",
        "indexers, attention that bypasses mlx-lm's function) keep quantized storage and get",
        "a transient full-precision copy during their attention.",
        "",
        "| architecture | layer kinds | K/V hand-out | verdict | notes |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        note = r.reason.replace("|", "/").replace("\n", " ")[:160]
        lines.append(
            f"| {r.name} | {r.kinds or '-'} | {r.hand_out or '-'} | {r.verdict} | {note} |"
        )
    lines += DEEPSEEK_V41_NOTE
    lines += _distributed(results)
    lines += [
        "",
        "## Modules without a KV cache or not runnable here",
        "",
        "| module | reason |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in sorted(skipped.items())]
    return "\n".join(lines) + "\n"


def _distributed(results: list[SweepResult]) -> list[str]:
    """The distributed section: which sharding each architecture module has."""
    lines = [
        "",
        "## Distributed (under `mlx.launch`)",
        "",
        "What mlx-lm 0.32.2 can shard, per module, and what mlx-kvq adds (docs/distributed.md).",
        "Checked on every rank from config.json before any weight is read",
        "(`mlx_kvq/distributed/planning.py:check_sharding`); what cannot run exits 2 with the",
        "reason and the alternatives, never later.",
        "",
        "- **tensor parallel** (default): every rank holds every layer and `1/N` of the heads,",
        "  so `1/N` of each layer's KV heads. With fewer KV heads than ranks (or a count `N`",
        "  does not divide), the modules marked *replicated* get each KV head repeated before",
        "  mlx-lm's `shard()` so every rank holds whole heads (as vLLM does; each rank then",
        "  holds the KV bytes of its copies); other modules run when their own `shard()` keeps",
        "  every KV head on each rank (latent-attention caches, deepseek_v41's rows), and are",
        "  refused before loading otherwise.",
        "- **pipeline parallel** (`--pipeline`): rank `r` holds a run of whole layers and their",
        "  caches; needs mlx-lm's `pipeline()` and at least one layer per rank.",
        "  deepseek_v41 with `--kv-bits` is refused (its stages pass compressed KV through",
        "  the first layer's cache).",
        "",
        "| module | tensor parallel | fewer KV heads than ranks | pipeline parallel |",
        "|---|---|---|---|",
    ]
    seen: dict[str, SweepResult] = {}
    for r in results:
        seen.setdefault(r.module, r)
    neither = sorted(m for m, r in seen.items() if m and not (r.tensor or r.pipeline))
    for module, r in sorted(seen.items()):
        if not r.module or module in neither:
            continue
        if not r.tensor:
            heads = "-"
        elif replicates_kv_heads(module):
            heads = "replicated"
        else:
            heads = "if its shard() keeps them whole, else refused"
        lines.append(
            f"| {module} | {'yes' if r.tensor else 'no'} | {heads} | "
            f"{'yes' if r.pipeline else 'no'} |"
        )
    lines += [
        "",
        f"Neither mode in mlx-lm ({len(neither)} modules; `mlx.launch` refuses them before",
        f"loading, they run on one machine): {', '.join(neither)}.",
    ]
    return lines

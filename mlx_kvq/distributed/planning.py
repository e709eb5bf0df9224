"""The KV plan on every rank, validated together before anything is served.

Each rank plans its own caches (its heads, or its layers) with the same
`plan_kv` as a single process, then all ranks exchange a status: if any rank
cannot honour the plan, every rank raises the same `UnsupportedKVConfig`
naming the failing ranks, so the whole group stops at startup.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..caches import cache_report
from ..config import KVConfig, UnsupportedKVConfig
from ..mlx_lm_internals import local_model
from ..model_facts import declared as declared_facts
from ..plan import KVPlan, model_from_config, model_type_of, plan_kv
from .group import gather_json, world
from .loading import (
    MODEL_KEEPS,
    REPLICATED,
    SPLIT,
    Shard,
    TensorLayout,
    model_module,
    replicate_kv_heads,
    replicates_kv_heads,
    sharding_support,
)


# -- before loading: can this group shard this model? ----------------------------
def config_path(path: str | Path) -> Path:
    """The local model directory holding config.json (mlx-lm downloads the
    json files of a Hugging Face repo first, as `sharded_load` does)."""
    return local_model(str(path), allow_patterns=["*.json", "*.py"])


def check_sharding(path: str | Path, pipeline: bool, group=None) -> TensorLayout | None:
    """Decide, from config.json alone (no weights), whether the group can
    shard this model, before anything is loaded; raise `UnsupportedKVConfig`
    (exit 2) with the reason and the alternatives otherwise.

    Pipeline: the model must have mlx-lm's `pipeline()` and at least one
    layer per rank. Tensor: the model must have `shard()`; then this rank's
    shard of the config-only model is planned lazily and its KV heads
    compared with the whole model's: each rank must hold 1/N of the heads,
    or whole heads (replicated by mlx-kvq for the modules whose facts declare `kv_heads`, or
    kept whole by the model's own `shard()`, as latent-attention caches are).
    Returns the `TensorLayout` (None in pipeline mode).
    """
    g = group or world()
    n = g.size()
    model = model_from_config(config_path(path))
    model_type = model_type_of(model)
    tensor, pipelined = sharding_support(model)
    if pipeline:
        if not pipelined:
            fix = "drop --pipeline (tensor parallel)" if tensor else "run it on one machine"
            raise UnsupportedKVConfig(
                f"--pipeline: {model_type} cannot be split by layers: its mlx-lm model has no "
                f"pipeline() (mlx-lm's sharded_load would refuse while loading); {fix}"
            )
        layers = len(model.model.layers)
        if layers < n:
            raise UnsupportedKVConfig(
                f"--pipeline: {model_type} has {layers} layers, fewer than the {n} ranks "
                f"(each rank needs at least one); use at most {layers} ranks"
            )
        return None
    if not tensor:
        fix = "use --pipeline" if pipelined else "run it on one machine"
        raise UnsupportedKVConfig(
            f"{model_type} has no tensor parallelism in mlx-lm (its model has no shard()); {fix}"
        )
    whole = plan_kv(model, KVConfig()).kv_layers
    heads = tuple(p.kv_heads for p in whole)
    replicate = any(h % n for h in heads) and replicates_kv_heads(model_module(model))
    local, copies, problem = None, (), None
    try:
        sharded = model_from_config(config_path(path))
        if replicate:
            copies = tuple(replicate_kv_heads(sharded, n))
        sharded.shard(g)
        local = plan_kv(sharded, KVConfig()).kv_layers
    except Exception as e:  # noqa: BLE001 - the model's own shard() failing is the finding
        problem = f"sharding it fails: {type(e).__name__}: {e}"
    how = REPLICATED if replicate else SPLIT
    if local is not None:
        for p, q in zip(whole, local, strict=True):
            expected = p.kv_heads * (kv_copies(copies, p) if replicate else 1) / n
            if (q.key_dim, q.value_dim) != (p.key_dim, p.value_dim):
                problem = (
                    f"a rank's KV heads at cache slot {p.slot} would have dims "
                    f"{q.key_dim}/{q.value_dim} instead of {p.key_dim}/{p.value_dim}"
                )
            elif q.kv_heads == p.kv_heads and n > 1 and not replicate:
                how = MODEL_KEEPS
            elif q.kv_heads != expected:
                problem = (
                    f"a rank would hold {q.kv_heads} KV heads at cache slot {p.slot} "
                    f"instead of {expected:g}"
                )
            if problem:
                break
    if problem is not None:
        raise UnsupportedKVConfig(_heads_message(model_type, model, heads, n, problem, pipelined))
    return TensorLayout(model_type, n, heads, tuple(q.kv_heads for q in local), how, copies)


def kv_copies(copies: tuple[int, ...], p) -> int:
    """Copies of the KV heads of the layer holding cache slot `p.slot`."""
    return copies[p.slot] if p.slot < len(copies) else 1


def _heads_message(model_type, model, heads, n, problem, pipelined) -> str:
    counts = "/".join(map(str, sorted(set(heads)))) or "no"
    common = math.gcd(*heads) if heads else 0
    sizes = [d for d in range(2, common + 1) if common % d == 0]
    alternatives = []
    if pipelined:
        alternatives.append("--pipeline (each rank holds whole layers)")
    if sizes:
        alternatives.append(f"a group of {' or '.join(map(str, sizes))} ranks")
    alternatives.append("one machine")
    declared = ", ".join(declared_facts("kv_heads"))
    return (
        f"{model_type} has {counts} KV head(s) per layer, which tensor parallelism over {n} "
        f"ranks cannot split ({problem}); mlx-kvq replicates KV heads across ranks only for "
        f"{declared}. Alternatives: {'; '.join(alternatives)}"
    )


def rank_info(plan: KVPlan, shard: Shard) -> dict[str, Any]:
    """What one rank's plan costs, for the group report."""
    kv = plan.kv_layers
    return {
        "rank": shard.rank,
        "mode": shard.mode,
        "layers": shard.layers,
        "cache_slots": len(plan.layers),
        "kv_layers": len(kv),
        "quantized_layers": sum(p.quantized for p in kv),
        "kv_heads": sorted({p.kv_heads for p in kv}),
        "bytes_per_token": plan.bytes_per_token,
        "summary": plan.summary(),
        "model_type": plan.model_type,
        "kv": plan.config.describe(),
        "kv_layout": shard.kv_layout,
    }


def plan_on_every_rank(
    model: Any,
    kv_config: KVConfig,
    shard: Shard,
    *,
    batch: bool = False,
    checks: Callable[[KVPlan], None] | None = None,
    planner: Callable[..., KVPlan] | None = None,
) -> tuple[KVPlan, list[dict[str, Any]]]:
    """Plan this rank's caches and agree with the group.

    `checks(plan)` runs extra validation on each rank (batch path, warm-up
    length). Returns this rank's plan and every rank's `rank_info`; raises
    `UnsupportedKVConfig` on every rank when any rank failed, with the rank
    numbers and their messages.
    """
    plan, error = None, None
    planner = planner or plan_kv
    try:
        plan = planner(model, local_config(kv_config, shard), batch=batch)
        if checks is not None:
            checks(plan)
    except (UnsupportedKVConfig, ValueError) as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
        error = f"{type(e).__name__}: {e}"
    mine = {"ok": error is None, "error": error}
    if plan is not None and error is None:
        mine.update(rank_info(plan, shard))
    infos = gather_json(mine)
    failed = [(r, i["error"]) for r, i in enumerate(infos) if not i["ok"]]
    if failed:
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        ranks = ", ".join(str(r) for r, _ in failed)
        raise UnsupportedKVConfig(
            f"the KV plan cannot be honoured on rank{'s' if len(failed) > 1 else ''} "
            f"{ranks} of {len(infos)} ({shard.mode} parallel), so no rank serves: {detail}"
        )
    return plan, infos


def local_config(kv_config: KVConfig, shard: Shard) -> KVConfig:
    """`--kv-skip-layers` names model layers; a pipeline rank's slots start at 0."""
    if shard.mode != "pipeline" or not kv_config.skip_layers:
        return kv_config
    first, last = shard.first_layer, shard.first_layer + shard.num_layers
    local = tuple(s - first for s in kv_config.skip_layers if first <= s < last)
    return kv_config.with_(skip_layers=local)


def ranks_table(infos: list[dict[str, Any]], live_bytes: list[int] | None = None) -> str:
    """Per-rank lines of the plan report (and KV bytes held, when given)."""
    lines = []
    total = sum(i.get("bytes_per_token", 0) for i in infos)
    for r, i in enumerate(infos):
        heads = "/".join(map(str, i.get("kv_heads", []))) or "-"
        line = (
            f"  rank {r}: layers {i.get('layers')}, {i.get('quantized_layers')}/{i.get('kv_layers')} "
            f"KV layers quantized, {heads} KV heads per layer, {i.get('bytes_per_token')} KV bytes/token"
        )
        if live_bytes is not None:
            line += f", {live_bytes[r]} KV bytes held"
        lines.append(line)
    first = infos[0]
    head = (
        f"{first.get('model_type', 'model')} on {len(infos)} ranks ({first.get('mode')} parallel): "
        f"{first.get('kv', '')}, {total} KV bytes/token in all"
    )
    if first.get("kv_layout"):
        head += f"\n  {first['kv_layout']}"
    return "\n".join([head, *lines])


def gather_kv_bytes(caches: list | None) -> list[int]:
    """KV bytes each rank's caches hold (from `cache_report`), on every rank."""
    held = sum(int(r["nbytes"]) for r in cache_report(caches)) if caches else 0
    return [int(x) for x in gather_json(held)]


def group_plan_dict(plans: list[dict[str, Any]], infos: list[dict[str, Any]]) -> dict[str, Any]:
    """One plan report for the whole group from every rank's `KVPlan.to_dict()`.

    Tensor parallel: rank 0's layers (every rank has every layer) with the
    bytes per token summed over ranks. Pipeline parallel: the ranks' layers
    in model order, renumbered. Either way `ranks` lists what each rank holds.
    """
    mode = infos[0].get("mode")
    order = sorted(range(len(plans)), key=lambda r: _first_layer(infos[r]))
    out = dict(plans[0])
    if mode == "pipeline":
        layers = []
        for r in order:
            for layer in plans[r]["layers"]:
                layers.append({**layer, "slot": len(layers), "rank": r})
        out["layers"] = layers
        out["kv_layers"] = sum(p["kv_layers"] for p in plans)
        out["quantized_layers"] = sum(p["quantized_layers"] for p in plans)
        out["kinds"] = sorted({k for p in plans for k in p["kinds"]})
        windows = [p["max_window"] for p in plans if p.get("max_window")]
        out["max_window"] = max(windows) if windows else None
        out["partial"] = any(p["partial"] for p in plans)
        out["sinks"] = any(p["sinks"] for p in plans)
        out["notes"] = [n for p in plans for n in p.get("notes", [])]
    out["bytes_per_token"] = sum(p["bytes_per_token"] for p in plans)
    out["fp16_bytes_per_token"] = sum(p["fp16_bytes_per_token"] for p in plans)
    out["summary"] = (
        f"{out['model_type']} on {len(plans)} ranks ({mode} parallel): "
        f"{out['quantized_layers']}/{out['kv_layers']} KV layers quantized per "
        f"{'rank' if mode == 'tensor' else 'model'}, {out['bytes_per_token']} KV bytes/token in all "
        f"({' + '.join(str(p['bytes_per_token']) for p in plans)} by rank)"
    )
    out["ranks"] = infos
    out["distributed"] = {"mode": mode, "ranks": len(plans)}
    return out


def _first_layer(info: dict[str, Any]) -> int:
    layers = str(info.get("layers") or "0")
    return int(layers.split("-")[0])

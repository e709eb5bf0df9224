"""The KV plan on every rank, validated together before anything is served.

Each rank plans its own caches (its heads, or its layers) with the same
`plan_kv` as a single process, then all ranks exchange a status: if any rank
cannot honour the plan, every rank raises the same `UnsupportedKVConfig`
naming the failing ranks, so the whole group stops at startup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..caches import cache_report
from ..config import KVConfig, UnsupportedKVConfig
from ..plan import KVPlan, plan_kv
from .group import gather_json
from .loading import Shard


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

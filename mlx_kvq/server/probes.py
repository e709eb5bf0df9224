"""Probes and metrics: `/live`, `/health`, `/metrics`.

`/live` answers while the process runs; `/health` is 200 only once the
warm-up proved the quantized batch path works (503 while warming up, while
shutting down, or with the reason once failed); `/metrics` is Prometheus text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mlx_kvq.blas import blas_info
from mlx_kvq.engine import Engine, Status
from mlx_kvq.kernels import native_status

from .guards.draining import RETRY_AFTER_S
from .prometheus import make_registry
from .responses.store import AgentCounters
from .settings import ServerSettings


def probes_router(
    engine: Engine, settings: ServerSettings, counters: AgentCounters | None = None
) -> APIRouter:
    router = APIRouter()
    kinds = set(settings.plan.get("kinds", ())) or set(engine.plan.kinds)
    registry = make_registry(engine, kinds, counters)

    @router.get("/live")
    async def live() -> dict[str, str]:
        return {"status": "alive"}

    @router.get("/health")
    async def health() -> JSONResponse:
        state = engine.state()
        if state.status is Status.WARMING_UP:
            return JSONResponse({"status": state.status.value}, 503)
        if state.status is Status.DRAINING:
            body = {"status": state.status.value, "reason": state.reason}
            return JSONResponse(body, 503, headers={"Retry-After": str(RETRY_AFTER_S)})
        if state.status is Status.FAILED:
            return JSONResponse({"status": state.status.value, "reason": state.reason}, 503)
        body = {
            "status": "ok",
            "model": settings.model_id,
            "plan": plan_health(settings.plan),
            "kv_budget": engine.capacity.to_dict() if engine.capacity else None,
            "warmup": state.report,
            "blas": blas_info().to_dict(),
            "native_kernels": native_status().summary(),
        }
        if settings.adapter_path is not None:
            body["adapter_path"] = settings.adapter_path
        if engine.draft is not None:
            body["draft_model"] = {
                "model": engine.draft.name,
                "num_draft_tokens": engine.draft.num_draft_tokens,
                "plan": engine.draft.plan.summary(),
            }
        return JSONResponse(body)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router


def budget_status(engine: Engine) -> Callable[[], dict[str, Any] | None] | None:
    """The `budget` of `/status` (None without a budget): the budget, bytes
    the admitted sequences can hold before they next grow, bytes live
    sequences and the prompt cache hold, the sequences admitted, the requests
    waiting (preempted ones among them), preemptions and resumptions so far,
    and the capacity line."""
    if engine.budget is None:
        return None

    def status() -> dict[str, Any] | None:
        snapshot = engine.metrics.snapshot()
        b = snapshot.budget
        capacity = engine.capacity
        return {
            "bytes": engine.budget.budget,
            "reserved": b.reserved if b else 0,
            "live": b.live if b else 0,
            "prompt_cache": b.prompt_cache if b else 0,
            "admitted": b.admitted if b else 0,
            "waiting": snapshot.queue_depth,
            "preempted": snapshot.preempted,
            "preemptions": snapshot.preemptions,
            "resumptions": snapshot.resumptions,
            "capacity": capacity.line if capacity else None,
        }

    return status


def plan_health(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan as /health shows it: layers by kind, bits, KV bytes per token."""
    kinds: dict[str, int] = {}
    for layer in plan.get("layers", []):
        kinds[layer["kind"]] = kinds.get(layer["kind"], 0) + 1
    if plan.get("shared_layers"):
        kinds["shared"] = plan["shared_layers"]
    kv = plan.get("kv_config", {})
    keys = ("summary", "kv_layers", "quantized_layers", "partial", "sinks", "bytes_per_token",
            "fp16_bytes_per_token", "max_window", "max_context")  # fmt: skip
    out = {k: plan.get(k) for k in keys}
    out["layers_by_kind"] = kinds
    out["bits"] = {
        "keys": kv.get("key_bits") if kv.get("key_bits") is not None else kv.get("bits"),
        "values": kv.get("value_bits") if kv.get("value_bits") is not None else kv.get("bits"),
        "windows": kv.get("window_bits"),  # bounded layers' width (None: as keys/values)
        "group_size": kv.get("group_size"),
        "rotation": kv.get("rotation"),
        "quantized_kv_start": kv.get("quantized_start"),
    }
    return out

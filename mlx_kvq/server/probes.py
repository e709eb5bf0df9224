"""Probes and metrics: `/live`, `/health`, `/metrics`.

`/live` answers while the process runs; `/health` is 200 only once the
default model's warm-up proved the quantized batch path works (503 while
warming up, while shutting down, or with the reason once failed), and
`/health?model=NAME` says the same of one model (503 too while it is not in
memory); with several models, the body lists each (`models`). `/metrics` is
Prometheus text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from mlx_kvq.blas import blas_info
from mlx_kvq.engine import Engine, Status
from mlx_kvq.kernels import native_status
from mlx_kvq.residency import ModelState, ModelView

from .guards.draining import RETRY_AFTER_S
from .models import ModelDirectory
from .prometheus import make_registry
from .responses.store import AgentCounters


def probes_router(models: ModelDirectory, counters: AgentCounters | None = None) -> APIRouter:
    """`/live`, `/health` (`?model=NAME`: that model's readiness) and `/metrics`."""
    router = APIRouter()
    registry = make_registry(models.pool, counters=counters)

    @router.get("/live")
    async def live() -> dict[str, str]:
        return {"status": "alive"}

    @router.get("/health")
    async def health(model: str | None = None) -> JSONResponse:
        if model is None:
            name = models.pool.default
        else:
            name = models.pool.known(model)
            if name is None:
                return JSONResponse(
                    {"status": "not_found", "reason": f"no model '{model}' on this server"}, 404
                )
        reply = model_health(models.pool.view(name), model is None)
        if models.several:
            reply.body["models"] = {v.name: model_summary(v) for v in models.views()}
        return JSONResponse(reply.body, reply.status, headers=reply.headers)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router


@dataclass
class HealthReply:
    body: dict[str, Any]
    status: int = 200
    headers: dict[str, str] | None = None


def model_health(view: ModelView, server: bool) -> HealthReply:
    """One model's readiness: 200 once its warm-up passed, 503 while warming
    up, draining or failed (with the reason). A model not in memory is 503
    with where it is, except for the server's probe (`server`): a server whose
    default model was evicted for another serves, and loads it on request."""
    loaded = view.loaded
    if loaded is None:
        body = {"status": view.state.value, "model": view.name, "reason": view.reason}
        if server and view.state is not ModelState.FAILED:
            return HealthReply({**body, "status": "ok"})
        return HealthReply(body, 503)
    engine, settings = loaded.engine, loaded.served
    state = engine.state()
    if state.status is Status.WARMING_UP:
        return HealthReply({"status": state.status.value}, 503)
    if state.status is Status.DRAINING:
        body = {"status": state.status.value, "reason": state.reason}
        return HealthReply(body, 503, {"Retry-After": str(RETRY_AFTER_S)})
    if state.status is Status.FAILED:
        return HealthReply({"status": state.status.value, "reason": state.reason}, 503)
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
    return HealthReply(body)


def model_status(view: ModelView) -> str:
    """Where a model is, in one word: its engine's state while resident."""
    if view.loaded is not None and view.state is ModelState.READY:
        state = view.loaded.engine.state().status
        return "ready" if state is Status.READY else state.value
    return view.state.value


def model_summary(view: ModelView) -> dict[str, Any]:
    """One model as `/health` and `/status` list it: where it is, what it holds."""
    fp = view.footprint
    kv_bytes = None
    if view.loaded is not None:
        s = view.loaded.engine.metrics.snapshot()
        kv_bytes = int(sum(s.kv_bytes_by_kind.values())) + s.prompt_cache_bytes
    return {
        "status": model_status(view),
        "reason": view.reason,
        "default": view.default,
        "pinned": view.pinned,
        "declared": view.declared,
        "aliases": list(view.aliases),
        "location": view.location,
        "requests": view.requests,
        "loads": view.loads,
        "evictions": view.evictions,
        "load_seconds": None if view.load_seconds is None else round(view.load_seconds, 3),
        "weights_bytes": None if fp is None else fp.weights,
        "kv_budget_bytes": None if fp is None else fp.kv,
        "kv_bytes": kv_bytes,
    }


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

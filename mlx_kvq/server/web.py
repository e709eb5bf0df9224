"""The web page at `/` and `/status`, the JSON it (and any script) reads.

HTTP only. The page is static files shipped inside the package (no build
step, its JavaScript libraries vendored with their licences, nothing from
a CDN); they are read once when the router is made, so an installation
without them fails at startup, not on the first visit. `/status` is open
like `/health` and `/metrics` and, like them, carries numbers and settings,
never prompt or completion text. It describes the default model, or the one
`?model=NAME` names, and lists every model (`models`) with the memory
budget they share (`models_memory`): the page's model picker reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import Any

import mlx.core as mx
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from mlx_kvq.engine import Engine, MetricsSnapshot
from mlx_kvq.residency import ModelView

from .errors import error_response
from .models import ModelDirectory
from .probes import budget_status, model_summary
from .prometheus import REQUEST_STATUSES

STATIC_PACKAGE = "mlx_kvq.server"
STATIC_DIR = "static"
PAGE = "index.html"
FAVICON = "favicon.svg"
# What the page needs; a package without one of them refuses to start.
REQUIRED_FILES = (PAGE, FAVICON, "style.css", "app.js", "chat.js", "panel.js", "markdown.js",
                  "vendor/marked.esm.js", "vendor/purify.es.mjs")  # fmt: skip
NOT_KV_KINDS = ("shared", "unused")  # plan kinds that hold no bytes of their own

_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".txt": "text/plain; charset=utf-8",
    ".md": "text/plain; charset=utf-8",
}

# The page loads only its own files and talks only to this server; model
# output that got past the Markdown sanitizer still could not run a script.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "Referrer-Policy": "no-referrer",
}

StatusSource = Callable[[], dict[str, Any] | None]


def load_assets() -> dict[str, tuple[bytes, str]]:
    """The page's files by their path under static/: (content, media type).

    Files of a type not listed in `_MEDIA_TYPES` (and hidden ones) are not
    served. Raises FileNotFoundError naming the folder when one of
    `REQUIRED_FILES` is missing, so that a broken install stops the server.
    """
    root = resources.files(STATIC_PACKAGE) / STATIC_DIR
    assets: dict[str, tuple[bytes, str]] = {}

    def walk(folder: Any, prefix: str) -> None:
        for entry in folder.iterdir():
            name = prefix + entry.name
            if entry.name.startswith((".", "__")):
                continue
            if entry.is_dir():
                walk(entry, name + "/")
                continue
            media_type = _MEDIA_TYPES.get("." + entry.name.rsplit(".", 1)[-1])
            if media_type is not None:
                assets[name] = (entry.read_bytes(), media_type)

    if root.is_dir():
        walk(root, "")
    missing = [name for name in REQUIRED_FILES if name not in assets]
    if missing:
        raise FileNotFoundError(
            f"the web page's {', '.join(missing)} missing from {root}: the package was "
            "installed without its static files (reinstall mlx-kvq)"
        )
    return assets


def plan_slots(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per cache slot of `KVPlan.to_dict()` (or a distributed group's plan)."""
    rows = []
    for layer in plan.get("layers", []):
        keys, values = layer.get("key_spec", {}), layer.get("value_spec", {})
        kv = layer.get("kind") in ("full", "sliding", "chunked")
        rotations = {s.get("rotation") for s in (keys, values) if s.get("bits")}
        row = {
            "slot": layer.get("slot"),
            "member": layer.get("member"),
            "kind": layer.get("kind"),
            "window": layer.get("window"),
            "key_bits": keys.get("bits") if kv else None,
            "value_bits": values.get("bits") if kv else None,
            "group_size": keys.get("group_size") if kv else None,
            "rotation": (rotations.pop() if len(rotations) == 1 else "none") if kv else None,
            "bytes_per_token": layer.get("bytes_per_token"),
            "kv": kv,
            "quantized": bool(layer.get("quantized")),
            "skipped": bool(layer.get("skipped")),
            "hand_out": layer.get("hand_out"),
            "label": layer.get("label"),
        }
        if "rank" in layer:
            row["rank"] = layer["rank"]
        rows.append(row)
    return rows


def plan_status(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan as `/status` shows it: totals and one row per slot."""
    keys = ("model_type", "summary", "kv_layers", "quantized_layers", "shared_layers", "partial",
            "sinks", "bytes_per_token", "fp16_bytes_per_token", "max_window", "max_context",
            "notes", "distributed")  # fmt: skip
    out = {k: plan.get(k) for k in keys}
    kv = plan.get("kv_config", {})
    out["kv_config"] = {
        k: kv.get(k)
        for k in ("bits", "key_bits", "value_bits", "window_bits", "group_size", "rotation")
    }
    out["kv_config"]["quantized_kv_start"] = kv.get("quantized_start")
    out["slots"] = plan_slots(plan)
    return out


def kv_status(snapshot: MetricsSnapshot, plan: dict[str, Any]) -> dict[str, Any]:
    """Live KV bytes by cache kind (every kind of the plan, 0 when idle) and in total."""
    kinds = [k for k in plan.get("kinds", []) if k not in NOT_KV_KINDS]
    by_kind = {kind: 0 for kind in kinds}
    by_kind.update(snapshot.kv_bytes_by_kind)
    return {
        "bytes": sum(by_kind.values()),
        "by_kind": by_kind,
        "layers": snapshot.kv_layers,
        "layers_quantized": snapshot.kv_layers_quantized,
    }


def prompt_cache_status(s: MetricsSnapshot) -> dict[str, Any]:
    lookups = s.prompt_cache_hits + s.prompt_cache_misses
    return {
        "entries": s.prompt_cache_entries,
        "max_entries": s.prompt_cache_max_entries,
        "bytes": s.prompt_cache_bytes,
        "max_bytes": s.prompt_cache_max_bytes,
        "hits": s.prompt_cache_hits,
        "misses": s.prompt_cache_misses,
        "hit_rate": s.prompt_cache_hits / lookups if lookups else None,
        "evictions": s.prompt_cache_evictions,
        "cached_tokens": s.cached_prompt_tokens,
    }


def disk_status(s: MetricsSnapshot) -> dict[str, Any] | None:
    """The prompt cache's disk tier (None without --prompt-cache-dir)."""
    d = s.disk
    if d is None:
        return None
    lookups = d.hits + d.misses
    return {
        "directory": d.directory, "bytes": d.nbytes, "max_bytes": d.max_bytes,
        "files": d.files, "entries": d.entries, "chunks": d.chunks, "hits": d.hits,
        "misses": d.misses, "hit_rate": d.hits / lookups if lookups else None,
        "tokens_read": d.tokens_read, "writes": d.writes, "bytes_written": d.bytes_written,
        "evictions": d.evictions, "queued_bytes": d.queued_bytes,
        "foreign_bytes": d.foreign_bytes, "skips": dict(d.skips),
    }  # fmt: skip


def blocks_status(s: Any) -> dict[str, Any] | None:
    """The paged layout's block pools (None with padded rows): blocks of all
    paged layers together, and the prefix blocks new sequences mapped by
    reference so far."""
    b = s.blocks
    if b is None:
        return None
    return {
        "block_size": b.block_size, "pools": b.pools, "capacity": b.capacity,
        "used": b.used, "free": b.free, "shared": b.shared, "bytes": b.nbytes,
        "used_bytes": b.used_bytes, "prefix_blocks_reused": s.prefix_blocks_reused,
    }  # fmt: skip


def status_body(
    engine: Engine,
    settings: Any,
    blas: StatusSource | None = None,
    budget: StatusSource | None = None,
) -> dict[str, Any]:
    """What `/status` answers; see docs/server.md for every field."""
    s = engine.metrics.snapshot()
    state = engine.state()
    report = state.report or {}
    plan = settings.plan if isinstance(settings.plan, dict) else {}
    return {
        "model": settings.model_id,
        "status": state.status.value,
        "reason": state.reason,
        "api_key_required": settings.api_key is not None,
        "warmup_seconds": report.get("seconds"),
        "plan": plan_status(plan),
        "kv": kv_status(s, plan),
        "budget": budget() if budget is not None else None,
        "blocks": blocks_status(s),
        "prompt_cache": prompt_cache_status(s),
        "prompt_cache_disk": disk_status(s),
        "queue_depth": s.queue_depth,
        "batch_size": s.batch_size,
        "max_batch_size": s.max_batch_size,
        "tokens_per_second": {"prompt": s.prompt_tps, "generation": s.generation_tps},
        "tokens": {"prompt": s.prompt_tokens, "generation": s.generation_tokens},
        "requests": {
            k: s.requests.get(k, 0)
            for k in (*REQUEST_STATUSES, *sorted(set(s.requests) - set(REQUEST_STATUSES)))
        },
        "memory": {"active": mx.get_active_memory(), "peak": mx.get_peak_memory()},
        "blas": blas() if blas is not None else None,
        "defaults": {
            "max_tokens": settings.sampling.max_tokens,
            "temperature": settings.sampling.temperature,
            "top_p": settings.sampling.top_p,
            "max_context": settings.max_context,
        },
    }


def absent_status(view: ModelView, settings: Any, blas: StatusSource | None) -> dict[str, Any]:
    """`/status` of a model not in memory: where it is, and no engine numbers."""
    return {
        "model": view.name,
        "status": view.state.value,
        "reason": view.reason,
        "api_key_required": settings.api_key is not None,
        "warmup_seconds": None,
        "plan": plan_status({}),
        "kv": {"bytes": 0, "by_kind": {}, "layers": 0, "layers_quantized": 0},
        "budget": None,
        "blocks": None,
        "prompt_cache": {
            "entries": 0,
            "max_entries": 0,
            "bytes": 0,
            "max_bytes": None,
            "hits": 0,
            "misses": 0,
            "hit_rate": None,
            "evictions": 0,
            "cached_tokens": 0,
        },  # fmt: skip
        "prompt_cache_disk": None,
        "queue_depth": 0,
        "batch_size": 0,
        "max_batch_size": 0,
        "tokens_per_second": {"prompt": 0.0, "generation": 0.0},
        "tokens": {"prompt": 0, "generation": 0},
        "requests": {},
        "memory": {"active": mx.get_active_memory(), "peak": mx.get_peak_memory()},
        "blas": blas() if blas is not None else None,
        "defaults": None,
    }


def models_status(models: ModelDirectory) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every model (`model_summary`, with its name) and the memory budget they
    share: `budget`, `held` (weights and KV budgets of resident and loading
    models), `held_max`, and `measured` (weights, live KV and prompt caches)."""
    rows = [{"name": v.name, **model_summary(v)} for v in models.views()]
    measured = sum((r["weights_bytes"] or 0) + (r["kv_bytes"] or 0) for r in rows)
    pool = models.pool
    memory = {"budget": pool.budget, "held": pool.held(), "held_max": pool.peak_held,
              "measured": measured}  # fmt: skip
    return rows, memory


def web_router(models: ModelDirectory, *, blas: StatusSource | None = None) -> APIRouter:
    """`/`, `/favicon.ico`, `/static/<file>` and `/status` for the app's models.

    `blas`, when given, is called on each `/status` and its dict shown as it
    is (null otherwise).
    """
    assets = load_assets()
    router = APIRouter()

    def asset(name: str) -> Response:
        content, media_type = assets[name]
        return Response(content, media_type=media_type, headers=_HEADERS)

    @router.get("/", include_in_schema=False)
    async def page() -> Response:
        return asset(PAGE)

    @router.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return asset(FAVICON)

    @router.get("/static/{name:path}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in assets:
            return error_response(404, f"no static file '{name}'")
        return asset(name)

    @router.get("/status")
    async def status(model: str | None = None) -> JSONResponse:
        name = models.pool.default if model is None else models.pool.known(model)
        if name is None:
            return error_response(404, f"no model '{model}' on this server", param="model",
                                  code="model_not_found")  # fmt: skip
        view = models.pool.view(name)
        if view.loaded is None:
            body = absent_status(view, models.settings, blas)
        else:
            engine = view.loaded.engine
            body = status_body(engine, view.loaded.served, blas, budget_status(engine))
        body["models"], body["models_memory"] = models_status(models)
        return JSONResponse(body)

    return router

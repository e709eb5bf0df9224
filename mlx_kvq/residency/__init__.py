"""Several models in one process: loaded on demand by name, resident within one
memory budget for their weights and KV caches (`pool.ModelPool`)."""

from .pool import (
    DEFAULT_MODEL_ALIAS,
    Footprint,
    Lease,
    Loaded,
    Loader,
    ModelEntry,
    ModelPool,
    ModelState,
    ModelUnavailable,
    ModelView,
    Prepared,
    Refusal,
)

__all__ = [
    "DEFAULT_MODEL_ALIAS",
    "Footprint",
    "Lease",
    "Loaded",
    "Loader",
    "ModelEntry",
    "ModelPool",
    "ModelState",
    "ModelUnavailable",
    "ModelView",
    "Prepared",
    "Refusal",
]

"""Serving core without HTTP: continuous batching over quantized KV caches."""

from .budget import Capacity, Ledger, Shape
from .budget import Share as BudgetShare
from .coordinator import (
    Coordinator,
    LocalCoordinator,
    RankStatus,
    RankView,
    StepCommands,
    StopNotice,
    WarmupVerdict,
)
from .engine import SHUTTING_DOWN, Engine, EngineOptions
from .metrics import BudgetFigures, EngineMetrics, MetricsSnapshot
from .prompt_cache import PromptCache
from .requests import (
    ErrorEvent,
    Event,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    Outcome,
    Rejection,
    SamplingParams,
    TokenEvent,
    Usage,
)
from .warmup import Readiness, ReadinessState, Status, WarmupFailed, check_batch_path, warmup_spec

__all__ = [
    "SHUTTING_DOWN",
    "BudgetFigures",
    "BudgetShare",
    "Capacity",
    "Coordinator",
    "Engine",
    "EngineMetrics",
    "EngineOptions",
    "ErrorEvent",
    "Event",
    "FinishEvent",
    "FinishReason",
    "GenerationRequest",
    "Ledger",
    "LocalCoordinator",
    "MetricsSnapshot",
    "Outcome",
    "PromptCache",
    "RankStatus",
    "RankView",
    "Rejection",
    "Readiness",
    "ReadinessState",
    "SamplingParams",
    "Shape",
    "Status",
    "StepCommands",
    "StopNotice",
    "TokenEvent",
    "Usage",
    "WarmupFailed",
    "WarmupVerdict",
    "check_batch_path",
    "warmup_spec",
]

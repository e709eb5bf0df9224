"""Serving core without HTTP: continuous batching over quantized KV caches."""

from ..sampling_params import SamplingError, SamplingParams
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
from .metrics import BlockFigures, BudgetFigures, EngineMetrics, MetricsSnapshot
from .prompt_cache import PromptCache
from .requests import (
    Checkpoint,
    ErrorEvent,
    Event,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    Outcome,
    PromptProgress,
    Rejection,
    Segment,
    TokenEvent,
    Usage,
)
from .scheduler import RequestStatus, StepPlan
from .speculation import DraftModel
from .warmup import (
    Readiness,
    ReadinessState,
    Status,
    WarmupFailed,
    check_batch_path,
    held_exact,
    warmup_spec,
)

__all__ = [
    "SHUTTING_DOWN",
    "BlockFigures",
    "BudgetFigures",
    "BudgetShare",
    "Capacity",
    "Checkpoint",
    "DraftModel",
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
    "PromptProgress",
    "RankStatus",
    "RankView",
    "Rejection",
    "Readiness",
    "RequestStatus",
    "ReadinessState",
    "SamplingError",
    "SamplingParams",
    "Segment",
    "Shape",
    "Status",
    "StepCommands",
    "StepPlan",
    "StopNotice",
    "TokenEvent",
    "Usage",
    "WarmupFailed",
    "WarmupVerdict",
    "check_batch_path",
    "held_exact",
    "warmup_spec",
]

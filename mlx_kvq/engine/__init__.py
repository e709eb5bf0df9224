"""Serving core without HTTP: continuous batching over quantized KV caches."""

from .engine import Engine, EngineOptions
from .metrics import EngineMetrics, MetricsSnapshot
from .prompt_cache import PromptCache
from .requests import (
    ErrorEvent,
    Event,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    Usage,
)
from .warmup import Readiness, WarmupFailed, check_batch_path

__all__ = [
    "Engine",
    "EngineMetrics",
    "EngineOptions",
    "ErrorEvent",
    "Event",
    "FinishEvent",
    "GenerationRequest",
    "MetricsSnapshot",
    "PromptCache",
    "Readiness",
    "SamplingParams",
    "TokenEvent",
    "Usage",
    "WarmupFailed",
    "check_batch_path",
]

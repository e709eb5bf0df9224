"""What the HTTP layer needs to know besides the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from mlx_kvq.residency import DEFAULT_MODEL_ALIAS
from mlx_kvq.sampling_params import SamplingParams

from .guards.policy import GuardPolicy

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DEFAULT_RESPONSE_STORE_BYTES = 64 * 1024 * 1024


class ToolFormat(str, Enum):
    """How tools reach the model and calls come back (`--tool-format`)."""

    TEMPLATE = "template"  # the chat template renders them; mlx-lm's parser reads the calls
    JSON = "json"  # the generic format (chat/json_tools.py): a system block, a grammar


@dataclass(frozen=True)
class ServerSettings:
    """The served model's id, auth, limits, sampling defaults and the plan it reports."""

    model_id: str
    names_checked: bool = False  # --served-model-name given: every API checks `model`
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    sampling: SamplingParams = field(default_factory=SamplingParams)  # --max-tokens, --temp, ...
    chat_template_args: dict[str, Any] = field(default_factory=dict)
    tool_format: ToolFormat = ToolFormat.TEMPLATE  # --tool-format
    adapter_path: str | None = None  # the adapter the model was loaded with (--adapter-path)
    draft_model: str | None = None  # the draft model speculative decoding uses (--draft-model)
    num_draft_tokens: int = 3  # tokens drafted per step by default (--num-draft-tokens)
    max_context: int | None = None
    plan: dict[str, Any] = field(default_factory=dict)  # KVPlan.to_dict(), or the group's
    guard: GuardPolicy = field(default_factory=GuardPolicy)  # hosts and origins answered
    body_timeout: float | None = None  # seconds a request body may take to arrive
    prompt_workers: int = 2  # requests rendering and tokenizing prompts at once
    response_store_bytes: int = DEFAULT_RESPONSE_STORE_BYTES  # stored /v1/responses, bytes
    created: int = field(default_factory=lambda: int(time.time()))


__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_MODEL_ALIAS",
    "DEFAULT_RESPONSE_STORE_BYTES",
    "ServerSettings",
    "ToolFormat",
]

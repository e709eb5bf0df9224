"""The one request model inside: a chat to answer, whichever API it came from.

OpenAI's chat completions (`openai/translate.py`), Anthropic's Messages
(`anthropic/translate.py`) and OpenAI's Responses (`responses/translate.py`)
translate their bodies into a `ChatJob`: chat-template messages (OpenAI's
chat shape, which chat templates read), tools in OpenAI's function shape,
template arguments and the engine's `SamplingParams`. A translator that
cannot honour a value raises `Refusal` naming the field (a 400).

`sampling_params` builds a request's `SamplingParams` from the server's
defaults (`ServerSettings.sampling`, built from the flags) and the fields
the body sets; `SamplingParams` holds every default and checks every value.
A new API is one more translator.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pydantic import BaseModel

from mlx_kvq.sampling_params import SamplingError, SamplingParams

from .tools import AUTO, ToolPolicy


class Refusal(ValueError):
    """A request value a translator cannot honour; `param` names the field (a 400)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def sampling_params(body: BaseModel, defaults: SamplingParams, **converted: Any) -> SamplingParams:
    """A request's `SamplingParams`: `defaults` (the server's) updated with the
    fields the body's API declares under a `SamplingParams` name, then with
    `converted` (the API's renamed or reshaped fields, such as Anthropic's
    `stop_sequences` as `stop`); a value left out (None) keeps the default.
    An API takes a new sampling field by declaring it in its schema."""
    declared = type(body).model_fields
    values = {n: getattr(body, n) for n in SAMPLING_FIELDS if n in declared}
    try:
        return defaults.updated(**{**values, **converted})
    except SamplingError as e:
        raise Refusal(str(e), e.field) from None


@dataclass(frozen=True)
class ChatJob:
    """A chat to answer: template messages (OpenAI's chat shape, which chat
    templates read), tools in OpenAI's function shape, and how to sample."""

    messages: list[dict[str, Any]]
    sampling: SamplingParams
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = True  # turn the model's tool-call markup into calls
    tool_choice: ToolPolicy = AUTO  # whether the answer must be a call (and to which tool)
    template_args: dict[str, Any] = field(default_factory=dict)  # over --chat-template-args
    stream: bool = False
    role_mapping: dict[str, str] | None = None  # for tokenizers without a chat template
    draft_tokens: int = 0  # tokens drafted per step (speculative decoding); 0: none

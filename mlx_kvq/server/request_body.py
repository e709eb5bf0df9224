"""Reading a request body, the same way for every API: received within its
size and time bounds (`body.receive_body`), then parsed, checked to fit the
context and validated as the API's pydantic model off the event loop
(`prompting.PromptWork.parse`); each failure is the status that names it.

`model` names differ by API: OpenAI's endpoints answer only the served id
or `default_model` (mlx_lm.server's alias); Anthropic's and the Responses
API answer any name with the loaded model (their clients send their own
model names, as llama-server takes any name with one model), unless the
server was started with `--served-model-name`, which makes them check it.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import ValidationError

from .chat.prompting import PromptTooLong
from .errors import validation_message
from .guards.body import BodyError, BodyNotRead, receive_body
from .guards.draining import RETRY_AFTER_S
from .settings import DEFAULT_MODEL_ALIAS, ServerSettings


def check_model_name(name: str, settings: ServerSettings, rejecter: Any, strict: bool) -> None:
    """A 404 for a name this server does not serve (see the module docstring);
    `rejecter.reject(status, message, **kw)` makes the error (and counts it)."""
    if not strict and not settings.names_checked:
        return
    if name not in (settings.model_id, DEFAULT_MODEL_ALIAS):
        raise rejecter.reject(
            404,
            f"the model '{name}' does not exist; this server serves '{settings.model_id}'",
            param="model",
            code="model_not_found",
        )


async def read_model(request: Request, model_cls: type, service: Any, strict: bool = False) -> Any:
    """The body of a request as `model_cls`; `strict`: the model name must be
    the served one (OpenAI's endpoints), else any name (see above)."""
    settings = service.settings
    lifecycle = request.app.state.lifecycle
    reject = service.reject
    try:
        raw = await receive_body(
            request.receive, settings.max_request_bytes, settings.body_timeout,
            lambda: lifecycle.draining, request.headers.get("content-length"),
        )  # fmt: skip
        body = await service.prompts.parse(raw, model_cls)
    except BodyNotRead as e:
        retry = RETRY_AFTER_S if e.status == 503 else None
        raise reject(e.status, e.message, code=e.code, retry_after=retry, close=True) from None
    except BodyError as e:
        raise reject(400, e.message, param=e.param) from None
    except PromptTooLong as e:
        raise reject(400, e.message, param=e.param, code="context_length_exceeded") from None
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise reject(400, message, param=param) from None
    check_model_name(body.model, settings, service, strict=strict)
    return body

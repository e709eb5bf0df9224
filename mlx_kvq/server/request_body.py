"""Reading a request body, the same way for every API: size cap (413), JSON
checks (`body.py`), the API's pydantic model (400 naming the field).

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

from .body import BodyError, parse_body
from .errors import validation_message
from .settings import ServerSettings
from .variants import DEFAULT_MODEL_ALIAS


async def read_json(request: Request, limit: int, rejecter: Any) -> dict[str, Any]:
    """The body as a JSON object, at most `limit` bytes; `rejecter.reject(status,
    message, **kw)` makes the APIError to raise (and counts the refusal)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise rejecter.reject(400, "invalid Content-Length header")
        if int(declared) > limit:
            raise rejecter.reject(413, f"request body over {limit} bytes",
                                  code="request_too_large")  # fmt: skip
    body, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise rejecter.reject(413, f"request body over {limit} bytes",
                                  code="request_too_large")  # fmt: skip
        body.append(chunk)
    try:
        return parse_body(b"".join(body))
    except BodyError as e:
        raise rejecter.reject(400, e.message, param=e.param) from None


def validate(data: dict[str, Any], model_cls: type, rejecter: Any) -> Any:
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise rejecter.reject(400, message, param=param) from None


def check_model_name(name: str, settings: ServerSettings, rejecter: Any, strict: bool) -> None:
    """A 404 for a name this server does not serve (see the module docstring)."""
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
    data = await read_json(request, settings.max_request_bytes, service)
    body = validate(data, model_cls, service)
    check_model_name(body.model, settings, service, strict=strict)
    return body

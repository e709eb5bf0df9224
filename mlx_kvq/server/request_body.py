"""Reading a request body, the same way for every API: received within its
size and time bounds (`body.receive_body`), then parsed, checked to fit the
context of the model it names and validated as the API's pydantic model off
the event loop (`prompting.PromptWork`); each failure is the status that
names it. The model is then routed to (`models.ModelDirectory`: loaded
first when it is not resident, and checked to fit then).

`model` names differ by API: OpenAI's endpoints answer only the names of
the models served (and `default_model`, mlx_lm.server's alias);
Anthropic's and the Responses API answer any other name with the default
model (their clients send their own model names, as llama-server takes any
name with one model), unless the server was started with
`--served-model-name`, which makes them check it.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import ValidationError

from .chat.prompting import PromptTooLong
from .errors import validation_message
from .guards.body import BodyError, BodyNotRead, parse_body, receive_body
from .guards.draining import RETRY_AFTER_S
from .models import ModelDirectory, Routed
from .replies import client_gone
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


async def read_routed(
    request: Request, model_cls: type, models: ModelDirectory, strict: bool = False
) -> tuple[Any, Routed]:
    """The body of a request as `model_cls` and the model it names, leased
    (release `Routed.lease` once the answer ends); `strict`: the name must be
    a served one (OpenAI's endpoints), else any name (see above)."""
    settings = models.settings
    lifecycle = request.app.state.lifecycle
    reject = models.reject
    try:
        raw = await receive_body(
            request.receive, settings.max_request_bytes, settings.body_timeout,
            lambda: lifecycle.draining, request.headers.get("content-length"),
        )  # fmt: skip
    except BodyNotRead as e:
        retry = RETRY_AFTER_S if e.status == 503 else None
        raise reject(e.status, e.message, code=e.code, retry_after=retry, close=True) from None
    except BodyError as e:
        raise reject(400, e.message, param=e.param) from None
    found: dict[str, Any] = {}

    def first(data: dict[str, Any]) -> None:
        """The model named, and the cheap refusal of a prompt that cannot fit
        it (now when it is resident, else once it is loaded)."""
        found["name"] = data.get("model")
        key = found["key"] = models.lookup(found["name"], strict)
        service = None if key is None else models.ready(key)
        if service is not None:
            service.prompts.check_fits(data)
            found["checked"] = True

    def work() -> tuple[dict[str, Any], Any]:
        data = parse_body(raw, first)
        return data, model_cls.model_validate(data)

    try:
        data, body = await models.prompts.run(work)
    except BodyError as e:
        raise reject(400, e.message, param=e.param) from None
    except PromptTooLong as e:
        raise reject(400, e.message, param=e.param, code="context_length_exceeded") from None
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise reject(400, message, param=param) from None
    if found["key"] is None:
        raise models.not_found(str(body.model))
    routed = await models.acquire(found["key"], client_gone(request))
    if not found.get("checked"):
        service = routed.service
        try:
            await service.prompts.run(service.prompts.check_fits, data)
        except PromptTooLong as e:
            routed.lease.release()
            raise service.reject(
                400, e.message, param=e.param, code="context_length_exceeded"
            ) from None
    return body, routed

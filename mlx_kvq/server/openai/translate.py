"""OpenAI's chat requests translated into the internal request (`chat.job.ChatJob`)."""

from __future__ import annotations

from typing import Any

from mlx_kvq.engine.prompts import has_chat_template

from ..chat.job import ChatJob, Refusal
from ..chat.service import ChatService
from ..chat.tools import ToolChoiceError, tool_policy
from . import schemas

# OpenAI fields a chat template may read as variables (gpt-oss's reads reasoning_effort)
TEMPLATE_FIELDS = ("reasoning_effort", "verbosity")


def template_fields(body: Any, variables: frozenset[str]) -> tuple[dict[str, Any], str | None]:
    """The `TEMPLATE_FIELDS` set in `body` as template variables, and the first
    one set that the template (reading `variables`) does not read, or None."""
    fields = {n: getattr(body, n) for n in TEMPLATE_FIELDS if getattr(body, n) is not None}
    unread = next((n for n in fields if n not in variables), None)
    return fields, unread


def template_args(body: schemas.ChatCompletionRequest, service: ChatService) -> dict[str, Any]:
    """The request's template arguments (over --chat-template-args)."""
    fields, unread = template_fields(body, service.variables)
    if unread is not None:
        raise Refusal(
            f"{unread} cannot be honoured: this model's chat template does not read '{unread}'",
            unread,
        )
    if body.role_mapping is not None and has_chat_template(service.tokenizer):
        raise Refusal(
            "role_mapping applies only to models without a chat template; this one has one",
            "role_mapping",
        )
    return {**fields, **(body.chat_template_kwargs or {})}


def chat_job(body: schemas.ChatCompletionRequest, service: ChatService, drafts: int) -> ChatJob:
    """The internal job of a chat request; `Refusal` names a field that cannot be honoured."""
    try:
        policy = tool_policy(body.tool_choice)
    except ToolChoiceError as e:
        raise Refusal(str(e), "tool_choice") from None
    return ChatJob(
        messages=[m.as_template_dict() for m in body.messages],
        sampling=body.to_sampling_params(service.settings.sampling),
        tools=body.template_tools if policy.render else None,
        parse_tools=policy.parse,
        tool_choice=policy,
        template_args=template_args(body, service),
        stream=body.stream,
        role_mapping=body.role_mapping,
        draft_tokens=drafts,
    )

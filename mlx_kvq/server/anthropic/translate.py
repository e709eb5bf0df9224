"""Anthropic's Messages requests translated into the internal request (`chat.job.ChatJob`).

What Claude Code and the `anthropic` SDK send: the system prompt and
`system`-role messages, text, `tool_use`, `tool_result` and `thinking`
blocks become the chat template's messages (assistant `tool_calls`,
`role: "tool"` results, `reasoning`), and `tools` its functions. Claude
Code's first system block, `x-anthropic-billing-header: ...; cch=<nonce>`,
is dropped before rendering: it would sit before everything else and change
on every request, defeating the prompt cache's prefix reuse. Every field's
treatment is in `server/fields.py` (`MESSAGES`).
"""

from __future__ import annotations

from typing import Any

from ..chat.job import ChatJob, Refusal
from ..chat.service import ChatService
from ..chat.tools import AUTO, NONE, ToolPolicy, required_call
from . import schemas as S


def system_text(system: str | list[S.TextBlock] | None) -> str | None:
    """The system prompt, without Claude Code's billing-header block."""
    if system is None:
        return None
    if isinstance(system, str):
        return system
    kept = [b.text for b in system if not b.text.startswith(S.BILLING_HEADER)]
    return "\n\n".join(kept) if kept else None


def template_messages(body: S.CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation in the chat template's (OpenAI's) message shape."""
    out: list[dict[str, Any]] = []
    system = system_text(body.system)
    if system:
        out.append({"role": "system", "content": system})
    for message in body.messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        if message.role == "assistant":
            out.append(assistant_message(message.content))
            continue
        text: list[str] = []
        for block in message.content:
            if isinstance(block, S.ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": block.text()})  # fmt: skip
            elif isinstance(block, S.TextBlock):
                text.append(block.text)
            else:
                raise Refusal(f"{block.type} blocks are only taken in assistant turns", "messages")
        if text:
            out.append({"role": message.role, "content": "".join(text)})
    return out


def assistant_message(blocks: list[Any]) -> dict[str, Any]:
    """An assistant turn: text, reasoning (thinking blocks), tool calls (arguments as objects)."""
    text, reasoning, calls = [], [], []
    for block in blocks:
        if isinstance(block, S.TextBlock):
            text.append(block.text)
        elif isinstance(block, S.ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, S.ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})  # fmt: skip
        elif isinstance(block, S.ToolResultBlock):
            raise Refusal("tool_result blocks belong in user turns", "messages")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if any(reasoning):
        message["reasoning"] = "\n".join(r for r in reasoning if r)
    if calls:
        message["tool_calls"] = calls
    return message


def template_tools(tools: list[S.Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description:
            fn["description"] = t.description
        out.append({"type": "function", "function": fn})
    return out


def tool_policy(choice: S.ToolChoice | None) -> ToolPolicy:
    """What `tool_choice` asks: auto, none (tools neither rendered nor parsed),
    any or one named tool (a call required)."""
    if choice is not None and choice.disable_parallel_tool_use and choice.type != "none":
        raise Refusal("disable_parallel_tool_use cannot be enforced by this server",
                      "tool_choice")  # fmt: skip
    if choice is None or choice.type == "auto":
        return AUTO
    if choice.type == "none":
        return NONE
    if choice.type == "any":
        return required_call()
    if not choice.name:
        raise Refusal("tool_choice of type 'tool' names the tool (name)", "tool_choice")
    return required_call(choice.name)


def template_args(body: S.CountTokensRequest, service: ChatService) -> dict[str, Any]:
    args: dict[str, Any] = {}
    if body.thinking is not None and body.thinking.type == "disabled":
        if service.reads("enable_thinking"):
            args["enable_thinking"] = False
    configs = body.output_configs()
    efforts = [c.effort for c in configs if c.effort is not None]
    if efforts and service.reads("reasoning_effort"):
        args["reasoning_effort"] = efforts[0]  # the request's own, else the first turn's
    if any(c.format is not None for c in configs):
        raise Refusal("output_config.format (structured output) is not supported", "output_config")
    return args


def to_job(body: S.CountTokensRequest, service: ChatService) -> ChatJob:
    """The internal job; `Refusal` names a field this server cannot honour."""
    if body.messages[-1].role == "assistant":
        raise Refusal(
            "a final assistant message (prefill) is not supported: end with a user turn",
            "messages",
        )
    policy = tool_policy(body.tool_choice)
    return ChatJob(
        messages=template_messages(body),
        sampling=body.to_sampling_params(service.settings.sampling),
        tools=template_tools(body.tools) if policy.render else None,
        parse_tools=policy.parse,
        tool_choice=policy,
        template_args=template_args(body, service),
        stream=isinstance(body, S.MessagesRequest) and body.stream,
    )

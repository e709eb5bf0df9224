"""OpenAI's Responses requests translated into the internal request (`chat.job.ChatJob`).

What Codex, the OpenAI Agents SDK and the `openai` SDK send: `instructions`
and `input` items (messages of any role, `function_call`,
`function_call_output`, `reasoning`) become the chat template's messages,
function and namespace tools its functions. Hosted tools (`web_search`,
`file_search`, ...) cannot run here: they are left out of the prompt,
logged once per type and counted in `/metrics` (a 400 would make Codex
unusable). Every field's treatment is in `server/fields.py` (`RESPONSES`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..chat.job import ChatJob, Refusal
from ..chat.service import ChatService
from ..chat.tools import ToolChoiceError, ToolPolicy, tool_policy
from . import schemas as S
from .store import AgentCounters

log = logging.getLogger("mlx_kvq.server")


def input_messages(body: S.ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as chat-template messages (instructions excluded)."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items wait for the assistant turn they precede

    def assistant() -> dict[str, Any]:
        if not out or out[-1]["role"] != "assistant" or out[-1].get("closed"):
            out.append({"role": "assistant", "content": ""})
        turn = out[-1]
        if reasoning:
            turn["reasoning"] = "\n".join([turn.get("reasoning", ""), *reasoning]).strip("\n")
            reasoning.clear()
        return turn

    for item in body.input:
        if isinstance(item, S.ReasoningItem):
            reasoning.append(S.reasoning_of(item))
        elif isinstance(item, S.FunctionCallItem):
            try:
                arguments = json.loads(item.arguments or "{}")
            except json.JSONDecodeError:
                raise Refusal(
                    f"function_call {item.call_id}: arguments are not JSON", "input"
                ) from None
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": arguments}}  # fmt: skip
            assistant().setdefault("tool_calls", []).append(call)
        elif isinstance(item, S.FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": S.part_text(item.output)})  # fmt: skip
        elif item.role == "assistant":
            turn = assistant()
            if turn.get("tool_calls"):  # text after a call starts a new turn
                turn = {"role": "assistant", "content": ""}
                out.append(turn)
            turn["content"] += S.part_text(item.content)
        else:
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": S.part_text(item.content)})
    return out


def leading_system(instructions: str | None, messages: list[dict[str, Any]]) -> list[dict]:
    """`instructions` and the system/developer messages that open the input, as one
    first system turn (templates render a system prompt only first)."""
    texts = [instructions] if instructions else []
    i = 0
    while i < len(messages) and messages[i]["role"] == "system":
        texts.append(messages[i]["content"])
        i += 1
    head = [{"role": "system", "content": "\n\n".join(texts)}] if texts else []
    return head + messages[i:]


def template_tools(
    tools: list[Any] | None, counters: AgentCounters
) -> tuple[list[dict[str, Any]] | None, dict[str, str]]:
    """Function tools in the template's shape, and the namespace of each member function."""
    out, namespaces = [], {}
    for tool in tools or ():
        if isinstance(tool, S.HostedTool):
            if not counters.hosted_tools[tool.type]:
                log.info("hosted tool %r left out of the prompt: this server cannot run it",
                         tool.type)  # fmt: skip
            counters.hosted_tools[tool.type] += 1
            continue
        members = tool.tools if isinstance(tool, S.NamespaceTool) else [tool]
        for fn in members:
            spec: dict[str, Any] = {"name": fn.name,
                                    "parameters": fn.parameters or {"type": "object"}}  # fmt: skip
            description = fn.description
            if isinstance(tool, S.NamespaceTool):
                namespaces[fn.name] = tool.name
                description = " ".join(x for x in (tool.description, description) if x)
            if description:
                spec["description"] = description
            out.append({"type": "function", "function": spec})
    return out or None, namespaces


def choice_policy(body: S.ResponsesRequest) -> ToolPolicy:
    """What `tool_choice` asks: auto, none, required, or one named function."""
    if body.parallel_tool_calls is False:
        raise Refusal("parallel_tool_calls: false cannot be enforced by this server",
                      "parallel_tool_calls")  # fmt: skip
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}  # chat's shape
    try:
        return tool_policy(choice)
    except ToolChoiceError as e:
        raise Refusal(str(e), "tool_choice") from None


def template_args(body: S.ResponsesRequest, service: ChatService) -> dict[str, Any]:
    args: dict[str, Any] = {}
    effort = body.reasoning.effort if body.reasoning else None
    if effort is not None and service.reads("reasoning_effort"):
        args["reasoning_effort"] = effort
    verbosity = body.text.verbosity if body.text else None
    if verbosity is not None and service.reads("verbosity"):
        args["verbosity"] = verbosity
    return args


def to_job(
    body: S.ResponsesRequest, history: list[dict[str, Any]], counters: AgentCounters,
    service: ChatService,
) -> tuple[ChatJob, dict[str, str], list[dict[str, Any]]]:  # fmt: skip
    """The job, the namespaces of member functions, and the conversation to store."""
    policy = choice_policy(body)
    tools, namespaces = template_tools(body.tools, counters)
    conversation = history + input_messages(body)
    if not conversation:
        raise Refusal("input is empty and there is no previous response to continue", "input")
    job = ChatJob(
        messages=leading_system(body.instructions, conversation),
        sampling=body.to_sampling_params(service.settings.sampling),
        tools=tools if policy.render else None,
        parse_tools=policy.parse,
        tool_choice=policy,
        template_args=template_args(body, service),
        stream=body.stream,
    )
    return job, namespaces, conversation

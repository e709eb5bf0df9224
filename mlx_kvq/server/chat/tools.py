"""Tool calling as mlx_lm.server does it: which tools reach the prompt, and
the calls the model makes as OpenAI's `tool_calls`.

The parsing is mlx-lm's: the tokenizer wrapper knows the model's tool-call
markers (`tool_call_start`/`tool_call_end`) and its parser (one of
`mlx_lm.tool_parsers`, inferred from the chat template or set by
`tool_parser_type`); `output.ChatOutput` finds the text between the
markers and `ToolCalls` turns it into calls.

`tool_choice`: `"auto"` (the default) renders the tools and parses calls;
`"none"` renders no tools and parses nothing, so any markup the model
writes stays in `content` and `finish_reason` is never `"tool_calls"`;
`"required"` and a named function need constrained decoding: the generic
tool format (`--tool-format json`, `json_tools.py`) enforces them, the chat
template's format refuses them with a 400, like `parallel_tool_calls:
false`. Tools the server cannot honour are a 400 too (`tools_refusal`): a
chat template that does not render them, or a model whose calls mlx-lm has
no parser for (mlx_lm.server renders them and logs a warning, and the calls
come back as text); `--tool-format json` serves both.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("mlx_kvq.server")


class ToolChoiceError(ValueError):
    """A `tool_choice` this server cannot honour."""


@dataclass(frozen=True)
class ToolPolicy:
    """What a request's tools do: reach the prompt, have calls parsed, and
    whether the answer must be a call (`required`; to the tool `name` when
    given), which only the generic tool format can enforce (`json_tools.py`)."""

    render: bool
    parse: bool
    required: bool = False
    name: str | None = None


AUTO = ToolPolicy(render=True, parse=True)
NONE = ToolPolicy(render=False, parse=False)


def required_call(name: str | None = None) -> ToolPolicy:
    return ToolPolicy(render=True, parse=True, required=True, name=name)


def tool_policy(tool_choice: str | dict[str, Any] | None) -> ToolPolicy:
    """The policy for OpenAI's chat `tool_choice`, or `ToolChoiceError`."""
    if tool_choice is None or tool_choice == "auto":
        return AUTO
    if tool_choice == "none":
        return NONE
    if tool_choice == "required":
        return required_call()
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (
        isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
        and isinstance(function, dict) and isinstance(function.get("name"), str)
    ):  # fmt: skip
        return required_call(function["name"])
    raise ToolChoiceError(
        "tool_choice must be 'auto', 'none', 'required' or a named function, "
        f"not {json.dumps(tool_choice)[:80]}"
    )


def required_refusal(policy: ToolPolicy) -> str:
    """Why a required call cannot be enforced with the chat template's tool format."""
    what = f"a call to {policy.name!r}" if policy.name else "a tool call"
    return (
        f"tool_choice asks for {what}, which this server enforces only with the generic tool "
        "format (decoding constrained to the call): start it with --tool-format json, or "
        "use 'auto' or 'none'"
    )


def tools_refusal(parser: bool, template_variables: frozenset[str]) -> str | None:
    """Why a request's tools cannot be honoured, or None: `parser` is whether
    mlx-lm can parse this model's calls, `template_variables` what its chat
    template reads."""
    if "tools" not in template_variables:
        return "this model's chat template does not render tools"
    if not parser:
        return (
            "mlx-lm has no tool-call parser for this model (none named by tool_parser_type "
            "in tokenizer_config.json, none inferred from the chat template), so calls would "
            "come back as text"
        )
    return None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCalls:
    """Turns the text between tool-call markers into OpenAI tool calls.

    Each call is `{"id", "type": "function", "function": {"name",
    "arguments"}}` with the arguments as a JSON string; streamed calls also
    carry their `index` in the answer. Text the model's parser cannot read
    (a call cut off by `max_tokens`, or malformed) is returned as content
    with its markers, never dropped (mlx_lm.server drops it with a warning).
    """

    def __init__(
        self,
        parser: Callable[[str, Any], Any],
        tools: list[dict[str, Any]] | None,
        markers: tuple[str, str],
        streaming: bool,
    ):
        self.parser = parser
        self.tools = tools
        self.markers = markers
        self.streaming = streaming
        self.count = 0

    def parse(self, text: str) -> tuple[list[dict[str, Any]], str]:
        """(calls, text that could not be parsed, with its markers)."""
        try:
            parsed = self.parser(text, self.tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
                raise ValueError(f"the parser returned {str(parsed)[:80]}, not named calls")
        except Exception as e:  # noqa: BLE001 - the parser's failure is this call's content
            log.warning("could not parse a tool call (%s: %s); returned as content",
                        type(e).__name__, e)  # fmt: skip
            start, end = self.markers
            return [], f"{start}{text}{end or ''}"
        return [self._format(c) for c in calls], ""

    def _format(self, call: dict[str, Any]) -> dict[str, Any]:
        call = dict(call)
        call_id = call.pop("id", None) or new_call_id()
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        out: dict[str, Any] = {
            "id": call_id,
            "type": "function",
            "function": {"name": call["name"], "arguments": arguments},
        }
        if self.streaming:
            out["index"] = self.count
        self.count += 1
        return out

"""A chat answer's text split as mlx_lm.server splits it: reasoning, tool
calls and content.

mlx-lm's `TextStateMachine` (built by `make_text_state_machine` from what
the tokenizer wrapper knows: the thinking markers such as `<think>` and
`</think>`, the tool-call markers, and per-template response formats)
follows the decoded text through the states `normal`, `reasoning` and
`tool`, removing the markers. Text in `reasoning` becomes
`message.reasoning` (`delta.reasoning` when streaming), text in `tool`
becomes `tool_calls` once the call's closing marker arrives, `normal` text
is `content`; other states of a response format (headers) carry no text
for the client. A prompt whose template already opened the reasoning block
(`<think>` at the end of the generation prompt) starts in `reasoning`, as
mlx_lm.server decides it.

Unlike mlx_lm.server, text still held back when the answer ends (a possible
start of a marker, such as a final `<`) is given to the client, never
dropped. The engine has already removed stop strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlx_lm.generate import TextStateMachine, make_text_state_machine

from .tools import ToolCalls

REASONING, TOOL, NORMAL = "reasoning", "tool", "normal"


@dataclass
class ChatDelta:
    """What one piece of the answer adds: content, reasoning, tool calls."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def add(self, other: ChatDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls

    def fields(self) -> dict[str, Any]:
        """The non-empty fields, as a streamed `delta` carries them."""
        out: dict[str, Any] = {}
        if self.content:
            out["content"] = self.content
        if self.reasoning:
            out["reasoning"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


class _WithoutTools:
    """The tokenizer as `make_text_state_machine` sees it, minus tool calling."""

    has_tool_calling = False

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


class OutputSplitter:
    """The served tokenizer's state machines, built once when the app is.

    `tools` is whether mlx-lm can parse this model's tool calls;
    `thinking` whether it knows the model's reasoning markers.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.thinking = bool(getattr(tokenizer, "has_thinking", False))
        self.tools = bool(getattr(tokenizer, "has_tool_calling", False))
        self._machines = {
            True: make_text_state_machine(tokenizer),
            False: make_text_state_machine(_WithoutTools(tokenizer)),
        }

    def initial_state(self, prompt: list[int]) -> str:
        """`reasoning` when the prompt leaves a reasoning block open (mlx_lm.server's rule)."""
        state = NORMAL
        if self.thinking:
            start = self.tokenizer.rfind_think_start(prompt)
            if start > self.tokenizer.rfind_think_end(prompt):
                state = REASONING
        return getattr(self.tokenizer, "response_initial_state", None) or state

    def start(
        self,
        prompt: list[int],
        parse_tools: bool,
        tools: list[dict[str, Any]] | None,
        streaming: bool,
    ) -> ChatOutput:
        parse_tools = parse_tools and self.tools
        calls = None
        if parse_tools:
            markers = (self.tokenizer.tool_call_start, self.tokenizer.tool_call_end)
            calls = ToolCalls(self.tokenizer.tool_parser, tools, markers, streaming)
        return ChatOutput(self._machines[parse_tools], self.initial_state(prompt), calls)


class ChatOutput:
    """One answer's splitter; see the module docstring."""

    def __init__(self, machine: TextStateMachine, initial: str, calls: ToolCalls | None):
        self.state = machine.make_state(initial)
        self.current = initial
        self.calls = calls
        self.tool_text = ""
        self.made_call = False

    def feed(self, text: str) -> ChatDelta:
        """What `text` (the next decoded piece) adds to the answer."""
        if not text or self.state[0] is None:
            return ChatDelta()
        self.state, segments = TextStateMachine.split(self.state, text)
        return self._collect(segments)

    def finish(self, reason: str) -> tuple[ChatDelta, str]:
        """The rest of the answer and OpenAI's finish reason (`tool_calls` when
        the model stopped after calling a tool)."""
        delta = ChatDelta()
        if self.state[0] is not None:
            self.state, held, current = TextStateMachine.flush(self.state)
            delta = self._collect([(current, held)])
        if self.current == TOOL and self.tool_text:
            delta.add(self._close_call())
        if reason == "stop" and self.made_call:
            reason = "tool_calls"
        return delta, reason

    def _collect(self, segments: list[tuple[str | None, str]]) -> ChatDelta:
        delta = ChatDelta()
        for state, text in segments:
            if state == TOOL and self.calls is not None:
                self.tool_text += text
            elif state == REASONING:
                delta.reasoning += text
            elif state in (NORMAL, TOOL):
                if self.current == TOOL and self.calls is not None:
                    delta.add(self._close_call())
                delta.content += text
            self.current = state
        return delta

    def _close_call(self) -> ChatDelta:
        calls, unparsed = self.calls.parse(self.tool_text)
        self.tool_text = ""
        self.made_call = self.made_call or bool(calls)
        return ChatDelta(content=unparsed, tool_calls=calls)

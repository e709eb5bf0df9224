"""Anthropic Messages request bodies, validated.

As for OpenAI's bodies, every field the official `anthropic` SDK (2.x) and
Claude Code send is declared here and listed in `server/fields.py`
(`MESSAGES`) with its treatment: honoured, honoured approximately (the note
says how), refused with a 400 naming it, or accepted with no effect because
it cannot change the output on this server. Any other field is a 400 naming
it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mlx_kvq.sampling_params import SamplingParams

from ..chat.job import sampling_params

BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's first system block (a nonce in it)


class _Block(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    cache_control: dict[str, Any] | None = None  # the prompt cache is automatic


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    caller: dict[str, Any] | None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | MediaBlock, Field(discriminator="type")]] | None = (
        None
    )
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(b.text for b in self.content)


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


class MediaBlock(BaseModel):
    """An image or a document: refused, the served models take text only."""

    model_config = ConfigDict(extra="allow")

    type: Literal["image", "document"]

    @field_validator("type")
    @classmethod
    def _refuse(cls, value: str):
        raise ValueError(f"{value} blocks cannot be honoured: the served model takes text only")


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | MediaBlock,
    Field(discriminator="type"),
]


class OutputConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None


class Message(BaseModel):
    """A turn; a system turn may carry `output_config` (Claude Code 2.1 sends
    `{"effort": ...}` there), read as the request's own."""

    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]
    output_config: OutputConfig | None = None

    @model_validator(mode="after")
    def _config_on_system_turns(self):
        if self.output_config is not None and self.role != "system":
            raise ValueError(
                f"output_config is taken on system turns only, not on a {self.role} turn"
            )
        return self


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    defer_loading: bool | None = None
    strict: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    eager_input_streaming: bool | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class CountTokensRequest(BaseModel):
    """`/v1/messages/count_tokens`: the fields that shape the prompt."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None
    # refused
    mcp_servers: Any = None

    @field_validator("mcp_servers")
    @classmethod
    def _refused(cls, value: Any):
        if value:
            raise ValueError("MCP servers are run by Anthropic's API; this server has none")
        return value

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """This body's sampling: the server's `defaults` with the fields it sets."""
        return sampling_params(self, defaults)

    def output_configs(self) -> list[OutputConfig]:
        """The request's `output_config` and those its system turns carry, in order."""
        turns = [m.output_config for m in self.messages if m.output_config is not None]
        return [c for c in (self.output_config, *turns) if c is not None]


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    # cannot change the output
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict[str, Any] | None = None
    # refused
    container: Any = None

    @field_validator("container")
    @classmethod
    def _no_container(cls, value: Any):
        if value is not None:
            raise ValueError("code-execution containers are not supported by this server")
        return value

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        stop = tuple(s for s in self.stop_sequences or () if s)
        return sampling_params(self, defaults, stop=stop or None)

"""Anthropic Messages request bodies, validated, with every field's treatment.

As for OpenAI's bodies (`schemas.py`, `fields.py`), every field the
official `anthropic` SDK (2.x) and Claude Code send is declared here and
listed in `MESSAGES_FIELDS` with its treatment: honoured, honoured
approximately (the note says how), refused with a 400 naming it, or accepted
with no effect because it cannot change the output on this server. Any other
field is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlx_kvq.sampling_params import SamplingParams

from .chat_job import sampling_params
from .fields import FieldDoc, Treatment

H, A, R, IG = Treatment.HONOURED, Treatment.APPROXIMATE, Treatment.REFUSED, Treatment.IGNORED

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


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


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


class OutputConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None


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


MESSAGES_FIELDS = {
    "model": FieldDoc(
        H,
        "any name is answered by the loaded model (as llama-server does with one model); "
        "with --served-model-name only that name or 'default_model', others 404",
    ),
    "max_tokens": FieldDoc(
        H, "beyond the context the answer ends where the context does (stop_reason max_tokens)"
    ),
    "messages": FieldDoc(
        H,
        "roles user, assistant and system (system turns after the first folded into the user "
        "turn next to them for templates that do not render them); blocks text, tool_use, "
        "tool_result (string or text blocks), thinking and redacted_thinking sent back; image "
        "and document 400 (no model served here takes them); a final assistant turn "
        "(prefill) 400",
    ),
    "system": FieldDoc(
        H,
        "a string or text blocks, the first system turn; Claude Code's "
        "x-anthropic-billing-header block is dropped before rendering",
    ),
    "tools": FieldDoc(
        H,
        "rendered by the chat template as functions (input_schema as parameters); calls "
        "parsed into tool_use blocks; defer_loading: approximately, deferred tools are "
        "rendered with the others (there is no tool search here)",
    ),
    "tool_choice": FieldDoc(
        H,
        "auto; none (tools not rendered, calls not parsed); any and tool 400 (decoding is "
        "not constrained to a call); disable_parallel_tool_use: true 400",
    ),
    "stop_sequences": FieldDoc(
        H, "up to 16, matched on the decoded text, left out; stop_reason stop_sequence"
    ),
    "stream": FieldDoc(H, "Anthropic's server-sent events; ping while the prompt is read"),
    "temperature": FieldDoc(H, "0 to 1 (0: greedy); default --temp"),
    "top_p": FieldDoc(H, "above 0, at most 1; default --top-p"),
    "top_k": FieldDoc(H, "default --top-k; 0: off"),
    "thinking": FieldDoc(
        A,
        "enabled and adaptive: the model reasons as its template lets it; disabled: "
        "enable_thinking false for templates that read it; the model's reasoning comes back "
        "as thinking blocks either way; budget_tokens is not a separate cut (max_tokens "
        "bounds reasoning and answer together); display omitted: thinking blocks carry no text",
    ),
    "output_config": FieldDoc(
        A,
        "effort: passed as reasoning_effort to templates that read it (gpt-oss's), else no "
        "effect; format (structured output) 400",
    ),
    "context_management": FieldDoc(
        IG,
        "server-side edits of the history (clear_thinking, clear_tool_uses): the history is "
        "rendered as sent, and the chat template decides which earlier reasoning it keeps",
    ),
    "cache_control": FieldDoc(IG, "cache hints; the prompt cache is automatic"),
    "metadata": FieldDoc(IG, "user_id for a hosted service's abuse checks"),
    "service_tier": FieldDoc(IG, "a hosted service's processing tier"),
    "inference_geo": FieldDoc(IG, "where a hosted service runs the request"),
    "speed": FieldDoc(IG, "a hosted service's speed tier"),
    "diagnostics": FieldDoc(IG, "a hosted service's diagnostics"),
    "container": FieldDoc(R, "code-execution containers are not supported"),
    "mcp_servers": FieldDoc(R, "MCP servers run by a hosted service are not supported"),
}

COUNT_TOKENS_FIELDS = {k: MESSAGES_FIELDS[k] for k in CountTokensRequest.model_fields}

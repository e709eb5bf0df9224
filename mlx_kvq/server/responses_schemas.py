"""OpenAI Responses request bodies, validated, with every field's treatment.

Every field the `openai` SDK (3.x) and Codex send is declared here and
listed in `RESPONSES_FIELDS` with its treatment (see `fields.Treatment`);
any other field is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from mlx_kvq.sampling_params import SamplingParams

from .chat_job import sampling_params
from .fields import FieldDoc, Treatment

H, A, R, IG = Treatment.HONOURED, Treatment.APPROXIMATE, Treatment.REFUSED, Treatment.IGNORED

# Tools a hosted service runs itself: left out of the prompt here (logged once, counted)
HOSTED_TOOLS = frozenset(
    {
        "web_search", "web_search_preview", "web_search_2025_08_26",
        "web_search_preview_2025_03_11", "file_search", "code_interpreter",
        "image_generation", "computer_use_preview", "computer_use", "mcp", "local_shell",
        "tool_search",
    }
)  # fmt: skip
ENCRYPTED = "reasoning.encrypted_content"


class _Item(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    id: str | None = None
    status: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["input_text", "output_text", "text", "summary_text", "reasoning_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["refusal"]
    refusal: str


class MediaPart(BaseModel):
    """An image, file or audio part: refused, the served models take text only."""

    model_config = ConfigDict(extra="allow")

    type: Literal["input_image", "input_file", "input_audio"]

    @field_validator("type")
    @classmethod
    def _refuse(cls, value: str):
        raise ValueError(f"{value} parts cannot be honoured: the served model takes text only")


ContentPart = Annotated[TextPart | RefusalPart | MediaPart, Field(discriminator="type")]


def part_text(content: str | list[Any] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, TextPart) else p.refusal for p in content)


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    phase: str | None = None


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[TextPart] = []
    content: list[TextPart] | None = None
    encrypted_content: str | None = None


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class NamespaceTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[FunctionTool]


class HostedTool(BaseModel):
    """A tool a hosted service runs (its settings are not read here)."""

    model_config = ConfigDict(extra="allow")

    type: str

    @field_validator("type")
    @classmethod
    def _hosted(cls, value: str):
        if value not in HOSTED_TOOLS:
            raise ValueError(
                f"tools of type {value!r} are not supported (function, namespace, and the "
                "hosted tools left out of the prompt: " + ", ".join(sorted(HOSTED_TOOLS)) + ")"
            )
        return value


def _tool_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("function", "namespace") else "hosted"


ToolSpec = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[HostedTool, Tag("hosted")],
    Discriminator(_tool_type),
]


class Reasoning(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    # cannot change the output
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    stream_options: dict[str, Any] | None = None
    # refused
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    @field_validator("include")
    @classmethod
    def _check_include(cls, value: list[str] | None):
        for name in value or ():
            if name != ENCRYPTED:
                raise ValueError(f"include {name!r} is not supported (only {ENCRYPTED!r})")
        return value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool | None):
        if value:
            raise ValueError("background responses are not supported by this server")
        return value

    @field_validator("conversation", "prompt")
    @classmethod
    def _refused(cls, value: Any, info: Any):
        if value is not None:
            raise ValueError(f"{info.field_name} objects of a hosted service are not supported")
        return value

    def to_sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        """This body's sampling: the server's `defaults` with the fields it sets."""
        return sampling_params(self, defaults, max_tokens=self.max_output_tokens)


RESPONSES_FIELDS = {
    "model": FieldDoc(
        H,
        "any name is answered by the loaded model; with --served-model-name only that name "
        "or 'default_model', others 404",
    ),
    "input": FieldDoc(
        H,
        "a string or items: message (roles user, assistant, system, developer; text parts; "
        "images and files 400), function_call, function_call_output, reasoning (its "
        "encrypted_content from this server, or its summary, becomes the turn's reasoning)",
    ),
    "instructions": FieldDoc(H, "the first system turn (not carried to later responses)"),
    "max_output_tokens": FieldDoc(
        H, "default --max-tokens; beyond the context the answer ends there (incomplete)"
    ),
    "temperature": FieldDoc(H, "0 to 2 (0: greedy); default --temp"),
    "top_p": FieldDoc(H, "above 0, at most 1; default --top-p"),
    "stream": FieldDoc(H, "the Responses API's events, each with its sequence_number"),
    "store": FieldDoc(
        H, "true: kept for previous_response_id and GET (bounded, --response-store-bytes)"
    ),
    "previous_response_id": FieldDoc(H, "continues a stored response's conversation; unknown 404"),
    "include": FieldDoc(
        H, "reasoning.encrypted_content: an opaque value this server reads back; others 400"
    ),
    "tools": FieldDoc(
        A,
        "function tools rendered by the chat template and their calls parsed; namespace tools "
        "rendered as their member functions; strict is not enforced (calls are the model's, "
        "parsed); hosted tools (web_search, file_search, ...) left out of the prompt, logged "
        "once and counted in /metrics",
    ),
    "tool_choice": FieldDoc(H, "auto; none (tools not rendered); required or a named tool 400"),
    "parallel_tool_calls": FieldDoc(H, "true (the default); false 400 (cannot be enforced)"),
    "reasoning": FieldDoc(
        A,
        "effort passed as reasoning_effort to templates that read it, else no effect; "
        "summary: the reasoning is returned whole as the summary text",
    ),
    "text": FieldDoc(
        A,
        "format text, json_object or json_schema (enforced with llguidance); verbosity passed "
        "to templates that read it, else no effect",
    ),
    "prompt_cache_key": FieldDoc(
        IG, "a hosted cache's routing hint; the prompt cache is automatic"
    ),
    "prompt_cache_retention": FieldDoc(IG, "a hosted cache's retention"),
    "metadata": FieldDoc(IG, "tags for a hosted service's logs (echoed back)"),
    "client_metadata": FieldDoc(IG, "Codex's client tags for a hosted service"),
    "user": FieldDoc(IG, "an end-user id for a hosted service"),
    "safety_identifier": FieldDoc(IG, "an end-user id for a hosted service's abuse checks"),
    "service_tier": FieldDoc(IG, "a hosted service's processing tier"),
    "truncation": FieldDoc(IG, "the history is never truncated; a prompt over the context 400"),
    "stream_options": FieldDoc(IG, "include_obfuscation: nothing is obfuscated"),
    "background": FieldDoc(R, "true 400: background responses are not supported"),
    "conversation": FieldDoc(R, "hosted conversation objects are not supported"),
    "prompt": FieldDoc(R, "hosted prompt templates are not supported"),
}

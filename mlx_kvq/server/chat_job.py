"""The one request model inside: a chat to answer, whichever API it came from.

OpenAI's chat completions (`openai_chat.py`), Anthropic's Messages
(`anthropic.py`) and OpenAI's Responses (`responses.py`) translate their
bodies into a `ChatJob` (chat-template messages, tools, template arguments,
the engine's `SamplingParams`; completions use those alone). The two agent APIs read the
answer back as `Part`s: reasoning text, answer text and parsed tool calls
in the order the model wrote them, then one `Finished` with the stop reason
and usage; chat completions read the same `Answer`'s engine events and
splitter directly, for their per-token logprobs.
`ChatService` (one per app) does everything between: rendering the prompt
(the chat template, tools refused where the model cannot take them, the
context checked), the engine request, and mlx-lm's splitting of the
answer (`chat_output.py`). A new API is one more translator.

`sampling_params` builds a request's `SamplingParams` from the server's
defaults (`ServerSettings.sampling`, built from the flags) and the fields
the body sets; `SamplingParams` holds every default and checks every value.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from fastapi import Request
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from mlx_kvq.engine import (
    Engine,
    FinishEvent,
    GenerationRequest,
    Outcome,
    PromptProgress,
    SamplingError,
    SamplingParams,
    TokenEvent,
    Usage,
)
from mlx_kvq.engine.processors import json_grammar
from mlx_kvq.engine.prompts import template_variables
from mlx_kvq.engine.stops import first_stop

from .chat_output import ChatDelta, ChatOutput, OutputSplitter
from .errors import APIError
from .prompting import ChatPrompt, PromptWork
from .settings import ServerSettings
from .streams import IDLE, Generation
from .tools import tools_refusal


class Refusal(ValueError):
    """A request value a translator cannot honour; `param` names the field (a 400)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def sampling_params(body: BaseModel, defaults: SamplingParams, **converted: Any) -> SamplingParams:
    """A request's `SamplingParams`: `defaults` (the server's) updated with the
    fields the body's API declares under a `SamplingParams` name, then with
    `converted` (the API's renamed or reshaped fields, such as Anthropic's
    `stop_sequences` as `stop`); a value left out (None) keeps the default.
    An API takes a new sampling field by declaring it in its schema."""
    declared = type(body).model_fields
    values = {n: getattr(body, n) for n in SAMPLING_FIELDS if n in declared}
    try:
        return defaults.updated(**{**values, **converted})
    except SamplingError as e:
        raise Refusal(str(e), e.field) from None


@dataclass(frozen=True)
class ChatJob:
    """A chat to answer: template messages (OpenAI's chat shape, which chat
    templates read), tools in OpenAI's function shape, and how to sample."""

    messages: list[dict[str, Any]]
    sampling: SamplingParams
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = True  # turn the model's tool-call markup into calls
    template_args: dict[str, Any] = field(default_factory=dict)  # over --chat-template-args
    stream: bool = False
    role_mapping: dict[str, str] | None = None  # for tokenizers without a chat template
    draft_tokens: int = 0  # tokens drafted per step (speculative decoding); 0: none


class PartKind(str, Enum):
    REASONING = "reasoning"
    TEXT = "text"
    TOOL_CALL = "tool_call"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model's parser returned it

    def input(self) -> dict[str, Any]:
        """The arguments as an object (`{}` for text that is not a JSON object)."""
        try:
            value = json.loads(self.arguments or "{}")
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class Part:
    """A piece of the answer: reasoning or answer text, or one tool call."""

    kind: PartKind
    text: str = ""
    call: ToolCall | None = None


class StopReason(str, Enum):
    END = "end"  # the model ended its answer
    TOOL_USE = "tool_use"  # it ended after calling tools
    LENGTH = "length"  # max tokens, or the end of the context
    STOP_SEQUENCE = "stop_sequence"  # one of the request's stop strings


@dataclass(frozen=True)
class Finished:
    reason: StopReason
    usage: Usage
    stop_sequence: str | None = None  # which stop string, for STOP_SEQUENCE


@dataclass(frozen=True)
class Waiting:
    """No output yet: the prompt is being read (`progress`) or the request waits for a slot."""

    progress: PromptProgress | None = None


@dataclass(frozen=True)
class Failed:
    """The request failed after its stream began."""

    status: int
    message: str
    code: str | None = None


Event = Part | Waiting | Finished | Failed


def delta_parts(delta: ChatDelta) -> list[Part]:
    """A splitter delta as parts (reasoning, then text, then calls: their order in one token)."""
    parts = []
    if delta.reasoning:
        parts.append(Part(PartKind.REASONING, delta.reasoning))
    if delta.content:
        parts.append(Part(PartKind.TEXT, delta.content))
    for c in delta.tool_calls:
        fn = c["function"]
        parts.append(Part(PartKind.TOOL_CALL, call=ToolCall(c["id"], fn["name"], fn["arguments"])))
    return parts


def merge_parts(parts: list[Part]) -> list[Part]:
    """Consecutive text (or reasoning) parts joined into one; calls stay apart."""
    out: list[Part] = []
    for p in parts:
        if out and p.kind != PartKind.TOOL_CALL and out[-1].kind == p.kind:
            out[-1] = Part(p.kind, out[-1].text + p.text)
        else:
            out.append(p)
    return out


class Answer:
    """One job running in the engine, read back as `Event`s.

    Each run of text or reasoning comes without its leading whitespace (the
    line breaks templates put between reasoning, answer and calls); a run
    that is only whitespace is left out. `reasoning_tokens` counts the
    tokens that added reasoning.
    """

    def __init__(self, generation: Generation, output: ChatOutput, job: ChatJob, tokenizer: Any):
        self.generation = generation
        self.output = output
        self.job = job
        self.tokenizer = tokenizer
        self.tokens: list[TokenEvent] = []
        self.reasoning_tokens = 0
        self._run: PartKind | None = None  # the kind of the run being written
        self._started = False  # whether that run has non-blank text yet

    async def events(self) -> AsyncIterator[Event]:
        """The answer as it is generated (a client that leaves cancels it)."""
        async for ev in self.generation.events():
            if isinstance(ev, TokenEvent):
                for part in self._token(ev):
                    yield part
            elif isinstance(ev, PromptProgress) or ev is IDLE:
                yield Waiting(ev if isinstance(ev, PromptProgress) else None)
            elif isinstance(ev, FinishEvent):
                for event in self._finish(ev):
                    yield event
            else:
                yield Failed(ev.status, ev.message, ev.code)

    async def collect(self, request: Request) -> tuple[list[Part], Finished]:
        """The whole answer at once (cancelled as soon as the client leaves)."""
        tokens, fin = await self.generation.collect(request)
        parts = [p for t in tokens for p in self._token(t)]
        *rest, finished = self._finish(fin)
        return merge_parts(parts + rest), finished

    def _token(self, ev: TokenEvent) -> list[Part]:
        self.tokens.append(ev)
        parts = self._trim(delta_parts(self.output.feed(ev.text)))
        if any(p.kind == PartKind.REASONING for p in parts):
            self.reasoning_tokens += 1
        return parts

    def _trim(self, parts: list[Part]) -> list[Part]:
        out = []
        for p in parts:
            if p.kind != self._run:
                self._run, self._started = p.kind, False
            if p.kind != PartKind.TOOL_CALL and not self._started:
                p = Part(p.kind, p.text.lstrip())
                if not p.text:
                    continue
                self._started = True
            out.append(p)
        return out

    def _finish(self, fin: FinishEvent) -> list[Part | Finished]:
        delta, reason = self.output.finish(fin.reason.value)
        stop = None
        if reason == "tool_calls":
            why = StopReason.TOOL_USE
        elif reason == "length":
            why = StopReason.LENGTH
        else:
            stop = self._stop_sequence()
            why = StopReason.END if stop is None else StopReason.STOP_SEQUENCE
        return [*self._trim(delta_parts(delta)), Finished(why, fin.usage, stop)]

    def _stop_sequence(self) -> str | None:
        """The stop string that ended the answer, or None when the model ended it
        (the engine leaves stop strings out of the text; the tokens still hold them)."""
        stops = list(self.job.sampling.stop)
        if not stops or (self.tokens and self.tokens[-1].eos):
            return None
        text = self.tokenizer.decode([t.token for t in self.tokens if not t.eos])
        cut = first_stop(text, stops)
        if cut is None:
            return None
        return min((s for s in stops if text.startswith(s, cut)), key=len, default=None)


MID_SYSTEM_PROBE = "mid-conversation-system-probe"


def renders_mid_system(tokenizer: Any) -> bool:
    """Whether the chat template renders a system message after the first turn
    (Claude Code and Codex send them); decided once, when the app is built."""
    messages = [{"role": "user", "content": "a"},
                {"role": "system", "content": MID_SYSTEM_PROBE},
                {"role": "user", "content": "b"}]  # fmt: skip
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses them
        return False
    return isinstance(text, str) and MID_SYSTEM_PROBE in text


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System messages after the first turn as user text, joined to the user turn
    next to them (for templates that refuse or drop them; see `renders_mid_system`)."""

    def plain_user(m: dict[str, Any] | None) -> bool:
        return m is not None and m["role"] == "user" and set(m) == {"role", "content"}

    out: list[dict[str, Any]] = []
    held: list[str] = []  # folded system text waiting for the next user turn
    for i, m in enumerate(messages):
        if m["role"] == "system" and i > 0:
            held.append(m.get("content") or "")
            continue
        if held and plain_user(m):
            m = {"role": "user", "content": "\n\n".join([*held, m["content"] or ""])}
            held = []
        elif held:
            out.append(user_turn(out, held))
            held = []
        out.append(m)
    if held:
        out.append(user_turn(out, held))
    return out


def user_turn(out: list[dict[str, Any]], held: list[str]) -> dict[str, Any]:
    """Folded system text as a user turn: joined to the user turn before it when
    there is one (it is taken off `out`), else a turn of its own."""
    last = out[-1] if out else None
    if last is not None and last["role"] == "user" and set(last) == {"role", "content"}:
        out.pop()
        return {"role": "user", "content": "\n\n".join([last["content"] or "", *held])}
    return {"role": "user", "content": "\n\n".join(held)}


class ChatService:
    """Renders jobs into prompts and runs them on the app's engine."""

    def __init__(self, engine: Engine, settings: ServerSettings, prompts: PromptWork):
        self.engine = engine
        self.settings = settings
        self.prompts = prompts  # the app's one PromptWork: its threads and cap
        self.tokenizer = engine.tokenizer
        self.splitter = OutputSplitter(engine.tokenizer)
        self.variables = template_variables(engine.tokenizer)
        self.mid_system = renders_mid_system(engine.tokenizer)

    def reject(self, status: int, message: str, **kw: Any) -> APIError:
        """An error refusing the request before generation, counted in /metrics."""
        self.engine.metrics.count_request(Outcome.REJECTED)
        return APIError(status, message, **kw)

    def reads(self, variable: str) -> bool:
        """Whether the chat template reads `variable` (e.g. enable_thinking)."""
        return variable in self.variables

    async def render(self, job: ChatJob, param: str = "messages") -> ChatPrompt:
        """The prompt's token ids and prompt-cache checkpoints, rendered off the
        event loop by the app's `PromptWork`; a 400 naming `param` (or `tools`)
        when it cannot be."""
        if job.tools:
            refusal = tools_refusal(self.splitter.tools, self.variables)
            if refusal is not None:
                raise self.reject(400, f"tools cannot be honoured: {refusal}", param="tools")
        args = {**self.settings.chat_template_args, **job.template_args}

        try:
            messages = job.messages  # built for this request: rendering may change them
            if not self.mid_system:
                messages = await self.prompts.run(fold_system, messages)
            chat = await self.prompts.chat(messages, args, job.tools, job.role_mapping)
        except Exception as e:  # template errors are the request's fault
            raise self.reject(400, f"could not apply the chat template: {e}", param=param) from e
        self.check_length(chat.tokens, param)
        return chat

    def check_length(self, prompt: list[int], param: str) -> None:
        """A 400 for an empty prompt, or one that leaves no room in the context."""
        if not prompt:
            raise self.reject(400, "the prompt is empty", param=param)
        limit = self.settings.max_context
        if limit is not None and len(prompt) >= limit:
            raise self.reject(
                400,
                f"the prompt has {len(prompt)} tokens; this server's KV plan allows a "
                f"context of {limit} tokens",
                code="context_length_exceeded",
            )

    async def submit(self, request: GenerationRequest) -> Generation:
        """Hand `request` to the engine; a 400 names a sampling value the model
        cannot take (a `logit_bias` id outside its vocabulary), an `APIError`
        is an immediate refusal (queue full, KV budget)."""
        try:
            request.params.check_vocabulary(self.engine.vocab_size)
        except SamplingError as e:
            raise self.reject(400, str(e), param=e.field) from None
        generation = Generation(self.engine, request)
        await generation.start()
        return generation

    async def grammar(self, schema: dict[str, Any] | None, prompt: ChatPrompt, param: str) -> str:
        """The llguidance grammar of a JSON answer (matching `schema` when given), or a 400."""
        if self.splitter.initial_state(prompt.tokens) != "normal":
            raise self.reject(
                400,
                f"{param} cannot constrain an answer that starts inside the model's reasoning; "
                'turn thinking off (chat_template_kwargs: {"enable_thinking": false})',
                param=param,
            )
        try:
            grammar = json_grammar(schema)
        except ValueError as e:
            raise self.reject(400, f"{param}: {e}", param=param) from None
        error = await run_in_threadpool(self.engine.grammars.check, grammar)
        if error:
            raise self.reject(400, f"{param} cannot be used: {error}", param=param)
        return grammar

    async def start(self, job: ChatJob, prompt: ChatPrompt) -> Answer:
        """Submit the job; a refusal (queue full, KV budget) raises `APIError`."""
        request = GenerationRequest(
            prompt.tokens, job.sampling, progress=job.stream, checkpoints=prompt.checkpoints,
            draft_tokens=job.draft_tokens,
        )  # fmt: skip
        generation = await self.submit(request)
        output = self.splitter.start(prompt.tokens, job.parse_tools, job.tools, job.stream)
        return Answer(generation, output, job, self.tokenizer)

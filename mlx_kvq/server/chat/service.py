"""`ChatService` (one per app): everything between a translated `ChatJob` and its answer.

Rendering the prompt (the chat template, tools refused where the model
cannot take them, the context checked), the engine request, and mlx-lm's
splitting of the answer (`output.py`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from starlette.concurrency import run_in_threadpool

from mlx_kvq.engine import Engine, GenerationRequest, Outcome, SamplingError
from mlx_kvq.engine.processors import json_grammar
from mlx_kvq.engine.prompts import template_variables

from ..errors import APIError
from ..settings import ServerSettings, ToolFormat
from . import json_tools
from .answer import Answer
from .generation import Generation
from .job import ChatJob
from .output import OutputSplitter
from .prompting import ChatPrompt, PromptWork
from .system_turns import fold_system, renders_mid_system
from .tools import required_refusal, tools_refusal


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

    def generic_tools(self, job: ChatJob) -> bool:
        """Whether `job`'s tools take the generic format (`--tool-format json`)."""
        return bool(job.tools) and self.settings.tool_format == ToolFormat.JSON

    async def render(self, job: ChatJob, param: str = "messages") -> ChatPrompt:
        """The prompt's token ids and prompt-cache checkpoints, rendered off the
        event loop by the app's `PromptWork`; a 400 naming `param` (or `tools`,
        `tool_choice`) when it cannot be."""
        generic = self.generic_tools(job)
        messages, tools = (
            job.messages,
            job.tools,
        )  # built for this request: rendering may change them
        if generic:
            policy = job.tool_choice
            messages = await self.prompts.run(
                json_tools.conversation, messages, tools, policy.required
            )
            tools = None  # described in the system block instead
        elif job.tools:
            refusal = tools_refusal(self.splitter.tools, self.variables)
            if refusal is not None:
                raise self.reject(
                    400, f"tools cannot be honoured: {refusal} (or start the server with "
                    "--tool-format json, the generic tool format)", param="tools",
                )  # fmt: skip
        if job.tool_choice.required and not generic:
            refusal = required_refusal(job.tool_choice) if job.tools else (
                "tool_choice asks for a tool call, and the request has no tools"
            )  # fmt: skip
            raise self.reject(400, refusal, param="tool_choice")
        args = {**self.settings.chat_template_args, **job.template_args}

        try:
            if not self.mid_system:
                messages = await self.prompts.run(fold_system, messages)
            chat = await self.prompts.chat(messages, args, tools, job.role_mapping)
        except Exception as e:  # template errors are the request's fault
            raise self.reject(400, f"could not apply the chat template: {e}", param=param) from e
        self.check_length(chat.tokens, param)
        if generic:
            chat = replace(chat, tool_grammar=await self.tool_grammar(job, chat))
        return chat

    async def tool_grammar(self, job: ChatJob, prompt: ChatPrompt) -> str:
        """The grammar of an answer in the generic tool format, or a 400 naming
        `tools` (or `tool_choice`, for a tool that is not among them)."""
        self.check_outside_reasoning(prompt, "tools")
        policy = job.tool_choice
        try:
            grammar = json_tools.grammar(job.tools, policy.required, policy.name)
        except ValueError as e:
            raise self.reject(400, f"tool_choice: {e}", param="tool_choice") from None
        error = await run_in_threadpool(self.engine.grammars.check, grammar)
        if error:
            raise self.reject(400, f"tools cannot be used as a grammar: {error}", param="tools")
        return grammar

    def check_outside_reasoning(self, prompt: ChatPrompt, param: str) -> None:
        """A 400 naming `param`, which constrains the answer, when the answer starts
        inside the model's reasoning (the constraint would apply to the reasoning)."""
        if self.splitter.initial_state(prompt.tokens) != "normal":
            raise self.reject(
                400,
                f"{param} cannot constrain an answer that starts inside the model's reasoning; "
                'turn thinking off (chat_template_kwargs: {"enable_thinking": false})',
                param=param,
            )

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
        if prompt.tool_grammar is not None:
            raise self.reject(
                400, f"{param} cannot be combined with tools in the generic tool format "
                "(--tool-format json): the answer is held to plain text or one tool call",
                param=param,
            )  # fmt: skip
        self.check_outside_reasoning(prompt, param)
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
        sampling = job.sampling
        if prompt.tool_grammar is not None:
            sampling = replace(sampling, grammar=prompt.tool_grammar)
        request = GenerationRequest(
            prompt.tokens, sampling, progress=job.stream, checkpoints=prompt.checkpoints,
            draft_tokens=job.draft_tokens,
        )  # fmt: skip
        generation = await self.submit(request)
        if prompt.tool_grammar is not None:
            output = json_tools.JsonToolOutput(job.stream)
        else:
            output = self.splitter.start(prompt.tokens, job.parse_tools, job.tools, job.stream)
        return Answer(generation, output, job, self.tokenizer)

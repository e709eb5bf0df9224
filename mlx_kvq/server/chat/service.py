"""`ChatService` (one per app): everything between a translated `ChatJob` and its answer.

Rendering the prompt (the chat template, tools refused where the model
cannot take them, the context checked), the engine request, and mlx-lm's
splitting of the answer (`output.py`).
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from mlx_kvq.engine import Engine, GenerationRequest, Outcome, SamplingError
from mlx_kvq.engine.processors import json_grammar
from mlx_kvq.engine.prompts import template_variables

from ..errors import APIError
from ..settings import ServerSettings
from .answer import Answer
from .generation import Generation
from .job import ChatJob
from .output import OutputSplitter
from .prompting import ChatPrompt, PromptWork
from .system_turns import fold_system, renders_mid_system
from .tools import tools_refusal


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

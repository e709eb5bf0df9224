"""Admission: what the engine refuses before a request runs, and why.

At `submit`, on the caller's thread, a request whose prompt and decode
reserve cannot fit the KV budget even alone gets 400 and one that finds the
queue full gets 429 (both counted). On the engine thread, before it joins
the queue: an empty prompt, a prompt the plan's context cannot hold, the
budget again (a group's shares are known by then), and settings only the
model can check (`logit_bias` ids, processors that cannot be made) fail
that request alone. A request that passes becomes a `Sequence`.
"""

from __future__ import annotations

from typing import Any

from .budget import format_bytes
from .memory import KVMemory, Need
from .metrics import EngineMetrics
from .processors import Grammars, make_processors
from .requests import ErrorEvent, EventSink, GenerationRequest, Outcome, Rejection
from .sampling import SamplerPool
from .scheduler import Sequence
from .stops import StopMatcher

QUEUE_RETRY_AFTER_S = 2  # what a client refused for a full queue is told to wait


class Admission:
    """The refusals and the making of a request's `Sequence`; see the module docstring."""

    def __init__(
        self,
        memory: KVMemory,
        metrics: EngineMetrics,
        tokenizer: Any,
        grammars: Grammars,
        samplers: SamplerPool,
        *,
        max_context: int | None,
        max_queued: int | None,
        speculation: bool,
        keeps_prompts: bool,
    ):
        self.memory = memory
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.samplers = samplers
        self.max_context = max_context
        self.max_queued = max_queued
        self.speculation = speculation  # a draft model is loaded
        self.keeps_prompts = keeps_prompts  # the prompt cache keeps copies of prompts

    def max_tokens(self, request: GenerationRequest) -> int:
        """The request's token limit, clamped to the context the plan allows."""
        max_tokens = request.params.max_tokens
        if self.max_context is not None:
            max_tokens = min(max_tokens, max(1, self.max_context - len(request.prompt)))
        return max_tokens

    def refusal(self, request: GenerationRequest, waiting: int) -> ErrorEvent | None:
        """At submit: a 400 for a request that can never fit the budget, a 429
        when the queue is full."""
        refusal = self.too_large(request)
        if refusal is not None:
            return refusal
        limit = self.max_queued
        if limit is not None and waiting >= limit:
            self.metrics.count_rejection(Rejection.QUEUE_FULL)
            return ErrorEvent(
                f"the server's queue is full ({limit} requests waiting, --max-queued-requests); "
                "retry later", 429, "queue_full", retry_after=QUEUE_RETRY_AFTER_S,
            )  # fmt: skip
        return None

    def too_large(self, request: GenerationRequest) -> ErrorEvent | None:
        """The 400 for a request whose prompt (and the decode reserve) needs more
        than the whole budget; `max_tokens` reserves nothing."""
        n = len(request.prompt)
        ledger = self.memory.ledger
        if ledger is None or not n:
            return None
        need = Need(request.id, n, n, 1, n + self.max_tokens(request))
        verdict = self.memory.verdict(need)
        if verdict.fits_alone:
            return None
        self.metrics.count_rejection(Rejection.KV_BUDGET)
        longest = ledger.longest_prompt(n, self.memory.first_shape(need).total - n)
        return ErrorEvent(
            f"this request's prompt needs {format_bytes(verdict.needs)} of KV cache "
            f"({n} prompt tokens and a decode reserve at {ledger.share.cost.setting}), "
            f"more than the server's KV budget of {format_bytes(verdict.budget)} "
            f"(--kv-cache-memory) holds even alone; shorten the prompt to {longest:,} "
            f"tokens or less",
            400, "kv_budget_exceeded",
        )  # fmt: skip

    def invalid(self, request: GenerationRequest) -> ErrorEvent | None:
        """On the engine thread: the 400 for a request no batch slot can take
        (counted), or None."""
        n = len(request.prompt)
        if n == 0:
            self.metrics.count_request(Outcome.REJECTED)
            return ErrorEvent("the prompt is empty", 400, "empty_prompt")
        if self.max_context is not None and n >= self.max_context:
            self.metrics.count_request(Outcome.REJECTED)
            return ErrorEvent(
                f"the prompt has {n} tokens; this server's KV plan allows a context "
                f"of {self.max_context} tokens",
                400,
                "context_length_exceeded",
            )
        return self.too_large(request)  # again: a group's shares are known by now

    def sequence(
        self, request: GenerationRequest, sink: EventSink
    ) -> tuple[Sequence, Exception | None]:
        """The request as the scheduler holds it, and what fails it alone (its
        settings checked against the model), if anything."""
        seq = Sequence(
            request, sink, self.tokenizer.detokenizer, StopMatcher(request.params.stop),
            self.max_tokens(request),
        )  # fmt: skip
        try:
            request.params.check_vocabulary(self.samplers.vocab or len(self.tokenizer))
            seq.processors = make_processors(request.params, self.grammars)
        except Exception as e:  # noqa: BLE001 - this request's settings, not the engine
            return seq, e
        if self.keeps_prompts:  # where its prefill will store copies (refined when inserted)
            n = len(request.prompt)
            cuts = {c.length for c in request.checkpoints if 0 < c.length < n - 1}
            seq.cuts_at = tuple(sorted(cuts | {n - 1}))
        seq.speculative = (
            self.speculation
            and request.draft_tokens > 0
            and request.params.seed is None
            and not seq.processors
        )
        return seq, None


__all__ = ["QUEUE_RETRY_AFTER_S", "Admission"]

"""The serving engine: one thread that owns the model and wires the scheduler,
the memory accounting and the batch runner.

Other threads call `submit()`, `cancel()`, `drain()`, `stop()` and `fail()`;
the first three post small messages to the engine's inbox. Between steps the
engine thread turns its inbox into this step's `StepCommands`, hands them to
its coordinator (the identity for a single process; under `mlx.launch`, rank
0's commands become every rank's), applies them, and then:

- the scheduler (`scheduler.Scheduler`) plans the step: which running
  sequences grow, which are preempted when memory runs out, which queued
  requests are admitted, who gets the speculative lane; it asks the memory
  accounting (`memory.KVMemory`: what each sequence and the prompt cache
  hold against the KV budget, `budget.py`) and nothing else;
- the engine applies the plan through the batch runner (`runner.BatchRunner`:
  mlx-lm's `BatchGenerator` and the speculative lane, caches from the KV
  plan, quantized, full and sliding-window alike), steps it, and pushes
  events back through each request's sink.

Finished sequences leave their caches in the prompt cache; cancelled ones
leave the batch at the next step, which frees their memory. A preempted
sequence leaves its cache in the prompt cache while room lasts, emits the
token the batch had already sampled for it, and resumes from its tokens so
far, so its text is the text it would have said (greedy and seeded alike);
its client sees a pause. With a draft model, a request that arrives while
the engine serves nothing else is decoded speculatively
(`speculation.SpeculativeLane`) until another request arrives; then it moves
into the batch.

Whatever one request carries (its sampler, its logits processors, its text)
can only fail that request: the batch and the engine go on (see
`sampling.Guarded` and `processors.GuardedProcessor`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import StopSequences

from mlx_kvq.caches import cache_report
from mlx_kvq.config import PAGED_BLOCK_SIZE, KVConfig
from mlx_kvq.plan import KV_KINDS, KVPlan

from .budget import (
    Capacity,
    CostModel,
    Ledger,
    capacity_tokens,
    format_bytes,
    share_for,
)
from .coordinator import (
    Coordinator,
    LocalCoordinator,
    RankStatus,
    StepCommands,
    StopNotice,
    WarmupVerdict,
)
from .inbox import Inbox, unavailable
from .memory import KVMemory, Need
from .metrics import BlockFigures, BudgetFigures, EngineMetrics
from .processors import Grammars, make_processors
from .prompt_cache import PromptCache
from .requests import (
    Cancel,
    ErrorEvent,
    Event,
    EventSink,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    Outcome,
    PromptProgress,
    Rejection,
    SamplingParams,
    Segment,
    Stop,
    TokenEvent,
    Usage,
)
from .runner import BatchRunner, RunnerOptions, choose_layout
from .sampling import Guarded, SamplerPool, top_logprobs
from .scheduler import Limits, RequestStatus, Scheduler, Sequence, StepPlan
from .segments import split_prompt
from .speculation import DraftModel
from .stops import StopMatcher
from .warmup import (
    WARMUP_MARGIN,
    Readiness,
    ReadinessState,
    Status,
    WarmupFailed,
    verify_speculation,
    verify_warmup,
    warmup_spec,
)

log = logging.getLogger("mlx_kvq.engine")

IDLE_POLL_S = 0.1  # how long the idle engine thread waits for work per poll
SHUTTING_DOWN = "server is shutting down"
QUEUE_RETRY_AFTER_S = 2  # what a client refused for a full queue is told to wait
WARMUP_TEXT = (
    "The quick brown fox jumps over the lazy dog while the server warms up its "
    "quantized caches, one token at a time. "
)


@dataclass(frozen=True)
class EngineOptions:
    """Scheduling and cache settings (mlx-lm's server flag meanings)."""

    decode_concurrency: int = 32
    prompt_concurrency: int = 8
    prefill_step_size: int = 2048
    prompt_cache_size: int = 10
    prompt_cache_bytes: int | None = None
    max_context: int | None = None
    kv_cache_memory: int | None = None  # KV memory budget in bytes (None: admit by count only)
    block_size: int | None = PAGED_BLOCK_SIZE  # tokens per block (None: padded rows)
    max_queued_requests: int | None = None  # waiting requests before a 429 (None: no limit)
    warmup_gate: str | None = None  # warm-up waits until this file exists (tests)


def _discard(_event: Event) -> None:
    """The sink of a request this process does not answer (a follower rank)."""


def check_logit_bias(p: SamplingParams, vocab: int | None) -> None:
    """Refuse `logit_bias` token ids outside the model's logits (mlx-lm would
    index out of bounds)."""
    if vocab is not None and any(not 0 <= t < vocab for t, _ in p.logit_bias):
        raise ValueError(f"logit_bias names a token id outside the vocabulary (0..{vocab - 1})")


@dataclass(frozen=True)
class _Emitted:
    """A token from the speculative lane or a preempted row, shaped as the
    batch's responses."""

    token: int
    logprobs: Any
    finish_reason: str | None


def materialize(model: Any) -> None:
    """Evaluate every array the model holds, private ones included.

    MLX arrays are bound to the stream of the thread that created them: a
    lazy array built at load time (e.g. a rope's `_freqs`) cannot be
    evaluated later from the engine thread. `mlx_lm.load` evaluates only the
    parameters, so evaluate the rest here, on the loading thread.
    """
    mx.eval([v for _, v in tree_flatten(model) if isinstance(v, mx.array)])


class Engine:
    """Wires the scheduler, the memory accounting and the batch runner; see the
    module docstring."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        plan: KVPlan,
        kv_config: KVConfig,
        options: EngineOptions | None = None,
        *,
        coordinator: Coordinator | None = None,
        metrics: EngineMetrics | None = None,
        draft: DraftModel | None = None,
    ):
        materialize(model)
        if draft is not None:
            materialize(draft.model)
        self.model = model
        self.tokenizer = tokenizer
        self.plan = plan
        self.kv_config = kv_config
        self.options = options or EngineOptions()
        self.coordinator = coordinator or LocalCoordinator()
        self.metrics = metrics or EngineMetrics()
        self.readiness = Readiness()
        self.prompt_cache = PromptCache(
            self.options.prompt_cache_size, self.options.prompt_cache_bytes
        )
        self.max_context = self.options.max_context
        self.draft = draft
        self._untrimmable = any(p.window is not None or p.kind == "state" for p in plan.layers)
        self.inbox = Inbox()
        self.layout = choose_layout(plan, self.options.block_size)
        log.info("KV layout of the batch: %s", self.layout.description)
        ledger: Ledger | None = None
        self.capacity: Capacity | None = None
        if self.options.kv_cache_memory is not None:
            share = share_for(
                plan, self.options.kv_cache_memory,
                prefill_step=self.options.prefill_step_size,
                prompt_rows=self.options.prompt_concurrency,
                paged=self.layout.paged, block_size=self.layout.block_size or 0,
            )  # fmt: skip
            ledger = Ledger([share])
            self.capacity = ledger.capacity(capacity_tokens(self.max_context), self.max_context)
        # what a speculative sequence's draft-model caches cost (one row, no batch)
        draft_cost = (
            None
            if ledger is None or draft is None
            else CostModel.from_plan(
                draft.plan, prefill_step=self.options.prefill_step_size, prompt_rows=1
            )
        )
        # the speculative lane runs the model's own caches, not the block pools
        lane_cost = (
            None
            if draft_cost is None or self.layout.block_size is None
            else CostModel.from_plan(plan, prefill_step=self.options.prefill_step_size,
                                     prompt_rows=1)
        )  # fmt: skip
        # mlx_lm.server's XTC special tokens: the newline's tokens and EOS
        self._samplers = SamplerPool(
            xtc_special=(*tokenizer.encode("\n"), *tokenizer.eos_token_ids)
        )
        self.grammars = Grammars(tokenizer)
        if not self.grammars.available:
            log.warning("response_format json_object/json_schema will get 400: %s",
                        self.grammars.reason)  # fmt: skip
        self._eos = StopSequences([(t,) for t in tokenizer.eos_token_ids])
        self._eos_ids = frozenset(tokenizer.eos_token_ids)
        o = self.options
        self.runner = BatchRunner(
            model,
            RunnerOptions(
                o.decode_concurrency, o.prompt_concurrency, o.prefill_step_size,
                self.layout.block_size,
            ),  # fmt: skip
            self._eos, draft,
        )  # fmt: skip
        self.memory = KVMemory(
            ledger, self.prompt_cache, pages=self.runner.pages,
            prompt_cache_bytes=o.prompt_cache_bytes, draft_cost=draft_cost,
            live_bytes=self.runner.live_bytes, lane_cost=lane_cost,
        )  # fmt: skip
        self.scheduler = Scheduler(
            Limits(o.decode_concurrency, o.prompt_concurrency), self.memory, lane=draft is not None
        )
        self._kv_fraction = (0, 0)  # (quantized KV slots, KV slots) last seen
        self._failed = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlx-kvq-engine", daemon=True)
        self._batch_size = 0  # sequences decoded together in the last step

    @property
    def budget(self) -> Ledger | None:
        """What the sequences hold against the KV budget (None without one)."""
        return self.memory.ledger

    # ------------------------------------------------------------ public API
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the engine; requests still running are answered with an error."""
        self._stopping.set()
        self.inbox.post(Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)

    def drain(self, reason: str = SHUTTING_DOWN) -> None:
        """Refuse new requests (503) while those already submitted run to the end."""
        self.inbox.close(reason)
        self.readiness.set_draining(reason)

    def fail(self, reason: str) -> None:
        """Stop serving for good, from any thread: readiness fails with `reason`
        and every waiting and running request gets it as an error at once
        (the engine thread may be stuck, e.g. in a collective with a dead rank)."""
        self._failed.set()
        self.readiness.set_failed(reason)
        self._end_all(reason)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def state(self) -> ReadinessState:
        """Readiness as the probes report it: ready only while the engine thread runs."""
        state = self.readiness.get()
        if state.status is Status.READY and not self.alive:
            return ReadinessState(Status.FAILED, "engine thread exited", state.report)
        return state

    def submit(self, request: GenerationRequest, sink: EventSink) -> None:
        """Queue a request; its events arrive through `sink` (on the engine thread).

        A request whose prompt cannot fit the KV budget even alone (400) and
        one that finds the queue full (429) are refused at once, here.
        """
        refusal = self.inbox.offer(request, sink, self._refusal)
        if refusal is not None:
            sink(refusal)
        else:
            self.metrics.set_queue_depth(self.inbox.waiting)

    def _refusal(self, request: GenerationRequest, waiting: int) -> ErrorEvent | None:
        """A 400 for a request that can never fit the budget, a 429 when the queue is full."""
        refusal = self._too_large(request)
        if refusal is not None:
            return refusal
        limit = self.options.max_queued_requests
        if limit is not None and waiting >= limit:
            self.metrics.count_rejection(Rejection.QUEUE_FULL)
            return ErrorEvent(
                f"the server's queue is full ({limit} requests waiting, --max-queued-requests); "
                "retry later", 429, "queue_full", retry_after=QUEUE_RETRY_AFTER_S,
            )  # fmt: skip
        return None

    def _max_tokens(self, request: GenerationRequest) -> int:
        """The request's token limit, clamped to the context the plan allows."""
        max_tokens = request.params.max_tokens
        if self.max_context is not None:
            max_tokens = min(max_tokens, max(1, self.max_context - len(request.prompt)))
        return max_tokens

    def _too_large(self, request: GenerationRequest) -> ErrorEvent | None:
        """The 400 for a request whose prompt (and the decode reserve) needs more
        than the whole budget; `max_tokens` reserves nothing."""
        n = len(request.prompt)
        if self.budget is None or not n:
            return None
        need = Need(request.id, n, n, 1, n + self._max_tokens(request))
        verdict = self.memory.verdict(need)
        if verdict.fits_alone:
            return None
        self.metrics.count_rejection(Rejection.KV_BUDGET)
        longest = self.budget.longest_prompt(n, self.memory.first_shape(need).total - n)
        return ErrorEvent(
            f"this request's prompt needs {format_bytes(verdict.needs)} of KV cache "
            f"({n} prompt tokens and a decode reserve at {self.budget.share.cost.setting}), "
            f"more than the server's KV budget of {format_bytes(verdict.budget)} "
            f"(--kv-cache-memory) holds even alone; shorten the prompt to {longest:,} "
            f"tokens or less",
            400, "kv_budget_exceeded",
        )  # fmt: skip

    @property
    def vocab_size(self) -> int:
        """Token ids a request may name: the width of the model's logits once
        the warm-up has seen them, the tokenizer's size before."""
        return self._samplers.vocab or len(self.tokenizer)

    def cancel(self, request_id: int) -> None:
        """Drop a request (client gone); a no-op once it has finished."""
        self.inbox.post(Cancel(request_id))

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self.runner.open()
            self.memory.serving = True
            if not self._wait_for_gate():
                return
            self._agree_budget()
            verdict = self.coordinator.agree_warmup(self._warmup())
            if not verdict.ok:
                self._shutdown(verdict.error or "warm-up failed")
                return
            self.readiness.set_ready(verdict.report or {})
            self._publish()
            while not self._failed.is_set():
                commands = self._collect(block=not self.scheduler.busy)
                commands = self.coordinator.step(commands, self._status())
                self._apply(commands)
                if commands.stop:
                    break
                self._schedule()
                if self.runner.rows:
                    self._step()
                if self.runner.lane_busy:
                    self._lane_step()
                    self.memory.measure()  # the lane's caches (both models) after its step
                self._publish()
            self._shutdown(SHUTTING_DOWN, normal=True)
        except Exception as e:  # the engine is dead: say why, everywhere
            log.exception("engine thread failed")
            self._shutdown(f"engine failed: {type(e).__name__}: {e}")

    def _shutdown(self, reason: str, normal: bool = False) -> None:
        """Refuse new work, answer everything in flight with `reason`, release the batch."""
        notice = StopNotice(reason, normal and not self._failed.is_set())
        reason = self.coordinator.stopping(notice)
        if not self._failed.is_set():
            self.readiness.set_failed(reason)
        self._end_all(reason)
        self.memory.serving = False
        self.runner.close()
        self._publish()

    def _end_all(self, reason: str) -> None:
        """Refuse new requests and answer every queued and running one with an error."""
        ended: list[Sequence] = []

        def forget() -> None:
            ended.extend(self.scheduler.clear())
            if self.runner.lane_busy:
                self.runner.lane.drop()
            self.memory.clear()

        for sink in self.inbox.shut(reason, forget):
            sink(unavailable(reason))
        for seq in ended:
            seq.sink(unavailable(reason))
            self.metrics.count_request(Outcome.ERROR)

    def _wait_for_gate(self) -> bool:
        """Tests hold the warm-up back until a file exists; False if stopped meanwhile."""
        gate = self.options.warmup_gate
        while gate and not os.path.exists(gate):
            if self._stopping.wait(0.05):
                self._shutdown(SHUTTING_DOWN, normal=True)
                return False
        return True

    def _collect(self, block: bool) -> StepCommands:
        """This process's inbox as the step's commands (followers have no inbox)."""
        if not self.coordinator.leader:
            return StepCommands()
        commands, refused = self.inbox.take(block, IDLE_POLL_S)
        for sink in refused:
            sink(unavailable(SHUTTING_DOWN))
        return commands

    def _status(self) -> RankStatus:
        return RankStatus(
            kv_bytes=int(sum(self.metrics.kv_bytes_by_kind.values())),
            prompt_cache_bytes=self.prompt_cache.nbytes,
        )

    def _apply(self, commands: StepCommands) -> None:
        for request in commands.submits:
            self._accept(request, self.inbox.sink(request.id, _discard))
        if commands.cancels:
            self._cancel(set(commands.cancels))

    def _dequeue(self, request_id: int) -> None:
        self.inbox.admitted(request_id)

    def _accept(self, req: GenerationRequest, sink: EventSink) -> None:
        """Validate a request and queue it for the scheduler."""
        refusal = self._invalid(req)
        if refusal is not None:
            self._dequeue(req.id)
            sink(refusal)
            return
        seq = Sequence(
            req, sink, self.tokenizer.detokenizer, StopMatcher(req.params.stop),
            self._max_tokens(req),
        )  # fmt: skip
        try:
            check_logit_bias(req.params, self._samplers.vocab)
            seq.processors = make_processors(req.params, self.grammars)
        except Exception as e:  # noqa: BLE001 - this request's settings, not the engine
            self._fail(seq, e)
            return
        seq.speculative = (
            self.draft is not None
            and req.draft_tokens > 0
            and req.params.seed is None
            and not seq.processors
        )
        self.scheduler.add(seq)

    def _invalid(self, req: GenerationRequest) -> ErrorEvent | None:
        """The 400 for a request no batch slot can take (counted), or None."""
        n = len(req.prompt)
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
        return self._too_large(req)  # again: a group's shares are known by now

    def _cancel(self, ids: set[int]) -> None:
        for request_id in ids:
            self._dequeue(request_id)
        for seq in [s for s in self.scheduler if s.id in ids]:
            if seq.on_lane and self.runner.lane_busy and self.runner.lane.owner is seq:
                self.runner.lane.drop()
            elif seq.uid is not None:
                self.runner.remove([seq])
            started = seq.status is not RequestStatus.WAITING
            self.scheduler.finish(seq)
            self.metrics.count_request(Outcome.CANCELLED)
            if started:
                log.info("request %d cancelled after %d tokens", seq.id, seq.completion_tokens)

    # ------------------------------------------------------------ the plan
    def _schedule(self) -> None:
        """Plan the step (`Scheduler.schedule`) and apply the plan: preempt,
        end what cannot grow, move the lane's sequence into the batch, start
        speculation, insert the admitted sequences.

        Speculative decoding runs one sequence, so it pays only while that
        sequence is all the engine does: a request asking for it gets the
        lane when nothing else is running or waiting. Any other request then
        moves the lane's sequence into the batch first (its cache and the
        tokens so far go with it), so no request is slowed down by another
        one's speculation. The batch says the same text for greedy decoding,
        and a sample of the same distribution otherwise. Seeded requests
        never speculate: the speculative loop draws from the key chain in
        another order than the batch does, and a seed must give one text.
        Nor do requests with logits processors (penalties, `logit_bias`, a
        grammar): mlx-lm's speculative loop shows them only the tokens since
        the cached prefix, and a grammar's state cannot follow a sequence
        moved into the batch; the batch applies them over the whole context.
        A request whose draft-model caches do not fit the budget next to its
        own is decoded in the batch.
        """
        if self.budget is not None and not self.runner.rows:
            self.budget.settle()  # an empty batch holds nothing any more
        plan = self.scheduler.schedule()
        if plan:
            self._carry_out(plan)
        self.memory.trim_prompt_cache()
        self.memory.measure()

    def _carry_out(self, plan: StepPlan) -> None:
        for seq in plan.preempted:
            self._preempt(seq)
        for seq in plan.exhausted:
            self._exhaust(seq)
        if plan.to_batch is not None:
            self._move_to_batch(plan.to_batch)
        if plan.speculate is not None:
            seq = plan.speculate
            self._dequeue(seq.id)
            self.prompt_cache.touch(seq.tokens)  # it yields before the copy is made
            self.memory.trim_prompt_cache()
            self._guarded(seq, self._start_speculation)
            self.metrics.count_draft_request(speculative=True)
        for seq in plan.admitted:  # the prompt cache yields to them before their copies are made
            self.prompt_cache.touch(seq.tokens)
        if plan.admitted:
            self.memory.trim_prompt_cache()
        for seq in plan.admitted:
            self._dequeue(seq.id)
            first = seq.preemptions == 0
            if self._guarded(seq, self._insert) and first and seq.request.draft_tokens > 0:
                self.metrics.count_draft_request(speculative=False)

    def _guarded(self, seq: Sequence, action: Any) -> bool:
        """Run `action(seq)`; if it raises, `seq` fails alone."""
        try:
            action(seq)
        except Exception as e:  # noqa: BLE001 - this request's settings, not the engine
            if self.runner.lane_busy and self.runner.lane.owner is seq:
                self.runner.lane.drop()
            self._fail(seq, e)
            return False
        return True

    def _checkpoints(self, request: GenerationRequest) -> tuple:
        """The request's checkpoints, when some cache of the plan cannot be
        trimmed back (otherwise the longest entry serves every prefix)."""
        return request.checkpoints if self._untrimmable else ()

    def _prepare(self, seq: Sequence) -> tuple[list[int], list, int]:
        """The tokens `seq` starts (or resumes) from, its sampler, and the prompt
        cache's best cache for them (a fresh one when none matches) with how
        many tokens it holds."""
        tokens = seq.tokens
        if seq.sampler is None:  # a resumed sequence keeps its sampler (and its key chain)
            seq.sampler = self._samplers.get(seq.request.params)
        cache, cached = self.prompt_cache.fetch(tokens)
        if cache is None:
            cache, cached = self.plan.make_cache(), 0
        if seq.preemptions == 0:
            seq.cached = cached
            self.metrics.record_cached_tokens(cached)
        return tokens, cache, cached

    def _insert(self, seq: Sequence) -> None:
        tokens, cache, cached = self._prepare(seq)
        resumed = seq.preemptions > 0
        checkpoints = () if resumed else self._checkpoints(seq.request)
        pieces, cuts = split_prompt(tokens, cached, checkpoints)
        seq.cuts = deque(cuts)
        reused = self.runner.insert(
            seq, pieces, cache, tokens[:cached], seq.max_tokens - len(seq.generated)
        )
        self.memory.inserted(seq.id)
        if reused:
            self.metrics.count_prefix_blocks(reused)
            log.info(
                "request %d maps %d prefix blocks by reference (%d cached tokens)",
                seq.id, reused, cached,
            )  # fmt: skip
        if resumed:
            self.metrics.count_resumption()
            log.info(
                "request %d resumes after %d tokens (%d of %d held in the prompt cache)",
                seq.id, seq.completion_tokens, cached, len(tokens),
            )  # fmt: skip

    def _preempt(self, seq: Sequence) -> None:
        """Take `seq` out of the batch (the scheduler has put it back in the
        queue): emit the token already sampled for it, keep its cache in the
        prompt cache while room lasts."""
        taken = self.runner.take_out(seq)
        self.metrics.count_preemption()
        log.info(
            "request %d preempted after %d tokens (%d sequences running); it resumes later",
            seq.id, seq.completion_tokens, len(self.scheduler.running),
        )  # fmt: skip
        if taken.pending is not None:
            token, logprobs = taken.pending
            reason = None
            if token in self._eos_ids:
                reason = FinishReason.STOP
            elif seq.completion_tokens + 1 >= seq.max_tokens:
                reason = FinishReason.LENGTH
            try:
                done = self._on_token(seq, _Emitted(token, logprobs, reason))
            except Exception as e:  # noqa: BLE001 - detokenizing this request failed
                self._fail(seq, e)
                return
            if done:
                self._complete(seq, reason or FinishReason.STOP, taken.cache, taken.tokens)
                return
        if taken.cache is not None and taken.tokens:
            self.memory.store_prompt(taken.tokens, taken.cache, Segment.ANSWER)

    def _exhaust(self, seq: Sequence) -> None:
        """`seq` cannot grow even alone: it ends with `length` (the scheduler has
        released it), its last token the one already sampled for it."""
        log.warning(
            "request %d ends with length after %d tokens: its sequence (%d tokens) cannot "
            "grow further within the KV budget even alone",
            seq.id, seq.completion_tokens, len(seq.request.prompt) + seq.completion_tokens,
        )  # fmt: skip
        if seq.on_lane or (self.runner.lane_busy and self.runner.lane.owner is seq):
            cache, tokens, _ = self.runner.lane.take(seq.completion_tokens)
            self._complete(seq, FinishReason.LENGTH, cache, tokens)
            return
        taken = self.runner.take_out(seq)
        if taken.pending is not None:
            token, logprobs = taken.pending
            try:
                self._on_token(seq, _Emitted(token, logprobs, FinishReason.LENGTH.value))
            except Exception as e:  # noqa: BLE001 - detokenizing this request failed
                self._fail(seq, e)
                return
        self._complete(seq, FinishReason.LENGTH, taken.cache, taken.tokens)

    # ------------------------------------------------------- speculative lane
    def _start_speculation(self, seq: Sequence) -> None:
        """Give the lane to `seq`, with the prompt cache's best cache for its prompt."""
        prompt, cache, cached = self._prepare(seq)
        self.runner.lane.start(
            seq,
            prompt,
            self.runner.for_lane(cache),
            cached,
            max_tokens=seq.max_tokens,
            num_draft_tokens=seq.request.draft_tokens,
            sampler=seq.sampler,
            checkpoints=self._checkpoints(seq.request),
        )

    def _move_to_batch(self, seq: Sequence) -> None:
        """The lane's sequence goes on in the batch: its cache, its tokens so
        far, what is left of its token limit (see `_schedule`). If that fails,
        the lane's request fails, not the one that made it move."""
        try:
            cache, held, rest = self.runner.lane.take(seq.completion_tokens, leave=1)
            if seq.completion_tokens:
                pieces, cuts = [rest], []
            else:  # still prefilling: the rest of the prompt, cut where the prompt cache copies
                pieces, cuts = split_prompt(held + rest, len(held), self._checkpoints(seq.request))
            seq.cuts = deque(cuts)
            self.runner.insert(seq, pieces, cache, held, seq.max_tokens - seq.completion_tokens)
        except Exception as e:  # noqa: BLE001 - the lane's request fails, the engine goes on
            self.runner.lane.drop()
            self._fail(seq, e)
            return
        self.metrics.count_draft_moved()
        log.info(
            "request %d moves from speculative decoding to the batch after %d tokens",
            seq.id, seq.completion_tokens,
        )  # fmt: skip

    def _lane_step(self) -> None:
        """One unit of the lane's work: a prefill chunk or one draft-and-verify cycle."""
        lane = self.runner.lane
        seq = lane.owner
        try:
            work = lane.step()
        except Exception as e:  # noqa: BLE001 - this request's decoding failed, not the engine
            lane.drop()
            self._fail(seq, e)
            return
        self.metrics.record_step(
            work.prompt_tokens, work.prompt_time, len(work.tokens), work.decode_time
        )
        for tokens, cache, segment in work.snapshots:
            if self.prompt_cache.max_entries:
                self.memory.store_prompt(tokens, cache, segment)
        if work.tokens:
            self.scheduler.prompt_done(seq)
            self.metrics.record_drafts(work.proposed, sum(t.from_draft for t in work.tokens))
        for t in work.tokens:
            reason = None
            if t.token in self._eos_ids:
                reason = FinishReason.STOP.value
            elif seq.completion_tokens + 1 >= seq.max_tokens:
                reason = FinishReason.LENGTH.value
            try:
                done = self._on_token(seq, _Emitted(t.token, t.logprobs, reason))
            except Exception as e:  # noqa: BLE001 - detokenizing this request failed
                lane.drop()
                self._fail(seq, e)
                return
            if seq.sampler.error is not None:
                lane.drop()
                self._fail(seq, seq.sampler.take_error())
                return
            if done:
                cache, tokens, _ = lane.take(seq.completion_tokens)
                self._complete(seq, FinishReason(reason or "stop"), cache, tokens)
                return

    # ------------------------------------------------------------ the batch
    def _step(self) -> None:
        step = self.runner.step()
        self.metrics.record_step(
            step.prompt_tokens, step.prompt_time, step.generation_tokens, step.decode_time
        )
        rows = self.runner.rows
        stepped = {id(s.sampler): s.sampler for s in rows.values()}
        for r in step.prompt:
            if r.end_of_prompt and r.uid in rows:
                self.scheduler.prompt_done(rows[r.uid])
        self._snapshot_prompts(step.prompt)
        self._send_progress(step.prompt)
        self._batch_size = len(step.tokens)
        stopped = []
        for r in step.tokens:
            seq = rows.get(r.uid)
            if seq is None:
                continue
            try:
                done = self._on_token(seq, r)
            except Exception as e:  # noqa: BLE001 - detokenizing this request failed
                self._fail(seq, e)
                continue
            if done:
                if r.finish_reason is not None:  # mlx-lm took the row out itself
                    self.runner.rows.pop(r.uid, None)
                    seq.uid = None
                    reason = FinishReason(r.finish_reason)
                    self._complete(seq, reason, r.prompt_cache, r.all_tokens)
                else:
                    stopped.append(seq)
        if stopped:  # stop strings: take them out of the batch, keep their caches
            held = self.runner.remove(stopped, keep_caches=True)
            for seq in stopped:
                cache, tokens = held.get(seq.id, (None, None))
                self._complete(seq, FinishReason.STOP, cache, tokens)
        self._fail_sampling_errors(list(stepped.values()))
        self.memory.settle()

    def _fail_sampling_errors(self, stepped: list[Guarded]) -> None:
        """Fail the requests whose sampler or logits processor raised during the
        step (see sampling.Guarded and processors.GuardedProcessor), then clear
        the errors of every sampler the step used (`stepped`): the batch samples
        one token ahead, so the error of a request that finished in this step
        is about a token never used, and a shared sampler must not carry it
        to the next request with the same settings."""
        failed = {id(s) for s in stepped if s.error}
        for seq in list(self.runner.rows.values()):
            error = next((p.error for p in seq.processors or () if p.error is not None), None)
            if id(seq.sampler) in failed:
                error = seq.sampler.error
            if error is not None:
                self._fail(seq, error)
        for sampler in stepped:
            sampler.take_error()

    def _send_progress(self, prompt_responses: tuple) -> None:
        """Tell requests that asked for it how far their prompt's prefill is."""
        for r in prompt_responses:
            seq = self.runner.rows.get(r.uid)
            if seq is not None and seq.request.progress:
                seq.sink(PromptProgress(*r.progress))

    def _snapshot_prompts(self, prompt_responses: tuple) -> None:
        """Cache each prompt at its cuts as it is processed (`engine.segments`):
        the system prompt, the prompt before its think tail, all but its last
        token. Later prompts start with these exact prefixes, so the entries
        are reusable even by caches that cannot trim (sliding windows that
        have wrapped), as in mlx-lm's segment caching. A resumed sequence's
        prompt was cut the first time."""
        if self.prompt_cache.max_entries == 0:
            return
        rows = self.runner.rows
        done = [
            rows[r.uid] for r in prompt_responses
            if r.end_of_segment and not r.end_of_prompt and r.uid in rows
        ]  # fmt: skip
        done = [s for s in done if s.preemptions == 0]
        for request_id, (cache, tokens) in self.runner.extract(done).items():
            seq = next(s for s in done if s.id == request_id)
            segment = seq.cuts.popleft() if seq.cuts else Segment.CONTEXT
            self.memory.store_prompt(tokens, cache, segment)

    # ------------------------------------------------------------ events
    def _on_token(self, seq: Sequence, r: Any) -> bool:
        """Emit one token's event; True when the sequence is done."""
        seq.generated.append(int(r.token))
        eos = r.finish_reason == FinishReason.STOP  # the only stop sequences given are EOS ids
        final = r.finish_reason is not None
        if not eos:
            seq.detokenizer.add_token(r.token)
        if final:
            seq.detokenizer.finalize()
        text, hit = seq.stopper.feed(seq.detokenizer.last_segment, final=final)
        p = seq.request.params
        logprob, top = None, ()
        if p.logprobs:
            logprob = r.logprobs[r.token].item()
            top = top_logprobs(r.logprobs, p.top_logprobs)
        seq.sink(TokenEvent(r.token, text, logprob, top, eos))
        seq.stop_hit = seq.stop_hit or hit
        return final or hit

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """End one request with an error; the batch and the engine go on."""
        log.error("request %d failed: %s: %s", seq.id, type(error).__name__, error, exc_info=error)
        if seq.uid is not None:
            self.runner.remove([seq])
        self._dequeue(seq.id)
        self.scheduler.finish(seq)
        seq.sink(ErrorEvent(f"this request failed: {type(error).__name__}: {error}", 500))
        self.metrics.count_request(Outcome.ERROR)

    def _complete(
        self, seq: Sequence, reason: FinishReason, cache: list | None, tokens: list[int] | None
    ) -> None:
        """Answer `seq` with its finish event and keep its cache for reuse."""
        self.scheduler.finish(seq)
        if seq.stop_hit:
            reason = FinishReason.STOP
        if cache is not None and tokens:
            self.memory.store_prompt(tokens, cache, Segment.ANSWER)
        usage = Usage(len(seq.request.prompt), seq.completion_tokens, seq.cached)
        seq.sink(FinishEvent(reason, usage))
        self.metrics.count_request(Outcome.OK)
        log.info(
            "request %d: %d prompt tokens (%d cached), %d generated, %s, %.2fs%s",
            seq.id, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
            reason.value, time.monotonic() - seq.started,
            f", preempted {seq.preemptions}x" if seq.preemptions else "",
        )  # fmt: skip

    # ------------------------------------------------------- memory and metrics
    def _agree_budget(self) -> None:
        """Every rank's share of the budget (this process's alone, unless in a
        group), and the capacity line."""
        ledger = self.budget
        if ledger is None:
            return
        ledger.shares, ledger.me = self.coordinator.agree_budget(ledger.share)
        self.capacity = ledger.capacity(capacity_tokens(self.max_context), self.max_context)
        if self.coordinator.leader and len(ledger.shares) > 1:
            log.info("%s", self.capacity.line)  # the group's (a process logs its own at startup)

    def _publish(self) -> None:
        live = bool(self.scheduler.running) or self.runner.lane_busy
        report = cache_report(self.runner.caches()) if live else []
        by_kind: dict[str, int] = {}
        kv = quantized = 0
        for slot in report:
            by_kind[slot["kind"]] = by_kind.get(slot["kind"], 0) + int(slot["nbytes"])
            if slot["kind"] in KV_KINDS:
                kv += 1
                quantized += int(bool(slot["quantized"]))
        if kv:
            self._kv_fraction = (quantized, kv)
        if self.budget is not None:
            self.metrics.set_budget(BudgetFigures(**self.memory.figures()))
        pages = self.runner.pages_stats()
        if pages is not None:
            self.metrics.set_blocks(
                BlockFigures(
                    self.runner.pages.block_size, pages.pools, pages.capacity, pages.used,
                    pages.shared, pages.nbytes, pages.used_bytes,
                )
            )  # fmt: skip
        waiting = self.scheduler.waiting
        self.metrics.set_state(
            queue_depth=max(self.inbox.waiting, len(waiting)),
            batch_size=self._batch_size if self.runner.rows else 0,
            kv_bytes_by_kind=by_kind,
            kv_layers=self._kv_fraction[1],
            kv_layers_quantized=self._kv_fraction[0],
            prompt_cache=self.prompt_cache.stats(),
            preempted=sum(s.status is RequestStatus.PREEMPTED for s in list(waiting)),
        )

    # ------------------------------------------------------------ warm-up
    def _warmup(self) -> WarmupVerdict:
        """Run the readiness warm-up through the real batch path (and the
        speculative lane, with a draft model); this rank's verdict."""
        t0 = time.monotonic()
        spec = warmup_spec(self.plan.max_window, self.kv_config, self.max_context)
        filler = list(self.tokenizer.encode(WARMUP_TEXT)) or [0]
        prompts = [(filler * (n // len(filler) + 1))[:n] for n in spec.prompt_lengths]
        run = self.runner.warm_up(prompts, spec.max_tokens, self.plan.make_cache)
        self._samplers.vocab = run.vocab or self._samplers.vocab
        try:
            report = verify_warmup(
                self.kv_config, len(self.plan.kv_layers), run.batch_report, run.longest_report,
                run.longest, spec,
            )  # fmt: skip
        except WarmupFailed as e:
            log.error("%s", e)
            return WarmupVerdict(False, error=str(e))
        if self.runner.lane is not None:
            try:
                report["speculative"] = self._warmup_speculation(filler)
            except Exception as e:  # noqa: BLE001 - the draft path does not work: not ready
                log.error("speculative warm-up failed: %s", e)
                return WarmupVerdict(False, error=f"speculative warm-up failed: {e}")
        mx.clear_cache()
        report["seconds"] = round(time.monotonic() - t0, 3)
        kv = [s for s in run.batch_report if s["kind"] in KV_KINDS]
        self._kv_fraction = (sum(bool(s["quantized"]) for s in kv), len(kv))
        log.info("warm-up done in %.2fs: %s", report["seconds"], report["batch"])
        return WarmupVerdict(True, report=report)

    def _warmup_speculation(self, filler: list[int]) -> dict:
        """One greedy sequence through the lane, past every window of both
        models, drafting and rewinding; the caches it leaves are checked."""
        windows = [self.plan.max_window or 0, self.draft.plan.max_window or 0]
        n = max(*windows, self.kv_config.quantized_start) + WARMUP_MARGIN
        k = self.draft.num_draft_tokens
        prompt = (filler * (n // len(filler) + 1))[:n]
        run = self.runner.warm_up_lane(prompt, self.plan.make_cache(), k, 4 * (k + 1))
        report = verify_speculation(
            self.kv_config, run.target_report, run.draft_report, run.windows, k
        )
        report.update(
            draft_model=self.draft.name, num_draft_tokens=k, prompt_tokens=n,
            generated=run.generated, accepted=run.accepted,
        )  # fmt: skip
        log.info(
            "speculative warm-up: %d tokens, %d drafted tokens accepted",
            run.generated, run.accepted,
        )  # fmt: skip
        return report

"""The serving engine: one thread that owns the model and decodes in batches.

Other threads call `submit()`, `cancel()`, `drain()`, `stop()` and `fail()`;
the first three post small messages to the engine's inbox. Between steps the
engine thread turns its inbox into this step's `StepCommands`, hands them to
its coordinator (the identity for a single process; under `mlx.launch`, rank
0's commands become every rank's), applies them, inserts requests into
mlx-lm's `BatchGenerator` with caches from the KV plan (quantized, full and
sliding-window alike), steps the batch and pushes events back through each
request's sink. Finished sequences leave their caches in the prompt cache;
cancelled ones leave the batch at the next step, which frees their memory.
With a draft model, a request that arrives while the engine serves nothing
else is decoded speculatively (`speculation.SpeculativeLane`) until another
request arrives; then it moves into the batch.

With a KV memory budget (`EngineOptions.kv_cache_memory`), requests are
admitted in order when their sequence's worst case fits what the budget has
left, the prompt cache yielding first (`budget.Ledger`); the bytes the caches
really hold are measured after every step against the budget.

Whatever one request carries (its sampler, its logits processors, its text)
can only fail that request: the batch and the engine go on (see
`sampling.Guarded` and `processors.GuardedProcessor`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import greedy_sampler

from mlx_kvq.caches import KVQWindowCache, cache_report
from mlx_kvq.config import KVConfig
from mlx_kvq.mlx_lm_internals import batch_caches
from mlx_kvq.plan import KV_KINDS, KVPlan

from .budget import (
    Capacity,
    CostModel,
    Ledger,
    Shape,
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
from .metrics import BudgetFigures, EngineMetrics
from .processors import Grammars, GuardedProcessor, make_processors
from .prompt_cache import PromptCache
from .requests import (
    Cancel,
    ErrorEvent,
    Event,
    EventSink,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    Message,
    Outcome,
    PromptProgress,
    Rejection,
    SamplingParams,
    Segment,
    Stop,
    Submit,
    TokenEvent,
    Usage,
)
from .sampling import Guarded, SamplerPool, top_logprobs
from .segments import split_prompt
from .speculation import DraftModel, SpeculativeLane
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
    max_queued_requests: int | None = None  # waiting requests before a 429 (None: no limit)
    warmup_gate: str | None = None  # warm-up waits until this file exists (tests)


def _discard(_event: Event) -> None:
    """The sink of a request this process does not answer (a follower rank)."""


@dataclass
class _Live:
    """Engine-side state of one admitted request."""

    request: GenerationRequest
    sink: EventSink
    detokenizer: Any
    stopper: StopMatcher
    sampler: Guarded | None = None
    processors: list[GuardedProcessor] | None = None  # made once, when first considered
    cached: int = 0
    completion_tokens: int = 0
    uid: int | None = None  # in the batch (None: queued, or in the speculative lane)
    cuts: deque[Segment] = field(default_factory=deque)  # what the next prompt cuts store
    stop_hit: bool = False
    started: float = field(default_factory=time.monotonic)


def check_logit_bias(p: SamplingParams, vocab: int | None) -> None:
    """Refuse `logit_bias` token ids outside the model's logits (mlx-lm would
    index out of bounds)."""
    if vocab is not None and any(not 0 <= t < vocab for t, _ in p.logit_bias):
        raise ValueError(f"logit_bias names a token id outside the vocabulary (0..{vocab - 1})")


@dataclass(frozen=True)
class _Emitted:
    """A token from the speculative lane, shaped as the batch's responses."""

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
    """Continuous batching over a KV plan; see the module docstring."""

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
        self._untrimmable = any(p.window is not None or p.kind == "state" for p in plan.layers)
        self._inbox: queue.Queue[Message] = queue.Queue()
        self._sinks: dict[int, EventSink] = {}  # submitted requests not yet accepted
        self._pending: deque[_Live] = deque()
        self._live: dict[int, _Live] = {}  # by BatchGenerator uid
        self._queued: set[int] = set()  # ids submitted here and not yet admitted or ended
        self._prompting: set[int] = set()  # uids whose prompt is still being processed
        self.budget: Ledger | None = None
        self.capacity: Capacity | None = None
        if self.options.kv_cache_memory is not None:
            share = share_for(
                plan, self.options.kv_cache_memory,
                prefill_step=self.options.prefill_step_size,
                prompt_rows=self.options.prompt_concurrency,
            )  # fmt: skip
            self.budget = Ledger([share])
            self.capacity = self.budget.capacity(capacity_tokens(self.max_context))
        # what a speculative sequence's draft-model caches cost (one row, no batch)
        self._draft_cost = (
            None
            if self.budget is None or draft is None
            else CostModel.from_plan(
                draft.plan, prefill_step=self.options.prefill_step_size, prompt_rows=1
            )
        )
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
        self._kv_fraction = (0, 0)  # (quantized KV slots, KV slots) last seen
        self._lock = threading.Lock()  # guards _closed, the inbox and the request sets
        self._closed: str | None = None  # reason new requests are refused
        self._failed = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlx-kvq-engine", daemon=True)
        self._bg: BatchGenerator | None = None
        self._batch_size = 0  # sequences decoded together in the last step
        self.draft = draft
        self._lane = (
            None if draft is None else SpeculativeLane(model, draft, self.options.prefill_step_size)
        )

    # ------------------------------------------------------------ public API
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the engine; requests still running are answered with an error."""
        self._stopping.set()
        self._inbox.put(Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)

    def drain(self, reason: str = SHUTTING_DOWN) -> None:
        """Refuse new requests (503) while those already submitted run to the end."""
        with self._lock:
            if self._closed is None:
                self._closed = reason
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

        A request whose sequence cannot fit the KV budget even alone (400) and
        one that finds the queue full (429) are refused at once, here.
        """
        with self._lock:
            if self._closed is not None:
                refusal = ErrorEvent(self._closed, 503, "engine_unavailable")
            else:
                refusal = self._refusal(request)
                if refusal is None:
                    self._queued.add(request.id)
                    self._inbox.put(Submit(request, sink))
                    self.metrics.set_queue_depth(len(self._queued))
                    return
        sink(refusal)

    def _refusal(self, request: GenerationRequest) -> ErrorEvent | None:
        """A 400 for a request that can never fit the budget, a 429 when the queue is full."""
        refusal = self._too_large(request)
        if refusal is not None:
            return refusal
        limit = self.options.max_queued_requests
        if limit is not None and len(self._queued) >= limit:
            self.metrics.count_rejection(Rejection.QUEUE_FULL)
            return ErrorEvent(
                f"the server's queue is full ({limit} requests waiting, --max-queued-requests); "
                "retry later", 429, "queue_full", retry_after=QUEUE_RETRY_AFTER_S,
            )  # fmt: skip
        return None

    def _shape(self, request: GenerationRequest) -> Shape:
        """What `request`'s sequence can hold: its prompt and prompt + max_tokens."""
        n = len(request.prompt)
        max_tokens = request.params.max_tokens
        if self.max_context is not None:
            max_tokens = min(max_tokens, max(1, self.max_context - n))
        return Shape(n, n + max_tokens)

    def _too_large(self, request: GenerationRequest) -> ErrorEvent | None:
        """The 400 for a request whose sequence needs more than the whole budget."""
        if self.budget is None or not request.prompt:
            return None
        shape = self._shape(request)
        verdict = self.budget.verdict(shape)
        if verdict.fits_alone:
            return None
        self.metrics.count_rejection(Rejection.KV_BUDGET)
        fix = (
            f"lower max_tokens to {verdict.max_tokens_fit} or less"
            if verdict.max_tokens_fit
            else "shorten the prompt"
        )
        return ErrorEvent(
            f"this request needs up to {format_bytes(verdict.needs)} of KV cache "
            f"({shape.prompt} prompt tokens + {shape.total - shape.prompt} max_tokens at "
            f"{self.budget.share.cost.setting}), more than the server's KV budget of "
            f"{format_bytes(verdict.budget)} (--kv-cache-memory) holds even alone; {fix}",
            400, "kv_budget_exceeded",
        )  # fmt: skip

    @property
    def vocab_size(self) -> int:
        """Token ids a request may name: the width of the model's logits once
        the warm-up has seen them, the tokenizer's size before."""
        return self._samplers.vocab or len(self.tokenizer)

    def cancel(self, request_id: int) -> None:
        """Drop a request (client gone); a no-op once it has finished."""
        self._inbox.put(Cancel(request_id))

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self._bg = BatchGenerator(
                self.model,
                completion_batch_size=self.options.decode_concurrency,
                prefill_batch_size=self.options.prompt_concurrency,
                prefill_step_size=self.options.prefill_step_size,
            )
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
                commands = self._collect(block=not (self._live or self._pending or self._lane_busy))
                commands = self.coordinator.step(commands, self._status())
                self._apply(commands)
                if commands.stop:
                    break
                self._admit()
                if self._live:
                    self._step()
                if self._lane_busy:
                    self._lane_step()
                    self._measure()  # the lane's caches (both models) after its step
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
        self._bg = None
        self._publish()

    def _end_all(self, reason: str) -> None:
        """Refuse new requests and answer every queued and running one with an error."""
        with self._lock:
            self._closed = reason
            ended = list(self._live.values()) + list(self._pending)
            if self._lane_busy:
                ended.append(self._lane.owner)
                self._lane.drop()
            self._live, self._pending = {}, deque()
            self._queued.clear()
            self._prompting.clear()
            if self.budget is not None:
                self.budget.clear()
            sinks, self._sinks = list(self._sinks.values()), {}
            while True:
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(message, Submit):
                    sinks.append(message.sink)
        for sink in sinks:
            sink(ErrorEvent(reason, 503, "engine_unavailable"))
        for live in ended:
            live.sink(ErrorEvent(reason, 503, "engine_unavailable"))
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
        messages: list[Message] = []
        try:
            messages.append(
                self._inbox.get(timeout=IDLE_POLL_S) if block else self._inbox.get_nowait()
            )
            while True:
                messages.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        submits: list[GenerationRequest] = []
        cancels: set[int] = set()
        stop = False
        for m in messages:
            if isinstance(m, Stop):
                stop = True
            elif isinstance(m, Cancel):
                cancels.add(m.request_id)
            elif stop:  # queued behind the stop: refused, like any later request
                self._dequeue(m.request.id)
                m.sink(ErrorEvent(SHUTTING_DOWN, 503, "engine_unavailable"))
            else:
                self._sinks[m.request.id] = m.sink
                submits.append(m.request)
        return StepCommands(tuple(submits), frozenset(cancels), stop)

    def _status(self) -> RankStatus:
        return RankStatus(
            kv_bytes=int(sum(self.metrics.kv_bytes_by_kind.values())),
            prompt_cache_bytes=self.prompt_cache.nbytes,
        )

    def _apply(self, commands: StepCommands) -> None:
        for request in commands.submits:
            self._accept(request, self._sinks.pop(request.id, _discard))
        if commands.cancels:
            self._cancel(set(commands.cancels))

    def _dequeue(self, request_id: int) -> None:
        with self._lock:
            self._queued.discard(request_id)

    def _accept(self, req: GenerationRequest, sink: EventSink) -> None:
        """Validate and queue a request for a batch slot."""
        refusal = self._invalid(req)
        if refusal is not None:
            self._dequeue(req.id)
            sink(refusal)
            return
        self._pending.append(
            _Live(req, sink, self.tokenizer.detokenizer, StopMatcher(req.params.stop))
        )

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
        kept = deque(live for live in self._pending if live.request.id not in ids)
        for _ in range(len(self._pending) - len(kept)):
            self.metrics.count_request(Outcome.CANCELLED)
        self._pending = kept
        for request_id in ids:
            self._dequeue(request_id)
        if self._lane_busy and self._lane.owner.request.id in ids:
            live = self._lane.owner
            self._lane.drop()
            self._release(live)
            self.metrics.count_request(Outcome.CANCELLED)
            log.info(
                "request %d cancelled after %d tokens", live.request.id, live.completion_tokens
            )
        uids = [uid for uid, live in self._live.items() if live.request.id in ids]
        if uids:
            self._bg.remove(uids)
            for uid in uids:
                live = self._live.pop(uid)
                self._release(live)
                self.metrics.count_request(Outcome.CANCELLED)
                log.info(
                    "request %d cancelled after %d tokens", live.request.id, live.completion_tokens
                )

    def _admit(self) -> None:
        """Start queued requests, in order, while there is room: a decode slot,
        fewer than `prompt_concurrency` prompts being processed, and (with a
        budget) room for the worst case of the request at the head of the
        queue, the prompt cache yielding to it (the entry it reuses last).
        Nothing overtakes a request that waits.

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
        if self.budget is not None and not self._live:
            self.budget.settle()  # an empty batch holds nothing any more
        waiting: deque[_Live] = deque()
        while self._pending:
            live = self._pending.popleft()
            try:
                if live.processors is None:
                    check_logit_bias(live.request.params, self._samplers.vocab)
                    live.processors = make_processors(live.request.params, self.grammars)
                if waiting:  # a request ahead of it waits: so does it
                    waiting.append(live)
                    continue
                speculate = (
                    self._lane is not None
                    and live.request.draft_tokens > 0
                    and live.request.params.seed is None
                    and not live.processors
                )
                idle = not (self._live or self._lane_busy or self._pending)
                if speculate and idle and self._reserve(live, lane=True):
                    self._dequeue(live.request.id)
                    self._start_speculation(live)
                    self.metrics.count_draft_request(speculative=True)
                    continue
                if len(self._live) + self._lane_busy >= self.options.decode_concurrency:
                    waiting.append(live)
                    continue
                if self._lane_busy:
                    self._move_to_batch()
                if len(self._prompting) >= self.options.prompt_concurrency or not self._reserve(
                    live
                ):
                    waiting.append(live)
                    continue
                self._dequeue(live.request.id)
                self._insert(live)
                if live.request.draft_tokens > 0:
                    self.metrics.count_draft_request(speculative=False)
            except Exception as e:  # noqa: BLE001 - this request's settings, not the engine
                if self._lane is not None and self._lane.owner is live:
                    self._lane.drop()
                self._dequeue(live.request.id)
                self._fail(live, e)
        self._pending = waiting
        self._trim_prompt_cache()
        self._measure()

    def _reserve(self, live: _Live, lane: bool = False) -> bool:
        """Reserve `live`'s worst case in the budget if it fits (always, without
        a budget); on the speculative lane its draft model's caches too, and
        both sides keep up to `num_draft_tokens` + 1 rewound tokens. The prompt
        cache yields to it before the copy it reuses is made."""
        if self.budget is None:
            return True
        shape, extra = self._shape(live.request), 0
        if lane:
            keep = live.request.draft_tokens + 1
            shape = Shape(shape.prompt + keep, shape.total + keep)
            extra = self._draft_cost.bound([shape]) if self._draft_cost is not None else 0
        if not self.budget.fits(shape, extra):
            return False
        self.budget.reserve(live.request.id, shape, extra)
        self.prompt_cache.touch(list(live.request.prompt))
        self._trim_prompt_cache()
        return True

    def _max_tokens(self, request: GenerationRequest) -> int:
        """The request's token limit, clamped to the context the plan allows."""
        max_tokens = request.params.max_tokens
        if self.max_context is not None:
            max_tokens = min(max_tokens, self.max_context - len(request.prompt))
        return max_tokens

    def _prepare(self, live: _Live) -> tuple[list[int], list, int]:
        """The request's prompt, sampler, and the prompt cache's best cache for
        it (a fresh one when none matches) with how many tokens it holds."""
        prompt = list(live.request.prompt)
        live.sampler = self._samplers.get(live.request.params)
        cache, cached = self.prompt_cache.fetch(prompt)
        if cache is None:
            cache, cached = self.plan.make_cache(), 0
        live.cached = cached
        self.metrics.record_cached_tokens(cached)
        return prompt, cache, cached

    def _insert(self, live: _Live) -> None:
        prompt, cache, cached = self._prepare(live)
        max_tokens = self._max_tokens(live.request)
        pieces, cuts = split_prompt(prompt, cached, self._checkpoints(live.request))
        live.cuts = deque(cuts)
        (uid,) = self._bg.insert_segments(
            [pieces],
            max_tokens=[max_tokens],
            caches=[cache],
            all_tokens=[prompt[:cached]],
            samplers=[live.sampler],
            logits_processors=[live.processors],
            stop_sequences=[self._eos],
        )
        live.uid = uid
        self._live[uid] = live
        self._prompting.add(uid)

    # ------------------------------------------------------- speculative lane
    @property
    def _lane_busy(self) -> bool:
        return self._lane is not None and self._lane.busy

    def _start_speculation(self, live: _Live) -> None:
        """Give the lane to `live`, with the prompt cache's best cache for its prompt."""
        prompt, cache, cached = self._prepare(live)
        self._lane.start(
            live,
            prompt,
            cache,
            cached,
            max_tokens=self._max_tokens(live.request),
            num_draft_tokens=live.request.draft_tokens,
            sampler=live.sampler,
            checkpoints=self._checkpoints(live.request),
        )

    def _move_to_batch(self) -> None:
        """The lane's sequence goes on in the batch: its cache, its tokens so
        far, what is left of its token limit (see `_admit`). If that fails, the
        lane's request fails, not the one that made it move."""
        live = self._lane.owner
        try:
            cache, held, rest = self._lane.take(live.completion_tokens, leave=1)
            if live.completion_tokens:
                pieces, cuts = [rest], []
            else:  # still prefilling: the rest of the prompt, cut where the prompt cache copies
                pieces, cuts = split_prompt(held + rest, len(held), self._checkpoints(live.request))
            live.cuts = deque(cuts)
            (uid,) = self._bg.insert_segments(
                [pieces],
                max_tokens=[self._max_tokens(live.request) - live.completion_tokens],
                caches=[cache],
                all_tokens=[held],
                samplers=[live.sampler],
                logits_processors=[live.processors],
                stop_sequences=[self._eos],
            )
        except Exception as e:  # noqa: BLE001 - the lane's request fails, the engine goes on
            self._lane.drop()
            self._fail(live, e)
            return
        live.uid = uid
        self._live[uid] = live
        self._prompting.add(uid)  # what is left goes through the prompt batch
        if self.budget is not None:
            self.budget.drop_extra(live.request.id)  # the draft's caches are gone
        self.metrics.count_draft_moved()
        log.info(
            "request %d moves from speculative decoding to the batch after %d tokens",
            live.request.id, live.completion_tokens,
        )  # fmt: skip

    def _lane_step(self) -> None:
        """One unit of the lane's work: a prefill chunk or one draft-and-verify cycle."""
        live = self._lane.owner
        try:
            work = self._lane.step()
        except Exception as e:  # noqa: BLE001 - this request's decoding failed, not the engine
            self._lane.drop()
            self._fail(live, e)
            return
        self.metrics.record_step(
            work.prompt_tokens, work.prompt_time, len(work.tokens), work.decode_time
        )
        for tokens, cache, segment in work.snapshots:
            if self.prompt_cache.max_entries:
                self._store_prompt(tokens, cache, segment)
        if work.tokens:
            self.metrics.record_drafts(work.proposed, sum(t.from_draft for t in work.tokens))
        max_tokens = self._max_tokens(live.request)
        for t in work.tokens:
            reason = None
            if t.token in self._eos_ids:
                reason = FinishReason.STOP.value
            elif live.completion_tokens + 1 >= max_tokens:
                reason = FinishReason.LENGTH.value
            try:
                done = self._on_token(live, _Emitted(t.token, t.logprobs, reason))
            except Exception as e:  # noqa: BLE001 - detokenizing this request failed
                self._lane.drop()
                self._fail(live, e)
                return
            if live.sampler.error is not None:
                self._lane.drop()
                self._fail(live, live.sampler.take_error())
                return
            if done:
                cache, tokens, _ = self._lane.take(live.completion_tokens)
                self._complete(live, FinishReason(reason or "stop"), cache, tokens)
                return

    def _step(self) -> None:
        with self._bg.stats() as stats:
            prompt_responses, responses = self._bg.next()
        self.metrics.record_step(
            stats.prompt_tokens, stats.prompt_time, stats.generation_tokens, stats.decode_time
        )
        stepped = {id(v.sampler): v.sampler for v in self._live.values()}
        self._prompting.difference_update(r.uid for r in prompt_responses if r.end_of_prompt)
        self._snapshot_prompts(prompt_responses)
        self._send_progress(prompt_responses)
        self._batch_size = len(responses)
        stopped = []
        for r in responses:
            live = self._live.get(r.uid)
            if live is None:
                continue
            try:
                done = self._on_token(live, r)
            except Exception as e:  # noqa: BLE001 - detokenizing this request failed
                self._fail(live, e)
                continue
            if done:
                if r.finish_reason is not None:
                    self._finish(r.uid, FinishReason(r.finish_reason), r.prompt_cache, r.all_tokens)
                else:
                    stopped.append(r.uid)
        if stopped:  # stop strings: take them out of the batch, keep their caches
            for uid, (cache, tokens) in self._bg.remove(stopped, return_prompt_caches=True).items():
                self._finish(uid, FinishReason.STOP, cache, tokens)
        self._fail_sampling_errors(list(stepped.values()))
        self._check_budget()

    def _fail_sampling_errors(self, stepped: list[Guarded]) -> None:
        """Fail the requests whose sampler or logits processor raised during the
        step (see sampling.Guarded and processors.GuardedProcessor), then clear
        the errors of every sampler the step used (`stepped`): the batch samples
        one token ahead, so the error of a request that finished in this step
        is about a token never used, and a shared sampler must not carry it
        to the next request with the same settings."""
        failed = {id(s) for s in stepped if s.error}
        for live in list(self._live.values()):
            error = next((p.error for p in live.processors or () if p.error is not None), None)
            if id(live.sampler) in failed:
                error = live.sampler.error
            if error is not None:
                self._fail(live, error)
        for sampler in stepped:
            sampler.take_error()

    def _send_progress(self, prompt_responses: list) -> None:
        """Tell requests that asked for it how far their prompt's prefill is."""
        for r in prompt_responses:
            live = self._live.get(r.uid)
            if live is not None and live.request.progress:
                live.sink(PromptProgress(*r.progress))

    def _fail(self, live: _Live, error: Exception) -> None:
        """End one request with an error; the batch and the engine go on."""
        log.error(
            "request %d failed: %s: %s", live.request.id, type(error).__name__, error,
            exc_info=error,
        )  # fmt: skip
        if live.uid is not None and self._live.pop(live.uid, None) is not None:
            self._bg.remove([live.uid])
        self._release(live)
        live.sink(ErrorEvent(f"this request failed: {type(error).__name__}: {error}", 500))
        self.metrics.count_request(Outcome.ERROR)

    def _checkpoints(self, request: GenerationRequest) -> tuple:
        """The request's checkpoints, when some cache of the plan cannot be
        trimmed back (otherwise the longest entry serves every prefix)."""
        return request.checkpoints if self._untrimmable else ()

    def _snapshot_prompts(self, prompt_responses: list) -> None:
        """Cache each prompt at its cuts as it is processed (`engine.segments`):
        the system prompt, the prompt before its think tail, all but its last
        token. Later prompts start with these exact prefixes, so the entries
        are reusable even by caches that cannot trim (sliding windows that
        have wrapped), as in mlx-lm's segment caching."""
        if self.prompt_cache.max_entries == 0:
            return
        done = [r.uid for r in prompt_responses if r.end_of_segment and not r.end_of_prompt]
        done = [uid for uid in done if uid in self._live]
        if done:
            for uid, (cache, tokens) in self._bg.extract_cache(done).items():
                cuts = self._live[uid].cuts
                segment = cuts.popleft() if cuts else Segment.CONTEXT
                self._store_prompt(tokens, cache, segment)

    def _on_token(self, live: _Live, r: Any) -> bool:
        """Emit one token's event; True when the sequence is done."""
        live.completion_tokens += 1
        eos = r.finish_reason == FinishReason.STOP  # the only stop sequences given are EOS ids
        final = r.finish_reason is not None
        if not eos:
            live.detokenizer.add_token(r.token)
        if final:
            live.detokenizer.finalize()
        text, hit = live.stopper.feed(live.detokenizer.last_segment, final=final)
        p = live.request.params
        logprob, top = None, ()
        if p.logprobs:
            logprob = r.logprobs[r.token].item()
            top = top_logprobs(r.logprobs, p.top_logprobs)
        live.sink(TokenEvent(r.token, text, logprob, top, eos))
        live.stop_hit = live.stop_hit or hit
        return final or hit

    def _finish(
        self, uid: int, reason: FinishReason, cache: list | None, tokens: list[int] | None
    ) -> None:
        self._complete(self._live.pop(uid), reason, cache, tokens)

    def _complete(
        self, live: _Live, reason: FinishReason, cache: list | None, tokens: list[int] | None
    ) -> None:
        """Answer `live` with its finish event and keep its cache for reuse."""
        self._release(live)
        if live.stop_hit:
            reason = FinishReason.STOP
        if cache is not None and tokens:
            self._store_prompt(tokens, cache, Segment.ANSWER)
        usage = Usage(len(live.request.prompt), live.completion_tokens, live.cached)
        live.sink(FinishEvent(reason, usage))
        self.metrics.count_request(Outcome.OK)
        log.info(
            "request %d: %d prompt tokens (%d cached), %d generated, %s, %.2fs",
            live.request.id, usage.prompt_tokens, usage.cached_tokens,
            usage.completion_tokens, reason.value, time.monotonic() - live.started,
        )  # fmt: skip

    # ------------------------------------------------------- memory and metrics
    def _batch_caches(self) -> list:
        return [] if self._bg is None else batch_caches(self._bg)

    def _release(self, live: _Live) -> None:
        """Free a request's share of the budget. A sequence that leaves while its
        prompt is being processed frees it after the next step: until then the
        prompt batch's window buffers keep the length its chunk gave them."""
        prompting = live.uid in self._prompting
        self._prompting.discard(live.uid)
        if self.budget is not None:
            self.budget.release(live.request.id, after_step=prompting)

    def _agree_budget(self) -> None:
        """Every rank's share of the budget (this process's alone, unless in a
        group), and the capacity line."""
        if self.budget is None:
            return
        self.budget.shares, self.budget.me = self.coordinator.agree_budget(self.budget.share)
        self.capacity = self.budget.capacity(capacity_tokens(self.max_context))
        if self.coordinator.leader and len(self.budget.shares) > 1:
            log.info("%s", self.capacity.line)  # the group's (a process logs its own at startup)

    def _store_prompt(
        self, tokens: list[int], cache: list, segment: Segment = Segment.ANSWER
    ) -> None:
        """Keep a sequence's cache in the prompt cache within the byte caps and
        the room the KV budget leaves; in a group, only once every rank has
        room for it by its bound (evicting the oldest entries first)."""
        if self.budget is not None and len(self.budget.shares) > 1:
            if not self._yield_group_prompt_cache(len(tokens)):
                return
        self.prompt_cache.insert(list(tokens), cache, self._cache_budget(), segment)
        self._measure()

    def _live_caches(self) -> list:
        """Every cache live sequences hold: the batch's and the speculative lane's."""
        lane = self._lane.caches() if self._lane_busy else []
        return self._batch_caches() + lane

    def live_kv_bytes(self) -> int:
        """KV bytes live sequences hold (batch, lane, draft model), measured."""
        batch = 0 if self._bg is None else self._bg.prompt_cache_nbytes
        return batch + (self._lane.nbytes if self._lane_busy else 0)

    def _cache_budget(self) -> int | None:
        """Prompt-cache byte cap left once live sequences are counted: mlx-lm's
        rule for --prompt-cache-bytes, and the room the KV budget leaves next to
        the admitted sequences' reservations (one process)."""
        caps = []
        if self.options.prompt_cache_bytes is not None and self._bg is not None:
            caps.append(self.options.prompt_cache_bytes - self.live_kv_bytes())
        if self.budget is not None and len(self.budget.shares) == 1:
            caps.append(self.budget.room())
        return min(caps) if caps else None

    def _trim_prompt_cache(self) -> None:
        budget = self._cache_budget()
        if budget is not None:
            self.prompt_cache.trim_to(budget)
        if self.budget is not None and len(self.budget.shares) > 1:
            self._yield_group_prompt_cache()

    def _yield_group_prompt_cache(self, extra_tokens: int | None = None) -> bool:
        """In a group, evict (oldest first) until every rank's prompt cache fits
        its room, with an entry of `extra_tokens` tokens added when given;
        entries are charged by their bound on each rank: measured bytes differ
        between ranks, and every rank must evict alike. False when the extra
        entry does not fit even with the prompt cache empty."""
        ledger = self.budget
        shares = ledger.shares
        rooms = [ledger.room(r) for r in range(len(shares))]
        extra = [0 if extra_tokens is None else s.cost.entry_bytes(extra_tokens) for s in shares]
        if any(e > room for e, room in zip(extra, rooms, strict=True)):
            return False
        while len(self.prompt_cache):
            counts = self.prompt_cache.token_counts()
            if all(
                e + sum(s.cost.entry_bytes(n) for n in counts) <= room
                for s, e, room in zip(shares, extra, rooms, strict=True)
            ):
                break
            self.prompt_cache.evict_oldest()
        return True

    def _check_budget(self) -> None:
        """After a step: free the shares of rows the step took out, let the
        prompt cache yield to what is left, and measure."""
        if self.budget is None or self._bg is None:
            return
        self.budget.settle()
        self._trim_prompt_cache()
        self._measure()

    def _measure(self) -> None:
        """Measure what the caches hold (live sequences and prompt cache: their
        `nbytes`) against the budget and the bound of the admitted sequences.
        Called wherever the bytes held can grow: after a step, after admitting
        requests (a reused prompt-cache entry is copied) and after a prompt
        cache insertion."""
        if self.budget is None or self._bg is None:
            return
        live = self.live_kv_bytes()
        held = self.prompt_cache.nbytes
        if not self.budget.check(live, held):
            log.error(
                "KV budget exceeded: live %d + prompt cache %d bytes, budget %d, "
                "bound of the admitted sequences %d",
                live, held, self.budget.budget, self.budget.reserved(),
            )  # fmt: skip

    def _publish(self) -> None:
        report = cache_report(self._live_caches()) if self._live or self._lane_busy else []
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
            b = self.budget
            self.metrics.set_budget(
                BudgetFigures(
                    b.budget, b.reserved(), b.last_live, self.prompt_cache.nbytes,
                    b.peak_held, b.overruns, b.bound_misses, len(b.shapes),
                )
            )  # fmt: skip
        self.metrics.set_state(
            queue_depth=max(len(self._queued), len(self._pending)),
            batch_size=self._batch_size if self._live else 0,
            kv_bytes_by_kind=by_kind,
            kv_layers=self._kv_fraction[1],
            kv_layers_quantized=self._kv_fraction[0],
            prompt_cache=self.prompt_cache.stats(),
        )

    # ------------------------------------------------------------ warm-up
    def _warmup_speculation(self, filler: list[int]) -> dict:
        """One greedy sequence through the lane, past every window of both
        models, drafting and rewinding; the caches it leaves are checked."""
        windows = [self.plan.max_window or 0, self.draft.plan.max_window or 0]
        n = max(*windows, self.kv_config.quantized_start) + WARMUP_MARGIN
        k = self.draft.num_draft_tokens
        prompt = (filler * (n // len(filler) + 1))[:n]
        want = 4 * (k + 1)
        self._lane.start(
            "warm-up", prompt, self.plan.make_cache(), 0,
            max_tokens=want, num_draft_tokens=k, sampler=greedy_sampler,
        )  # fmt: skip
        generated = accepted = 0
        for _ in range(n + want):  # prefill chunks, then cycles of at least one token
            work = self._lane.step()
            generated += len(work.tokens)
            accepted += sum(t.from_draft for t in work.tokens)
            if generated >= want:
                break
        target, draft = self._lane.model_cache, self._lane.draft_cache
        held = [
            (c.keys.length, c.max_size)
            for c in target + draft
            if isinstance(c, KVQWindowCache) and c.keys is not None
        ]
        report = verify_speculation(
            self.kv_config, cache_report(target), cache_report(draft), held, k
        )
        self._lane.take(generated)
        report.update(
            draft_model=self.draft.name, num_draft_tokens=k, prompt_tokens=n,
            generated=generated, accepted=accepted,
        )  # fmt: skip
        log.info("speculative warm-up: %d tokens, %d drafted tokens accepted", generated, accepted)
        return report

    def _warmup(self) -> WarmupVerdict:
        """Run the readiness warm-up through the real batch path; this rank's verdict."""
        t0 = time.monotonic()
        spec = warmup_spec(self.plan.max_window, self.kv_config, self.max_context)
        filler = list(self.tokenizer.encode(WARMUP_TEXT)) or [0]
        prompts = [(filler * (n // len(filler) + 1))[:n] for n in spec.prompt_lengths]
        uids = self._bg.insert(
            prompts,
            max_tokens=[spec.max_tokens] * len(prompts),
            caches=[self.plan.make_cache() for _ in prompts],
            samplers=[greedy_sampler] * len(prompts),
            stop_sequences=[StopSequences()] * len(prompts),  # no EOS: run every step
        )
        batch_report: list[dict] = []
        finished: dict[int, tuple[list, int]] = {}
        while len(finished) < len(uids):
            _, responses = self._bg.next()
            caches = self._batch_caches()
            if caches:
                batch_report = cache_report(caches)
            for r in responses:
                self._samplers.vocab = r.logprobs.shape[-1]
                if r.finish_reason is not None:
                    finished[r.uid] = (r.prompt_cache, len(r.all_tokens))
        longest_cache, longest = max(finished.values(), key=lambda x: x[1])
        try:
            report = verify_warmup(
                self.kv_config,
                len(self.plan.kv_layers),
                batch_report,
                cache_report(longest_cache),
                longest,
                spec,
            )
        except WarmupFailed as e:
            log.error("%s", e)
            return WarmupVerdict(False, error=str(e))
        del finished, longest_cache
        if self._lane is not None:
            try:
                report["speculative"] = self._warmup_speculation(filler)
            except Exception as e:  # noqa: BLE001 - the draft path does not work: not ready
                log.error("speculative warm-up failed: %s", e)
                return WarmupVerdict(False, error=f"speculative warm-up failed: {e}")
        mx.clear_cache()
        report["seconds"] = round(time.monotonic() - t0, 3)
        kv = [s for s in batch_report if s["kind"] in KV_KINDS]
        self._kv_fraction = (sum(bool(s["quantized"]) for s in kv), len(kv))
        log.info("warm-up done in %.2fs: %s", report["seconds"], report["batch"])
        return WarmupVerdict(True, report=report)

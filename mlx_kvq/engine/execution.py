"""Carrying out the scheduler's plan: sequences into and out of the batch and the lane.

Before every step the scheduler plans (`scheduler.StepPlan`) and
`PlanExecutor.run` applies the plan in its order: preempted sequences leave
the batch (their cache kept in the prompt cache while room lasts, the token
already sampled for them emitted), sequences that cannot grow even alone
end, the lane's sequence moves into the batch, a sequence gets the
speculative lane, and the admitted ones enter the batch with the prompt
cache's best cache for their tokens. Whatever one sequence's insertion
raises fails that sequence alone.

Speculative decoding runs one sequence, so it pays only while that
sequence is all the engine does: a request asking for it gets the lane when
nothing else is running or waiting. Any other request then moves the lane's
sequence into the batch first (its cache and the tokens so far go with
it), so no request is slowed down by another one's speculation. The batch
says the same text for greedy decoding, and a sample of the same
distribution otherwise. Seeded requests never speculate: the speculative
loop draws from the key chain in another order than the batch does, and a
seed must give one text. Nor do requests with logits processors
(penalties, `logit_bias`, a grammar): mlx-lm's speculative loop shows them
only the tokens since the cached prefix, and a grammar's state cannot
follow a sequence moved into the batch; the batch applies them over the
whole context. A request whose draft-model caches do not fit the budget
next to its own is decoded in the batch.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from mlx_lm.generate import StopSequences

from mlx_kvq.caches import keep_in_prompt_cache
from mlx_kvq.plan import KVPlan

from .memory import KVMemory
from .metrics import EngineMetrics
from .output import OutputProcessor
from .prompt_cache import PromptCache
from .requests import GenerationRequest, Outcome
from .runner import BatchRunner
from .sampling import SamplerPool
from .scheduler import RequestStatus, Scheduler, Sequence, StepPlan
from .segments import parting_points, split_prompt

log = logging.getLogger("mlx_kvq.engine")


class PlanExecutor:
    """Applies each step's plan to the batch runner; see the module docstring."""

    def __init__(
        self,
        plan: KVPlan,
        runner: BatchRunner,
        scheduler: Scheduler,
        memory: KVMemory,
        prompt_cache: PromptCache,
        samplers: SamplerPool,
        metrics: EngineMetrics,
        output: OutputProcessor,
        left_queue: Callable[[int], None],
        eos: StopSequences,
    ):
        self.plan = plan
        self.runner = runner
        self.scheduler = scheduler
        self.memory = memory
        self.prompt_cache = prompt_cache
        self.samplers = samplers
        self.metrics = metrics
        self.output = output
        self.left_queue = left_queue
        self.eos = eos  # what ends every sequence in the batch
        # whether some cache of the plan cannot be trimmed back exactly (a window,
        # recurrent state, a quantized body behind an exact tail): then prompts
        # are cut at their checkpoints; otherwise the longest entry serves every prefix
        self._untrimmable = any(
            p.window is not None
            or p.kind == "state"
            or (p.quantized and (p.key_spec.residual or p.value_spec.residual))
            for p in plan.layers
        )

    def run(self) -> None:
        """Plan this step and carry the plan out."""
        if self.memory.ledger is not None and not self.runner.rows:
            self.memory.ledger.settle()  # an empty batch holds nothing any more
        plan = self.scheduler.schedule()
        if plan:
            self._carry_out(plan)
        self._cut_prefilling()
        self.memory.trim_prompt_cache()
        self.memory.measure()

    def _carry_out(self, plan: StepPlan) -> None:
        # every preempted row leaves the batch, its blocks the prompt cache's
        # (which yields them), before any cache is stored: the plan counted
        # what they alone hold as free
        taken = [(seq, self.runner.take_out(seq)) for seq in plan.preempted]
        for _, out in taken:
            if out.cache is not None:
                keep_in_prompt_cache(out.cache, out.tokens)
        for seq, out in taken:
            self.output.preempted(seq, out)
        for seq in plan.exhausted:
            self.output.exhausted(seq)
        if plan.to_batch is not None:
            self._move_to_batch(plan.to_batch)
        if plan.speculate is not None:
            seq = plan.speculate
            self.left_queue(seq.id)
            self.prompt_cache.touch(seq.tokens)  # it yields before the copy is made
            self.memory.trim_prompt_cache()
            self._guarded(seq, self._start_speculation)
            self.metrics.count_draft_request(speculative=True)
        for seq in plan.admitted:  # the prompt cache yields to them before their copies are made
            self.prompt_cache.touch(seq.tokens)
        if plan.admitted:
            self.memory.trim_prompt_cache()
        for seq in plan.admitted:
            self.left_queue(seq.id)
            first = seq.preemptions == 0
            if not self._guarded(seq, self._insert) or seq.uid is None:  # failed, or requeued
                continue
            if first and seq.request.draft_tokens > 0:
                self.metrics.count_draft_request(speculative=False)

    def _cut_prefilling(self) -> None:
        """Cut the prompts in the batch where prompts that came later part from
        them (`Sequence.parting`, asked for by the scheduler), so that their
        prefill stores a copy there, which the later ones wait for; a point
        one has passed is waited for no more."""
        if not self.prompt_cache.max_entries:
            return
        for seq in list(self.scheduler.running.values()):
            if seq.uid is None or seq.status is not RequestStatus.PREFILLING or not seq.parting:
                continue
            for cut in seq.parting:
                if cut.length not in seq.cuts_at:
                    continue  # stored, or passed already
                made = self.runner.cut(seq, cut.length)
                if made is None:
                    seq.cuts_at = tuple(n for n in seq.cuts_at if n != cut.length)
                elif made[1]:
                    seq.cuts.insert(made[0], cut.segment)

    def _guarded(self, seq: Sequence, action: Callable[[Sequence], Any]) -> bool:
        """Run `action(seq)`; if it raises, `seq` fails alone."""
        try:
            action(seq)
        except Exception as e:  # noqa: BLE001 - this request's settings, not the engine
            self.output.fail(seq, e)
            return False
        return True

    def cancel(self, ids: set[int]) -> None:
        """Drop these requests (their clients went away), wherever they are."""
        for request_id in ids:
            self.left_queue(request_id)
        for seq in [s for s in self.scheduler if s.id in ids]:
            self.runner.discard(seq)
            started = seq.status is not RequestStatus.WAITING
            self.scheduler.finish(seq)
            self.metrics.count_request(Outcome.CANCELLED)
            if started:
                log.info("request %d cancelled after %d tokens", seq.id, seq.completion_tokens)

    # ------------------------------------------------------------ into the batch
    def _checkpoints(self, request: GenerationRequest) -> tuple:
        """The request's checkpoints, when some cache of the plan cannot be
        trimmed back."""
        return request.checkpoints if self._untrimmable else ()

    def _cut_points(self, seq: Sequence, cached: int) -> tuple:
        """Where `seq`'s prefill stores copies besides its last token: its
        request's checkpoints, and where its prompt parts from the prompts
        beside it and from the prompt cache's entries (`parting_points`)."""
        if not self._untrimmable:
            return ()
        prompt = seq.request.prompt
        beside = [s.request.prompt for s in self.scheduler if s is not seq]
        held = self.prompt_cache.keys()
        parting = parting_points(prompt, cached, beside, held)
        return (*seq.request.checkpoints, *seq.parting, *parting)

    def _prepare(self, seq: Sequence) -> tuple[list[int], list, int] | None:
        """The tokens `seq` starts (or resumes) from, its sampler, and the prompt
        cache's best cache for them (a fresh one when none matches) with how
        many tokens it holds. None when that cache covers less than its
        admission counted on and its full price no longer fits: it goes back
        to the head of the queue, and is priced again when admitted."""
        tokens = seq.tokens
        cache, cached = self.prompt_cache.fetch(tokens)
        if not self.memory.starts_from(seq.need(seq.on_lane, admitting=True), cached, cache):
            self.scheduler.requeue(seq)
            log.info(
                "request %d waits again: the prompt cache covers %d of its %d tokens, "
                "less than its admission counted on, and the rest does not fit now",
                seq.id, cached, len(tokens),
            )  # fmt: skip
            return None
        if cache is None:
            cache, cached = self.plan.make_cache(), 0
        if seq.sampler is None:  # a resumed sequence keeps its sampler (and its key chain)
            seq.sampler = self.samplers.get(seq.request.params)
        if seq.preemptions == 0:
            seq.cached = cached
            self.metrics.record_cached_tokens(cached)
        return tokens, cache, cached

    def _insert(self, seq: Sequence) -> None:
        prepared = self._prepare(seq)
        if prepared is None:
            return
        tokens, cache, cached = prepared
        resumed = seq.preemptions > 0
        checkpoints = () if resumed else self._cut_points(seq, cached)
        pieces, cuts = split_prompt(tokens, cached, checkpoints)
        seq.cuts = deque(cuts)
        seq.cuts_at = ()
        if not resumed and self.prompt_cache.max_entries:  # where its prefill stores copies
            ends = itertools.accumulate(len(p) for p in pieces[:-1])
            seq.cuts_at = (*(cached + n for n in ends), len(tokens) - 1)
        reused = self.runner.insert(
            seq, pieces, cache, tokens[:cached], seq.max_tokens - len(seq.generated), self.eos
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

    # ------------------------------------------------------------ the lane
    def _start_speculation(self, seq: Sequence) -> None:
        """Give the lane to `seq`, with the prompt cache's best cache for its prompt."""
        prepared = self._prepare(seq)
        if prepared is None:
            return
        prompt, cache, cached = prepared
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
        far, what is left of its token limit. If that fails, the lane's
        request fails, not the one that made it move."""
        try:
            cache, held, rest = self.runner.lane.take(seq.completion_tokens, leave=1)
            if seq.completion_tokens:
                pieces, cuts = [rest], []
            else:  # still prefilling: the rest of the prompt, cut where the prompt cache copies
                pieces, cuts = split_prompt(held + rest, len(held), self._checkpoints(seq.request))
            seq.cuts = deque(cuts)
            left = seq.max_tokens - seq.completion_tokens
            self.runner.insert(seq, pieces, cache, held, left, self.eos)
        except Exception as e:  # noqa: BLE001 - the lane's request fails, the engine goes on
            self.output.fail(seq, e)
            return
        self.metrics.count_draft_moved()
        log.info(
            "request %d moves from speculative decoding to the batch after %d tokens",
            seq.id, seq.completion_tokens,
        )  # fmt: skip


__all__ = ["PlanExecutor"]

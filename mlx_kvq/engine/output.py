"""Output: what the engine tells each request, and how a request ends.

Every token a sequence produces, wherever it was sampled (a batch row, the
speculative lane, the token a preempted row had sampled already), goes
through `OutputProcessor.emit`, the one place that decides whether the
sequence ends and why (`finish_reason`): its end-of-sequence token, its
`max_tokens` (clamped to the context), a stop string in the text, or the KV
budget that cannot hold it even alone. Emitting detokenizes, holds back a
possible stop string's start, and sends the token's event. Finishing
answers the request, keeps its cache for reuse and frees its memory;
failing answers it with an error and leaves the batch and the engine going
(vLLM's output processor, nano-vllm's `postprocess`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .memory import KVMemory
from .metrics import EngineMetrics
from .prompt_cache import PromptCache
from .requests import (
    ErrorEvent,
    FinishEvent,
    FinishReason,
    Outcome,
    PromptProgress,
    Segment,
    TokenEvent,
    Usage,
)
from .runner import BatchRunner, BatchStep, Taken
from .sampling import Guarded, top_logprobs
from .scheduler import Scheduler, Sequence
from .speculation import LaneWork

log = logging.getLogger("mlx_kvq.engine")


def finish_reason(
    seq: Sequence, token: int, eos_ids: frozenset[int], forced: FinishReason | None = None
) -> FinishReason | None:
    """Whether `seq` ends with `token` (its next one), before its text is seen:
    `forced` (the KV budget cannot hold it), its end-of-sequence token, or its
    last allowed token. A stop string found in the text ends it too (`emit`)."""
    if forced is not None:
        return forced
    if token in eos_ids:
        return FinishReason.STOP
    if seq.completion_tokens + 1 >= seq.max_tokens:
        return FinishReason.LENGTH
    return None


class OutputProcessor:
    """Emits tokens, finishes and fails requests; see the module docstring."""

    def __init__(
        self,
        runner: BatchRunner,
        scheduler: Scheduler,
        memory: KVMemory,
        prompt_cache: PromptCache,
        metrics: EngineMetrics,
        eos_ids: frozenset[int],
        left_queue: Callable[[int], None],
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.memory = memory
        self.prompt_cache = prompt_cache
        self.metrics = metrics
        self.eos_ids = eos_ids
        self.left_queue = left_queue  # the inbox's count of requests not yet admitted
        self.batch_size = 0  # sequences decoded together in the last step

    # ------------------------------------------------------------ one token
    def emit(
        self, seq: Sequence, token: int, logprobs: Any, forced: FinishReason | None = None
    ) -> FinishReason | None:
        """Send `seq`'s next token; the reason it ends with it (None: it goes on)."""
        reason = finish_reason(seq, token, self.eos_ids, forced)
        seq.generated.append(int(token))
        eos = token in self.eos_ids
        if not eos:
            seq.detokenizer.add_token(token)
        if reason is not None:
            seq.detokenizer.finalize()
        text, hit = seq.stopper.feed(seq.detokenizer.last_segment, final=reason is not None)
        p = seq.request.params
        logprob, top = None, ()
        if p.logprobs:
            logprob = logprobs[token].item()
            top = top_logprobs(logprobs, p.top_logprobs)
        seq.sink(TokenEvent(token, text, logprob, top, eos))
        return FinishReason.STOP if hit else reason

    def _emit_guarded(self, seq: Sequence, token: int, logprobs: Any, forced=None):
        """`emit`, failing `seq` alone if detokenizing its text raises; (ended, reason)."""
        try:
            return False, self.emit(seq, token, logprobs, forced)
        except Exception as e:  # noqa: BLE001 - detokenizing this request failed
            self.fail(seq, e)
            return True, None

    # ------------------------------------------------------------ endings
    def complete(
        self, seq: Sequence, reason: FinishReason, cache: list | None, tokens: list[int] | None
    ) -> None:
        """Answer `seq` with its finish event, then keep its cache for reuse (the
        store waits for the batch's step ahead, which the answer need not)."""
        self.scheduler.finish(seq)
        usage = Usage(len(seq.request.prompt), seq.completion_tokens, seq.cached)
        seq.sink(FinishEvent(reason, usage))
        if cache is not None and tokens:
            self.memory.store_prompt(tokens, cache, Segment.ANSWER)
        self.metrics.count_request(Outcome.OK)
        log.info(
            "request %d: %d prompt tokens (%d cached), %d generated, %s, %.2fs%s",
            seq.id, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
            reason.value, time.monotonic() - seq.started,
            f", preempted {seq.preemptions}x" if seq.preemptions else "",
        )  # fmt: skip

    def fail(self, seq: Sequence, error: Exception) -> None:
        """End one request with an error; the batch and the engine go on."""
        log.error("request %d failed: %s: %s", seq.id, type(error).__name__, error, exc_info=error)
        self.runner.discard(seq)
        self.left_queue(seq.id)
        self.scheduler.finish(seq)
        seq.sink(ErrorEvent(f"this request failed: {type(error).__name__}: {error}", 500))
        self.metrics.count_request(Outcome.ERROR)

    def preempted(self, seq: Sequence, taken: Taken) -> None:
        """`seq` was taken out of the batch (`taken`; the scheduler has put it
        back in the queue): emit the token already sampled for it, keep its
        cache in the prompt cache while room lasts."""
        self.metrics.count_preemption()
        log.info(
            "request %d preempted after %d tokens (%d sequences running); it resumes later",
            seq.id, seq.completion_tokens, len(self.scheduler.running),
        )  # fmt: skip
        if taken.pending is not None:
            ended, reason = self._emit_guarded(seq, *taken.pending)
            if ended:
                return
            if reason is not None:
                self.complete(seq, reason, taken.cache, taken.tokens)
                return
        if taken.cache is not None and taken.tokens:
            self.memory.store_prompt(taken.tokens, taken.cache, Segment.ANSWER)

    def exhausted(self, seq: Sequence) -> None:
        """`seq` cannot grow even alone: it ends with `length` (the scheduler has
        released it), its last token the one already sampled for it."""
        log.warning(
            "request %d ends with length after %d tokens: its sequence (%d tokens) cannot "
            "grow further within the KV budget even alone",
            seq.id, seq.completion_tokens, len(seq.request.prompt) + seq.completion_tokens,
        )  # fmt: skip
        if self.runner.on_lane(seq):
            cache, tokens, _ = self.runner.lane.take(seq.completion_tokens)
            self.complete(seq, FinishReason.LENGTH, cache, tokens)
            return
        taken = self.runner.take_out(seq)
        reason = FinishReason.LENGTH
        if taken.pending is not None:
            ended, reason = self._emit_guarded(seq, *taken.pending, forced=reason)
            if ended:
                return
        self.complete(seq, reason, taken.cache, taken.tokens)

    # ------------------------------------------------------------ the batch
    def batch_step(self, step: BatchStep) -> None:
        """What one step of the batch produced: prompts done, prompt-cache cuts,
        progress, tokens."""
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
        self.batch_size = len(step.tokens)
        stopped: list[tuple[Sequence, FinishReason]] = []
        for r in step.tokens:
            seq = rows.get(r.uid)
            if seq is None:
                continue
            # mlx-lm's batch ends a row by the same rules (its stop sequences are
            # the end-of-sequence tokens, its limit what is left of max_tokens)
            batch_ended = None if r.finish_reason is None else FinishReason(r.finish_reason)
            ended, reason = self._emit_guarded(seq, r.token, r.logprobs, batch_ended)
            if ended or reason is None:
                continue
            if batch_ended is not None:  # mlx-lm took the row out itself
                self.runner.forget_row(r.uid)
                self.complete(seq, reason, r.prompt_cache, r.all_tokens)
            else:
                stopped.append((seq, reason))
        if stopped:  # stop strings: take them out of the batch, keep their caches
            held = self.runner.remove([s for s, _ in stopped], keep_caches=True)
            for seq, reason in stopped:
                cache, tokens = held.get(seq.id, (None, None))
                self.complete(seq, reason, cache, tokens)
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
                self.fail(seq, error)
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
            # a cut passed is stored (or refused) once: nobody waits for it any more
            seq.cuts_at = tuple(n for n in seq.cuts_at if n > len(tokens))

    # ------------------------------------------------------------ the lane
    def lane_step(self) -> None:
        """One unit of the lane's work: a prefill chunk or one draft-and-verify cycle."""
        lane = self.runner.lane
        seq = lane.owner
        try:
            work: LaneWork = lane.step()
        except Exception as e:  # noqa: BLE001 - this request's decoding failed, not the engine
            self.fail(seq, e)
            return
        self.metrics.record_step(
            work.prompt_tokens, work.prompt_time, len(work.tokens), work.decode_time
        )
        for tokens, cache, segment in work.snapshots:
            if self.prompt_cache.max_entries:
                self.memory.store_prompt(tokens, cache, segment)
            seq.cuts_at = tuple(n for n in seq.cuts_at if n > len(tokens))
        if work.tokens:
            self.scheduler.prompt_done(seq)
            self.metrics.record_drafts(work.proposed, sum(t.from_draft for t in work.tokens))
        for t in work.tokens:
            ended, reason = self._emit_guarded(seq, t.token, t.logprobs)
            if ended:
                return
            if seq.sampler.error is not None:
                self.fail(seq, seq.sampler.take_error())
                return
            if reason is not None:
                cache, tokens, _ = lane.take(seq.completion_tokens)
                self.complete(seq, reason, cache, tokens)
                return


__all__ = ["OutputProcessor", "finish_reason"]

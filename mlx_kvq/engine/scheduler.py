"""The scheduler: where each request stands, who is admitted, who is preempted.

Every request the engine has accepted is a `Sequence` with an explicit
`RequestStatus` (vLLM's states): waiting in the queue, prefilling its
prompt, running (decoding), preempted (back in the queue, to resume from its
tokens so far) or finished. Before every step `Scheduler.schedule` turns the
queue and the running sequences into a `StepPlan`, deciding with the memory
accounting (`memory.Memory`) alone:

- Growth first. A running sequence that the next step takes past the tokens
  it holds grows; when that does not fit, the most recently admitted
  sequence is preempted (vLLM's rule), until it fits (a decoding row leaves
  the batch before the next step: what it alone holds is free at once, so
  one preemption makes the room it frees). The oldest sequence
  therefore always goes on, so none starves. A sequence that cannot grow
  even alone is exhausted: it ends with `length`. One left alone by
  preempting the others in this plan is not: what they hold is freed only
  once they leave the batch, so it is preempted too, and resumes first.
- Then admission, in order, nothing overtaking a request that waits
  (preempted sequences go back to the head of the queue): a request is
  admitted when a decode row is free, fewer than `prompt_rows` prompts are
  being processed, and its prompt plus a small decode reserve fits beside
  what the running sequences hold now (its `max_tokens` reserves nothing).
  Nothing is admitted in a step that preempted. A request whose prompt
  starts as the prompt of a sequence still prefilling does, where that
  sequence will store a copy in the prompt cache (at its prompt's cuts:
  the system prompt's end, all but its last token), waits for the copy
  (`waits_for_prefix`; a cut the sequence has passed is waited for no
  more): it then maps the prefix's blocks and its windows' state there
  instead of computing and holding them a second time. The copy it was
  admitted against is kept until it has started. Where it starts from less
  all the same, it is priced in full again first, and goes back to the
  head of the queue if that does not fit (`requeue`).

The speculative lane is one more place a sequence runs: a request that may
speculate gets it when it would be the engine's only sequence; any other
admission moves the lane's sequence into the batch first (see
`Engine` and `speculation.SpeculativeLane`).

The plan names sequences; the engine applies it to the batch runner. The
scheduler never touches a cache, so a paged layout can change how memory is
counted and held without changing it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .memory import Memory, Need
from .prompt_cache import common_prefix
from .requests import Checkpoint, EventSink, GenerationRequest, Segment
from .segments import parting_points
from .stops import StopMatcher

log = logging.getLogger("mlx_kvq.engine")


class RequestStatus(str, Enum):
    """Where a request stands (vLLM's `RequestStatus`)."""

    WAITING = "waiting"  # in the queue, never admitted
    PREFILLING = "prefilling"  # admitted: its prompt is being processed
    RUNNING = "running"  # decoding
    PREEMPTED = "preempted"  # taken out for memory; back in the queue to resume
    FINISHED = "finished"  # answered (finished, failed or cancelled)


@dataclass(eq=False)
class Sequence:
    """Engine-side state of one accepted request."""

    request: GenerationRequest
    sink: EventSink
    detokenizer: Any
    stopper: StopMatcher
    max_tokens: int  # the request's limit, clamped to the context the plan allows
    speculative: bool = False  # may be decoded on the speculative lane
    status: RequestStatus = RequestStatus.WAITING
    sampler: Any = None
    processors: list | None = None
    cached: int = 0  # prompt tokens the prompt cache gave it when first admitted
    generated: list[int] = field(default_factory=list)  # tokens emitted so far
    uid: int | None = None  # its row in the batch (None: queued, or on the lane)
    on_lane: bool = False
    cuts: deque[Segment] = field(default_factory=deque)  # what the next prompt cuts store
    cuts_at: tuple[int, ...] = ()  # prompt lengths whose copies its prefill will store
    parting: tuple[Checkpoint, ...] = ()  # where prompts that came later part from it
    waited: bool = False  # waited for a prefix another sequence was prefilling
    stop_hit: bool = False
    preemptions: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def completion_tokens(self) -> int:
        return len(self.generated)

    @property
    def tokens(self) -> list[int]:
        """What the sequence holds or resumes from: its prompt and its tokens so far."""
        return list(self.request.prompt) + self.generated

    @property
    def limit(self) -> int:
        """The most tokens the sequence can reach."""
        return len(self.request.prompt) + self.max_tokens

    def need(self, lane: bool = False, admitting: bool = False) -> Need:
        """What the sequence needs from memory for its next step (`lane`: on the
        speculative lane, which adds up to `draft_tokens` + 1 tokens a step and
        keeps as many rewound tokens; `admitting`: with the tokens it starts from)."""
        k = self.request.draft_tokens + 1 if lane else 0
        n = len(self.request.prompt) + len(self.generated)
        tokens = self.tokens if admitting else ()
        return Need(self.id, n, n, max(1, k), self.limit, k, tokens)


@dataclass(frozen=True)
class Limits:
    """How many sequences the batch takes: rows decoding, prompts processed at once."""

    decode_rows: int
    prompt_rows: int


@dataclass(frozen=True)
class StepPlan:
    """What the engine does before the next step, in this order."""

    preempted: tuple[Sequence, ...] = ()  # out of the batch, back at the head of the queue
    exhausted: tuple[Sequence, ...] = ()  # cannot grow even alone: end with `length`
    to_batch: Sequence | None = None  # the lane's sequence moves into the batch
    speculate: Sequence | None = None  # gets the speculative lane
    admitted: tuple[Sequence, ...] = ()  # into the batch (new or resumed), in order

    def __bool__(self) -> bool:
        return bool(
            self.preempted or self.exhausted or self.to_batch or self.speculate or self.admitted
        )


class Scheduler:
    """The queue and the running sequences; see the module docstring."""

    def __init__(self, limits: Limits, memory: Memory, lane: bool = False):
        self.limits = limits
        self.memory = memory
        self.lane = lane  # a speculative lane exists
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}  # by request id, in admission order

    # ------------------------------------------------------------ membership
    def add(self, seq: Sequence) -> None:
        seq.status = RequestStatus.WAITING
        self.waiting.append(seq)

    def __iter__(self) -> Iterator[Sequence]:
        """Every sequence not finished: running (oldest first), then the queue."""
        yield from list(self.running.values())
        yield from list(self.waiting)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def lane_sequence(self) -> Sequence | None:
        return next((s for s in self.running.values() if s.on_lane), None)

    @property
    def batch_rows(self) -> int:
        return sum(not s.on_lane for s in self.running.values())

    def prefilling(self) -> int:
        return sum(
            s.status is RequestStatus.PREFILLING and not s.on_lane for s in self.running.values()
        )

    def prompt_done(self, seq: Sequence) -> None:
        """`seq`'s prompt is processed: it decodes now."""
        if seq.status is RequestStatus.PREFILLING:
            seq.status = RequestStatus.RUNNING
            self.memory.prompt_done(seq.id)

    def finish(self, seq: Sequence) -> None:
        """`seq` is answered (or failed, or cancelled): it holds nothing any more."""
        if self.running.pop(seq.id, None) is not None:
            prompting = seq.status is RequestStatus.PREFILLING and not seq.on_lane
            self.memory.release(seq.id, after_step=prompting)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = RequestStatus.FINISHED
        seq.on_lane = False

    def clear(self) -> list[Sequence]:
        """Forget every sequence (the engine stops); those that were not finished."""
        out = list(self)
        for seq in out:
            seq.status = RequestStatus.FINISHED
        self.running.clear()
        self.waiting.clear()
        return out

    # ------------------------------------------------------------ the plan
    def schedule(self) -> StepPlan:
        """This step's plan; see the module docstring."""
        preempted, exhausted = self._make_room()
        if preempted:
            return StepPlan(tuple(preempted), tuple(exhausted))
        to_batch, speculate, admitted = self._admit()
        idle = not (self.running or admitted or exhausted) and speculate is None
        if idle and self.waiting:
            # nothing runs and nothing ends in this plan (a sequence exhausted now
            # holds its blocks until its rows leave the batch), so nothing will
            # free memory: the head of the queue (a sequence preempted long,
            # resuming through a prompt chunk) never fits
            seq = self.waiting.popleft()
            seq.status = RequestStatus.FINISHED
            exhausted.append(seq)
        return StepPlan((), tuple(exhausted), to_batch, speculate, tuple(admitted))

    def _make_room(self) -> tuple[list[Sequence], list[Sequence]]:
        """Grow the running sequences, oldest first; preempt the newest where
        growth does not fit."""
        preempted: list[Sequence] = []
        exhausted: list[Sequence] = []
        for seq in list(self.running.values()):
            if seq.id not in self.running or seq.status is not RequestStatus.RUNNING:
                continue
            while not self.memory.grow(seq.need(seq.on_lane)):
                victim = next(reversed(self.running.values()))
                if victim is seq and len(self.running) == 1 and not preempted:
                    self.finish(seq)
                    exhausted.append(seq)
                    break
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
        for seq in preempted:  # newest first: the oldest ends up at the head
            self.waiting.appendleft(seq)
        return preempted, exhausted

    def _preempt(self, seq: Sequence) -> None:
        prompting = seq.status is RequestStatus.PREFILLING and not seq.on_lane
        del self.running[seq.id]
        self.memory.release(seq.id, after_step=prompting)
        seq.status = RequestStatus.PREEMPTED
        seq.preemptions += 1

    def requeue(self, seq: Sequence) -> None:
        """An admitted sequence that has not started goes back to the head of the
        queue, holding nothing (its admission counted on a prefix it cannot map)."""
        del self.running[seq.id]
        self.memory.release(seq.id)
        seq.status = RequestStatus.PREEMPTED if seq.preemptions else RequestStatus.WAITING
        self.waiting.appendleft(seq)

    def waits_for_prefix(self, seq: Sequence) -> Sequence | None:
        """The sequence still prefilling whose prompt starts as `seq`'s does and
        will store a copy of more of it than `seq` could start from now (None:
        none). `seq` waits for that copy instead of computing and holding its
        prefix a second time. The other sequence's prompt is cut where `seq`'s
        parts from it, when that adds enough (`parting_points`): when it joins
        the batch, or, in the batch already, where it has not got to yet
        (`PlanExecutor` makes the cut before the next step; one it has passed
        is waited for no more)."""
        tokens = None
        for other in self.running.values():
            if other.status is not RequestStatus.PREFILLING or not other.cuts_at:
                continue
            if tokens is None:
                tokens = seq.tokens
                now = self.memory.covered(tokens)
            prompt = other.request.prompt
            shared = common_prefix(prompt, tokens)
            if not other.on_lane and other.preemptions == 0:
                asked = {c.length for c in other.parting}  # each is asked for once
                for cut in parting_points(prompt, now, beside=[tokens[:shared]]):
                    if cut.length not in asked:
                        other.parting += (cut,)
                        other.cuts_at = tuple(sorted({*other.cuts_at, cut.length}))
            if any(now < length <= shared for length in other.cuts_at):
                return other
        return None

    def _admit(self) -> tuple[Sequence | None, Sequence | None, list[Sequence]]:
        to_batch = speculate = None
        admitted: list[Sequence] = []
        while self.waiting:
            seq = self.waiting[0]
            prefilling = self.waits_for_prefix(seq)
            if prefilling is not None:
                if not seq.waited:
                    seq.waited = True
                    log.info("request %d waits for the prefix request %d is prefilling",
                             seq.id, prefilling.id)  # fmt: skip
                break  # nothing overtakes it: the prefix it waits for is being computed
            idle = not self.running and len(self.waiting) == 1
            if (
                self.lane
                and seq.speculative
                and idle
                and self.memory.admit(seq.need(lane=True, admitting=True))
            ):
                self._start(self.waiting.popleft(), lane=True)
                speculate = seq
                continue
            if len(self.running) >= self.limits.decode_rows:
                break
            lane_seq = self.lane_sequence
            if lane_seq is not None:
                lane_seq.on_lane = False
                lane_seq.status = RequestStatus.PREFILLING  # its rest goes through the prompt batch
                self.memory.to_batch(lane_seq.id)
                to_batch = lane_seq
            if self.prefilling() >= self.limits.prompt_rows or not self.memory.admit(
                seq.need(admitting=True)
            ):
                break
            self._start(self.waiting.popleft())
            admitted.append(seq)
        return to_batch, speculate, admitted

    def _start(self, seq: Sequence, lane: bool = False) -> None:
        seq.status = RequestStatus.PREFILLING
        seq.on_lane = lane
        self.running[seq.id] = seq


__all__ = ["Limits", "RequestStatus", "Scheduler", "Sequence", "StepPlan"]

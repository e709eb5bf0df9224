"""The serving engine: one thread that owns the model and steps its parts.

Other threads call `submit()`, `cancel()`, `drain()`, `stop()` and `fail()`;
the first three post small messages to the engine's inbox (`submit`
refuses at once what can never run: `admission.py`). The parts are made
once (`build.py`); every step the engine thread

1. turns its inbox into the step's `StepCommands` and hands them to its
   coordinator (the identity for a single process; under `mlx.launch`, rank
   0's commands become every rank's), then applies them: requests checked
   and queued (`admission.Admission`), cancels;
2. plans and carries the plan out (`execution.PlanExecutor` over
   `scheduler.Scheduler`, which asks the memory accounting alone);
3. steps the batch and the speculative lane (`runner.BatchRunner`) and
   hands what they produced to the output processor (`output.py`: tokens
   to each request's sink, and the one decision of when and why a request
   ends);
4. publishes its gauges (`reporting.py`).

Whatever one request carries (its sampler, its logits processors, its text)
can only fail that request: the batch and the engine go on.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from mlx_kvq.config import KVConfig
from mlx_kvq.plan import KVPlan

from .budget import Capacity, Ledger, capacity_tokens
from .build import EngineOptions, build_model_side, build_request_side
from .coordinator import Coordinator, LocalCoordinator, RankStatus, StepCommands, StopNotice
from .inbox import Inbox, unavailable
from .metrics import EngineMetrics
from .requests import Cancel, Event, EventSink, GenerationRequest, Outcome, Stop
from .scheduler import Sequence
from .speculation import DraftModel
from .warmup import Readiness, ReadinessState, Status, run_warmup

log = logging.getLogger("mlx_kvq.engine")

IDLE_POLL_S = 0.1  # how long the idle engine thread waits for work per poll
SHUTTING_DOWN = "server is shutting down"


def _wait_for_os_exit(thread: threading.Thread, timeout: float = 2.0) -> None:
    """Wait until a joined `thread` has left the OS too (Linux; elsewhere a
    no-op). Python's join returns before the thread's C++ thread-locals are
    destroyed, and MLX's compile cache, destroyed there, takes the GIL: if the
    process is exiting by then, the thread is unwound through a noexcept
    destructor and the process aborts ("terminate called without an active
    exception"; seen when startup failed right after the warm-up)."""
    task = f"/proc/self/task/{thread.native_id}"
    deadline = time.monotonic() + timeout
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.005)


def _discard(_event: Event) -> None:
    """The sink of a request this process does not answer (a follower rank)."""


class Engine:
    """The engine thread and its step loop; see the module docstring."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any | None,
        plan: KVPlan,
        kv_config: KVConfig,
        options: EngineOptions | None = None,
        *,
        coordinator: Coordinator | None = None,
        metrics: EngineMetrics | None = None,
        draft: DraftModel | None = None,
    ):
        """`tokenizer` None: it comes later through `attach`, so the warm-up
        (which needs only the model) runs while it loads."""
        self.plan = plan
        self.kv_config = kv_config
        self.options = options or EngineOptions()
        self.max_context = self.options.max_context
        self.draft = draft
        self.coordinator = coordinator or LocalCoordinator()
        self.metrics = metrics or EngineMetrics()
        self.readiness = Readiness()
        self.inbox = Inbox()
        parts = self._model_parts = build_model_side(model, plan, self.options, draft)
        self.layout = parts.layout
        self.capacity: Capacity | None = parts.capacity
        self.prompt_cache = parts.prompt_cache
        self.runner = parts.runner
        self.memory = parts.memory
        self.scheduler = parts.scheduler
        self.disk = parts.disk
        self._attached = threading.Event()
        self._failed = threading.Event()
        self._stopping = threading.Event()
        self._settled = False  # an idle step has settled and published since the last work
        self._thread = threading.Thread(target=self._run, name="mlx-kvq-engine", daemon=True)
        if tokenizer is not None:
            self.attach(tokenizer)

    def attach(self, tokenizer: Any) -> None:
        """Give the engine its tokenizer, once, before any request: the parts
        that turn requests into sequences and tokens into events are made
        from it. The engine says ready only after this and its warm-up."""
        if self._attached.is_set():
            raise RuntimeError("the engine has its tokenizer already")
        parts = build_request_side(
            tokenizer, self._model_parts, self.plan, self.options, self.inbox, self.metrics,
            speculation=self.draft is not None,
        )  # fmt: skip
        self.tokenizer = tokenizer
        self.grammars = parts.grammars
        self._samplers = parts.samplers
        self._admission = parts.admission
        self._output = parts.output
        self._executor = parts.executor
        self._reporter = parts.reporter
        self._attached.set()

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
        if not self._thread.is_alive():
            _wait_for_os_exit(self._thread)

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
        refusal = self.inbox.offer(request, sink, self._admission.refusal)
        if refusal is not None:
            sink(refusal)
        else:
            self.metrics.set_queue_depth(self.inbox.waiting)

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
            gate = self.options.warmup_gate
            if not self._wait_until(lambda: not gate or os.path.exists(gate)):
                return
            self._agree_budget()
            verdict, vocab = run_warmup(
                self.runner, self.plan, self.kv_config, self.max_context, self.draft
            )
            if not self._wait_until(self._attached.is_set):
                return
            self._samplers.vocab = vocab or self._samplers.vocab
            verdict = self.coordinator.agree_warmup(verdict)
            if not verdict.ok:
                self._shutdown(verdict.error or "warm-up failed")
                return
            self._reporter.warmed_up(verdict.report or {})
            self.readiness.set_ready(verdict.report or {})
            self._reporter.publish(force=True)
            while not self._failed.is_set() and self.step():
                pass
            self._shutdown(SHUTTING_DOWN, normal=True)
        except Exception as e:  # the engine is dead: say why, everywhere
            log.exception("engine thread failed")
            self._shutdown(f"engine failed: {type(e).__name__}: {e}")

    def step(self) -> bool:
        """One step of the engine thread (see the module docstring); False once stopped."""
        commands = self.coordinator.step(self._collect(not self.scheduler.busy), self._status())
        self._apply(commands)
        if commands.stop:
            return False
        idle = not commands and not self.scheduler.busy and not self.runner.rows
        idle = idle and not self.runner.lane_busy
        if idle and self._settled:  # nothing to schedule or measure since the last idle step
            self._reporter.publish()  # the disk tier's writer moves on meanwhile
            return True
        self._settled = idle
        self._executor.run()
        if self.runner.rows:
            self._output.batch_step(self.runner.step())
        if self.runner.lane_busy:
            self._output.lane_step()
            self.memory.measure()  # the lane's caches (both models) after its step
        self._reporter.publish()
        return True

    def _shutdown(self, reason: str, normal: bool = False) -> None:
        """Refuse new work, answer everything in flight with `reason`, release the batch."""
        notice = StopNotice(reason, normal and not self._failed.is_set())
        reason = self.coordinator.stopping(notice)
        if not self._failed.is_set():
            self.readiness.set_failed(reason)
        self._end_all(reason)
        self.memory.serving = False
        self.runner.close()
        if self.disk is not None:
            self.disk.close()  # what is queued is written first
        if self._attached.is_set():
            self._reporter.publish(force=True)

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

    def _wait_until(self, done: Callable[[], bool]) -> bool:
        """Wait until `done()`: the tests' warm-up gate (a file), the tokenizer
        of `attach` (it loads beside the warm-up); False, shut down, if stopped
        meanwhile."""
        while not done():
            if self._stopping.wait(0.02):
                self._shutdown(SHUTTING_DOWN, normal=True)
                return False
        return True

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

    # ------------------------------------------------------------ commands
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
            self._executor.cancel(set(commands.cancels))

    def _accept(self, request: GenerationRequest, sink: EventSink) -> None:
        """Check a request against the plan and the model, and queue it."""
        refusal = self._admission.invalid(request)
        if refusal is not None:
            self.inbox.admitted(request.id)
            sink(refusal)
            return
        seq, error = self._admission.sequence(request, sink)
        if error is not None:
            self._output.fail(seq, error)
            return
        self.scheduler.add(seq)


__all__ = ["IDLE_POLL_S", "SHUTTING_DOWN", "Engine", "EngineOptions"]

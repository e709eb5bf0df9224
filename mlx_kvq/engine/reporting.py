"""What the engine shows after every step: the metrics' gauges.

`Reporter.publish` reads what the caches, the block pools, the memory
accounting, the queue, the prompt cache and its disk tier hold now and writes it into
`EngineMetrics`, which `/metrics`, `/status` and the page read.
"""

from __future__ import annotations

from mlx_kvq.caches import cache_report
from mlx_kvq.plan import KV_KINDS

from .disk import DiskTier
from .inbox import Inbox
from .memory import KVMemory
from .metrics import BlockFigures, BudgetFigures, EngineMetrics
from .output import OutputProcessor
from .prompt_cache import PromptCache
from .runner import BatchRunner
from .scheduler import RequestStatus, Scheduler


class Reporter:
    """Publishes the engine's state into its metrics; see the module docstring."""

    def __init__(
        self,
        metrics: EngineMetrics,
        scheduler: Scheduler,
        runner: BatchRunner,
        memory: KVMemory,
        prompt_cache: PromptCache,
        inbox: Inbox,
        output: OutputProcessor,
        disk: DiskTier | None = None,
    ):
        self.metrics = metrics
        self.scheduler = scheduler
        self.runner = runner
        self.memory = memory
        self.prompt_cache = prompt_cache
        self.inbox = inbox
        self.output = output
        self.disk = disk
        self.kv_fraction = (0, 0)  # (quantized KV slots, KV slots) last seen

    def warmed_up(self, report: dict) -> None:
        """The warm-up batch's KV slots, until live sequences show theirs."""
        kv = [k for kind, k in report.get("batch", {}).items() if kind in KV_KINDS]
        self.kv_fraction = (sum(k["quantized"] for k in kv), sum(k["slots"] for k in kv))

    def publish(self) -> None:
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
            self.kv_fraction = (quantized, kv)
        if self.memory.ledger is not None:
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
            batch_size=self.output.batch_size if self.runner.rows else 0,
            kv_bytes_by_kind=by_kind,
            kv_layers=self.kv_fraction[1],
            kv_layers_quantized=self.kv_fraction[0],
            prompt_cache=self.prompt_cache.stats(),
            preempted=sum(s.status is RequestStatus.PREEMPTED for s in list(waiting)),
        )
        if self.disk is not None:
            self.metrics.set_disk(self.disk.stats())


__all__ = ["Reporter"]

"""Engine counters and gauges, kept as plain numbers.

The engine thread writes them after every step; the HTTP layer reads a
consistent `snapshot()` and renders it (Prometheus, /health). Nothing here
knows about HTTP or Prometheus.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from .disk import DiskTierStats
from .prompt_cache import PromptCacheStats
from .requests import Outcome, Rejection

RATE_WINDOW_S = 10.0  # tokens-per-second gauges average over this many seconds


@dataclass(frozen=True)
class BudgetFigures:
    """The KV memory budget as of the last step (bytes)."""

    budget: int
    reserved: int  # what the admitted sequences can hold before they next grow
    live: int
    prompt_cache: int
    peak_held: int  # the most live + prompt-cache bytes measured after any step
    overruns: int  # steps that measured more than the budget (0 unless a bound is wrong)
    bound_misses: int  # steps whose live bytes exceeded the admitted sequences' bound
    admitted: int = 0  # sequences holding a share of the budget now


@dataclass(frozen=True)
class BlockFigures:
    """The paged layout's block pools as of the last step (blocks of every
    paged layer's pool together; a block is `block_size` tokens of one layer)."""

    block_size: int
    pools: int
    capacity: int
    used: int
    shared: int  # used blocks that more than one sequence or prompt-cache entry refers to
    nbytes: int  # storage of the pools
    used_bytes: int

    @property
    def free(self) -> int:
        return self.capacity - self.used


@dataclass
class MetricsSnapshot:
    requests: dict[str, int]
    queue_depth: int
    batch_size: int
    max_batch_size: int
    kv_bytes_by_kind: dict[str, int]
    kv_layers: int
    kv_layers_quantized: int
    prompt_cache_bytes: int
    prompt_cache_entries: int
    prompt_cache_max_bytes: int | None
    prompt_cache_max_entries: int
    prompt_cache_hits: int
    prompt_cache_misses: int
    prompt_cache_evictions: int
    prompt_cache_by_segment: tuple[tuple[str, int, int], ...]  # (segment, entries, bytes)
    prompt_tokens: int
    generation_tokens: int
    cached_prompt_tokens: int
    prompt_tps: float
    generation_tps: float
    steps: int
    rejections: dict[str, int] = field(default_factory=dict)
    budget: BudgetFigures | None = None
    draft_requests: dict[str, int] = field(default_factory=dict)  # served "speculative"/"batch"
    draft_requests_moved: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    preemptions: int = 0  # sequences taken out of the batch for memory
    resumptions: int = 0  # preempted sequences admitted again
    preempted: int = 0  # preempted sequences waiting to resume now
    blocks: BlockFigures | None = None  # the paged layout (None: padded rows)
    prefix_blocks_reused: int = 0  # pool blocks new sequences mapped by reference
    disk: DiskTierStats | None = None  # the prompt cache's disk tier (None: none)

    @property
    def kv_quantized_fraction(self) -> float:
        return self.kv_layers_quantized / self.kv_layers if self.kv_layers else 0.0


@dataclass
class EngineMetrics:
    """Thread-safe store of the engine's numbers."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    requests: Counter = field(default_factory=Counter)
    queue_depth: int = 0
    batch_size: int = 0
    max_batch_size: int = 0
    kv_bytes_by_kind: dict[str, int] = field(default_factory=dict)
    kv_layers: int = 0
    kv_layers_quantized: int = 0
    prompt_cache: PromptCacheStats = field(
        default_factory=lambda: PromptCacheStats(0, 0, 0, None, 0, 0, 0, 0)
    )
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_prompt_tokens: int = 0
    steps: int = 0
    rejections: Counter = field(default_factory=Counter)
    budget: BudgetFigures | None = None
    draft_requests: Counter = field(default_factory=Counter)
    draft_requests_moved: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    preemptions: int = 0
    resumptions: int = 0
    preempted: int = 0
    blocks: BlockFigures | None = None
    prefix_blocks_reused: int = 0
    disk: DiskTierStats | None = None
    # (time, prompt tokens, prompt seconds, generated tokens, decode seconds)
    _recent: deque = field(default_factory=deque)

    def count_request(self, outcome: Outcome) -> None:
        """Count one finished request by how it ended."""
        with self._lock:
            self.requests[outcome.value] += 1

    def count_rejection(self, reason: Rejection) -> None:
        """Count a request refused before it ran (also counted as `rejected`)."""
        with self._lock:
            self.rejections[reason.value] += 1
            self.requests[Outcome.REJECTED.value] += 1

    def set_queue_depth(self, n: int) -> None:
        """Requests waiting, as soon as one is submitted (the engine thread may be busy)."""
        with self._lock:
            self.queue_depth = n

    def set_budget(self, figures: BudgetFigures | None) -> None:
        with self._lock:
            self.budget = figures

    def set_blocks(self, figures: BlockFigures | None) -> None:
        with self._lock:
            self.blocks = figures

    def set_disk(self, stats: DiskTierStats) -> None:
        with self._lock:
            self.disk = stats

    def count_prefix_blocks(self, n: int) -> None:
        """Blocks a new sequence mapped by reference from the prompt cache."""
        with self._lock:
            self.prefix_blocks_reused += n

    def record_step(
        self, prompt_tokens: int, prompt_time: float, gen_tokens: int, decode_time: float
    ) -> None:
        now = time.monotonic()
        with self._lock:
            self.steps += 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += gen_tokens
            self._recent.append((now, prompt_tokens, prompt_time, gen_tokens, decode_time))
            self._expire(now)

    def count_draft_request(self, speculative: bool) -> None:
        """A request asking for speculative decoding, by how it started (in the
        speculative lane, or in the batch because the engine was busy or it is seeded)."""
        with self._lock:
            self.draft_requests["speculative" if speculative else "batch"] += 1

    def count_draft_moved(self) -> None:
        """A speculative sequence moved into the batch (another request arrived)."""
        with self._lock:
            self.draft_requests_moved += 1

    def record_drafts(self, proposed: int, accepted: int) -> None:
        with self._lock:
            self.draft_tokens_proposed += proposed
            self.draft_tokens_accepted += accepted

    def count_preemption(self) -> None:
        """A sequence taken out of the batch because memory ran out."""
        with self._lock:
            self.preemptions += 1

    def count_resumption(self) -> None:
        """A preempted sequence admitted again."""
        with self._lock:
            self.resumptions += 1

    def record_cached_tokens(self, n: int) -> None:
        with self._lock:
            self.cached_prompt_tokens += n

    def set_state(
        self,
        *,
        queue_depth: int,
        batch_size: int,
        kv_bytes_by_kind: dict[str, int],
        kv_layers: int,
        kv_layers_quantized: int,
        prompt_cache: PromptCacheStats,
        preempted: int = 0,
    ) -> None:
        with self._lock:
            self.queue_depth = queue_depth
            self.batch_size = batch_size
            self.max_batch_size = max(self.max_batch_size, batch_size)
            self.kv_bytes_by_kind = dict(kv_bytes_by_kind)
            self.kv_layers = kv_layers
            self.kv_layers_quantized = kv_layers_quantized
            self.prompt_cache = prompt_cache
            self.preempted = preempted

    def _expire(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

    def _rates(self) -> tuple[float, float]:
        self._expire(time.monotonic())
        p = sum(r[1] for r in self._recent)
        pt = sum(r[2] for r in self._recent)
        g = sum(r[3] for r in self._recent)
        gt = sum(r[4] for r in self._recent)
        return (p / pt if pt > 0 else 0.0), (g / gt if gt > 0 else 0.0)

    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            ptps, gtps = self._rates()
            pc = self.prompt_cache
            return MetricsSnapshot(
                requests=dict(self.requests),
                queue_depth=self.queue_depth,
                batch_size=self.batch_size,
                max_batch_size=self.max_batch_size,
                kv_bytes_by_kind=dict(self.kv_bytes_by_kind),
                kv_layers=self.kv_layers,
                kv_layers_quantized=self.kv_layers_quantized,
                prompt_cache_bytes=pc.nbytes,
                prompt_cache_entries=pc.entries,
                prompt_cache_max_bytes=pc.max_bytes,
                prompt_cache_max_entries=pc.max_entries,
                prompt_cache_hits=pc.hits,
                prompt_cache_misses=pc.misses,
                prompt_cache_evictions=pc.evictions,
                prompt_cache_by_segment=pc.by_segment,
                prompt_tokens=self.prompt_tokens,
                generation_tokens=self.generation_tokens,
                cached_prompt_tokens=self.cached_prompt_tokens,
                prompt_tps=ptps,
                generation_tps=gtps,
                steps=self.steps,
                rejections=dict(self.rejections),
                budget=self.budget,
                draft_requests=dict(self.draft_requests),
                draft_requests_moved=self.draft_requests_moved,
                draft_tokens_proposed=self.draft_tokens_proposed,
                draft_tokens_accepted=self.draft_tokens_accepted,
                blocks=self.blocks,
                prefix_blocks_reused=self.prefix_blocks_reused,
                disk=self.disk,
                preemptions=self.preemptions,
                resumptions=self.resumptions,
                preempted=self.preempted,
            )

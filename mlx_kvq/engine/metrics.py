"""Engine counters and gauges, kept as plain numbers.

The engine thread writes them after every step; the HTTP layer reads a
consistent `snapshot()` and renders it (Prometheus, /health). Nothing here
knows about HTTP or Prometheus.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, fields, replace

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
    """The engine's numbers: `EngineMetrics` keeps the live record and hands
    out copies, so the fields are declared only here."""

    requests: dict[str, int] = field(default_factory=dict)
    queue_depth: int = 0
    batch_size: int = 0
    max_batch_size: int = 0
    kv_bytes_by_kind: dict[str, int] = field(default_factory=dict)
    kv_layers: int = 0
    kv_layers_quantized: int = 0
    prompt_cache_bytes: int = 0
    prompt_cache_entries: int = 0
    prompt_cache_max_bytes: int | None = None
    prompt_cache_max_entries: int = 0
    prompt_cache_hits: int = 0
    prompt_cache_misses: int = 0
    prompt_cache_evictions: int = 0
    prompt_cache_by_segment: tuple[tuple[str, int, int], ...] = ()  # (segment, entries, bytes)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_prompt_tokens: int = 0
    prompt_tps: float = 0.0  # over the last RATE_WINDOW_S, filled in by `snapshot()`
    generation_tps: float = 0.0
    steps: int = 0
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


class EngineMetrics:
    """Thread-safe store of the engine's numbers: a live `MetricsSnapshot`
    behind a lock, plus the recent steps the token rates average over."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now = MetricsSnapshot(
            requests=Counter(), rejections=Counter(), draft_requests=Counter()
        )
        # (time, prompt tokens, prompt seconds, generated tokens, decode seconds)
        self._recent: deque[tuple[float, int, float, int, float]] = deque()

    @property
    def kv_bytes_by_kind(self) -> dict[str, int]:
        """Live KV bytes by cache kind, which the engine reads every step
        without paying for a snapshot."""
        return self._now.kv_bytes_by_kind

    @property
    def max_batch_size(self) -> int:
        """The largest batch so far; benchmarks set it to 0 to measure one phase."""
        return self._now.max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, n: int) -> None:
        with self._lock:
            self._now.max_batch_size = n

    def count_request(self, outcome: Outcome) -> None:
        """Count one finished request by how it ended."""
        with self._lock:
            self._now.requests[outcome.value] += 1

    def count_rejection(self, reason: Rejection) -> None:
        """Count a request refused before it ran (also counted as `rejected`)."""
        with self._lock:
            self._now.rejections[reason.value] += 1
            self._now.requests[Outcome.REJECTED.value] += 1

    def set_queue_depth(self, n: int) -> None:
        """Requests waiting, as soon as one is submitted (the engine thread may be busy)."""
        with self._lock:
            self._now.queue_depth = n

    def set_budget(self, figures: BudgetFigures | None) -> None:
        with self._lock:
            self._now.budget = figures

    def set_blocks(self, figures: BlockFigures | None) -> None:
        with self._lock:
            self._now.blocks = figures

    def set_disk(self, stats: DiskTierStats) -> None:
        with self._lock:
            self._now.disk = stats

    def count_prefix_blocks(self, n: int) -> None:
        """Blocks a new sequence mapped by reference from the prompt cache."""
        with self._lock:
            self._now.prefix_blocks_reused += n

    def record_step(
        self, prompt_tokens: int, prompt_time: float, gen_tokens: int, decode_time: float
    ) -> None:
        now = time.monotonic()
        with self._lock:
            self._now.steps += 1
            self._now.prompt_tokens += prompt_tokens
            self._now.generation_tokens += gen_tokens
            self._recent.append((now, prompt_tokens, prompt_time, gen_tokens, decode_time))
            self._expire(now)

    def count_draft_request(self, speculative: bool) -> None:
        """A request asking for speculative decoding, by how it started (in the
        speculative lane, or in the batch because the engine was busy or it is seeded)."""
        with self._lock:
            self._now.draft_requests["speculative" if speculative else "batch"] += 1

    def count_draft_moved(self) -> None:
        """A speculative sequence moved into the batch (another request arrived)."""
        with self._lock:
            self._now.draft_requests_moved += 1

    def record_drafts(self, proposed: int, accepted: int) -> None:
        with self._lock:
            self._now.draft_tokens_proposed += proposed
            self._now.draft_tokens_accepted += accepted

    def count_preemption(self) -> None:
        """A sequence taken out of the batch because memory ran out."""
        with self._lock:
            self._now.preemptions += 1

    def count_resumption(self) -> None:
        """A preempted sequence admitted again."""
        with self._lock:
            self._now.resumptions += 1

    def record_cached_tokens(self, n: int) -> None:
        with self._lock:
            self._now.cached_prompt_tokens += n

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
            s = self._now
            s.queue_depth = queue_depth
            s.batch_size = batch_size
            s.max_batch_size = max(s.max_batch_size, batch_size)
            s.kv_bytes_by_kind = dict(kv_bytes_by_kind)
            s.kv_layers = kv_layers
            s.kv_layers_quantized = kv_layers_quantized
            s.preempted = preempted
            s.prompt_cache_bytes = prompt_cache.nbytes
            s.prompt_cache_entries = prompt_cache.entries
            s.prompt_cache_max_bytes = prompt_cache.max_bytes
            s.prompt_cache_max_entries = prompt_cache.max_entries
            s.prompt_cache_hits = prompt_cache.hits
            s.prompt_cache_misses = prompt_cache.misses
            s.prompt_cache_evictions = prompt_cache.evictions
            s.prompt_cache_by_segment = prompt_cache.by_segment

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
        """A consistent copy of the live record (its dicts copied as plain
        dicts, so readers never see later counts) with the current rates."""
        with self._lock:
            ptps, gtps = self._rates()
            s = self._now
            dicts = {
                f.name: dict(v) for f in fields(s) if isinstance(v := getattr(s, f.name), dict)
            }
            return replace(s, **dicts, prompt_tps=ptps, generation_tps=gtps)

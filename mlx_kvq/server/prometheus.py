"""`/metrics`: the engines' numbers in Prometheus text format.

A custom collector reads one engine snapshot per scrape into a registry
owned by the app (never prometheus-client's global registry), so several
apps in one process (tests) do not collide. `ModelsCollector` reads every
resident model's engine: once the server knows more than one model, each
engine's series carry a `model` label (a server that only ever knew one
model exports them unlabelled, as always), and the models' memory budget
and each model's loads, evictions and bytes held are series of their own.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mlx_kvq.engine import Engine, Outcome, RankView, Rejection
from mlx_kvq.engine.disk import Skip
from mlx_kvq.residency import ModelPool, ModelState, ModelView

from .responses.store import AgentCounters

P = "mlx_kvq_"
REQUEST_STATUSES = tuple(o.value for o in Outcome)
REJECTION_REASONS = tuple(r.value for r in Rejection)


class EngineCollector(Collector):
    def __init__(self, engine: Engine, kinds: set[str] | None = None):
        self.engine = engine
        self.kinds = set(kinds or ())  # always exported, as 0 when idle

    def collect(self) -> Iterator:
        s = self.engine.metrics.snapshot()
        ready = GaugeMetricFamily(P + "ready", "1 once the warm-up passed and the engine runs")
        ready.add_metric([], float(self.engine.readiness.ready and self.engine.alive))
        yield ready

        kv = GaugeMetricFamily(
            P + "kv_bytes", "KV cache bytes held by live sequences, by cache kind", labels=["kind"]
        )
        for kind in sorted(self.kinds | set(s.kv_bytes_by_kind)):
            kv.add_metric([kind], float(s.kv_bytes_by_kind.get(kind, 0)))
        yield kv
        yield _gauge(
            "kv_bytes_live",
            "KV cache bytes held by live sequences, all kinds",
            sum(s.kv_bytes_by_kind.values()),
        )
        yield _gauge(
            "kv_layers_quantized_fraction",
            "Fraction of KV cache layers stored quantized",
            s.kv_quantized_fraction,
        )

        yield _gauge("prompt_cache_bytes", "Bytes held by the prompt cache", s.prompt_cache_bytes)
        yield _gauge("prompt_cache_entries", "Entries in the prompt cache", s.prompt_cache_entries)
        yield _gauge(
            "prompt_cache_max_entries", "Prompt cache entry cap", s.prompt_cache_max_entries
        )
        if s.prompt_cache_max_bytes is not None:
            yield _gauge(
                "prompt_cache_max_bytes", "Prompt cache byte cap", s.prompt_cache_max_bytes
            )
        entries = GaugeMetricFamily(
            P + "prompt_cache_segment_entries",
            "Prompt cache entries by what they hold (system prompt, prompt prefix, "
            "prompt and answer; mlx-lm's names)",
            labels=["segment"],
        )
        held = GaugeMetricFamily(
            P + "prompt_cache_segment_bytes", "Prompt cache bytes by segment", labels=["segment"]
        )
        for segment, n, nbytes in s.prompt_cache_by_segment:
            entries.add_metric([segment], float(n))
            held.add_metric([segment], float(nbytes))
        yield entries
        yield held
        yield _counter(
            "prompt_cache_hits", "Requests that reused a cached prefix", s.prompt_cache_hits
        )
        yield _counter(
            "prompt_cache_misses", "Requests that found no cached prefix", s.prompt_cache_misses
        )
        yield _counter(
            "prompt_cache_evictions", "Prompt cache entries evicted", s.prompt_cache_evictions
        )
        yield _counter(
            "prompt_cache_tokens",
            "Prompt tokens served from the prompt cache",
            s.cached_prompt_tokens,
        )

        req = CounterMetricFamily(P + "requests", "Requests by final status", labels=["status"])
        for status in sorted(set(REQUEST_STATUSES) | set(s.requests)):
            req.add_metric([status], float(s.requests.get(status, 0)))
        yield req

        rejected = CounterMetricFamily(
            P + "rejections", "Requests refused before running, by reason", labels=["reason"]
        )
        for reason in sorted(set(REJECTION_REASONS) | set(s.rejections)):
            rejected.add_metric([reason], float(s.rejections.get(reason, 0)))
        yield rejected
        yield from _budget_families(s.budget)
        yield from _block_families(s)
        yield from _disk_families(s.disk)
        yield _counter(
            "preemptions", "Sequences taken out of the batch because KV memory ran out",
            s.preemptions,
        )  # fmt: skip
        yield _counter("resumptions", "Preempted sequences admitted again", s.resumptions)
        yield _gauge("preempted", "Preempted sequences waiting to resume", s.preempted)

        yield _gauge("queue_depth", "Requests waiting for a batch slot", s.queue_depth)
        yield _gauge("batch_size", "Sequences decoded together in the last step", s.batch_size)
        yield _gauge("batch_size_max", "Largest batch decoded together so far", s.max_batch_size)
        yield _gauge(
            "prompt_tokens_per_second", "Prompt processing rate, recent window", s.prompt_tps
        )
        yield _gauge(
            "generation_tokens_per_second", "Generation rate, recent window", s.generation_tps
        )
        yield _counter("prompt_tokens", "Prompt tokens processed", s.prompt_tokens)
        yield _counter("generation_tokens", "Tokens generated", s.generation_tokens)
        yield _counter("steps", "Batch steps taken", s.steps)
        yield _gauge(
            "mlx_active_memory_bytes", "MLX active memory of this process", mx.get_active_memory()
        )
        yield _gauge(
            "mlx_peak_memory_bytes", "MLX peak memory of this process", mx.get_peak_memory()
        )
        yield from _rank_families(self.engine.coordinator.ranks())
        if self.engine.draft is not None:
            yield from _draft_families(s)


def _block_families(s):
    """The paged layout's block pools (none with padded rows)."""
    b = s.blocks
    if b is None:
        return
    yield _gauge("kv_blocks", "KV blocks allocated in the paged layers' pools", b.capacity)
    yield _gauge("kv_blocks_used", "KV blocks some sequence or prompt-cache entry refers to",
                 b.used)  # fmt: skip
    yield _gauge("kv_blocks_free", "KV blocks allocated and free", b.free)
    yield _gauge("kv_blocks_shared", "KV blocks more than one holder refers to", b.shared)
    yield _gauge("kv_block_tokens", "Tokens per KV block", b.block_size)
    yield _counter(
        "kv_prefix_blocks_reused",
        "KV blocks new sequences mapped by reference from the prompt cache",
        s.prefix_blocks_reused,
    )


def _disk_families(d):
    """The prompt cache's disk tier (none without --prompt-cache-dir)."""
    if d is None:
        return
    yield _gauge(
        "prompt_cache_disk_bytes", "Bytes of records in --prompt-cache-dir (every model's)",
        d.nbytes,
    )  # fmt: skip
    yield _gauge("prompt_cache_disk_max_bytes", "Byte cap of --prompt-cache-dir", d.max_bytes)
    yield _gauge("prompt_cache_disk_files", "Record files in --prompt-cache-dir", d.files)
    yield _gauge(
        "prompt_cache_disk_entries",
        "Prompt-cache entries on disk for this model and KV setting",
        d.entries,
    )
    yield _gauge("prompt_cache_disk_chunks", "Prefix chunk files for this model and KV setting",
                 d.chunks)  # fmt: skip
    yield _gauge(
        "prompt_cache_disk_queued_bytes", "Bytes waiting in the disk writer's queue",
        d.queued_bytes,
    )  # fmt: skip
    yield _counter(
        "prompt_cache_disk_hits", "Sequences whose prefix was read from disk instead of computed",
        d.hits,
    )  # fmt: skip
    yield _counter(
        "prompt_cache_disk_misses",
        "Sequences for which the disk held no longer prefix than memory",
        d.misses,
    )
    yield _counter(
        "prompt_cache_disk_tokens", "Prompt tokens read from disk instead of computed",
        d.tokens_read,
    )  # fmt: skip
    yield _counter("prompt_cache_disk_writes", "Record files written", d.writes)
    yield _counter(
        "prompt_cache_disk_written_bytes", "Bytes of record files written", d.bytes_written
    )
    yield _counter(
        "prompt_cache_disk_evictions", "Record files removed to stay under the cap", d.evictions
    )
    skips = CounterMetricFamily(
        P + "prompt_cache_disk_skips",
        f"Files not used or not written, by reason ({', '.join(r.value for r in Skip)})",
        labels=["reason"],
    )
    counted = dict(d.skips)
    for reason in sorted({r.value for r in Skip} | set(counted)):
        skips.add_metric([reason], float(counted.get(reason, 0)))
    yield skips


def _budget_families(b):
    """The KV memory budget (none without one)."""
    if b is None:
        return
    yield _gauge("kv_cache_memory_bytes", "KV memory budget (--kv-cache-memory)", b.budget)
    yield _gauge(
        "kv_bytes_reserved",
        "KV bytes the admitted sequences can hold before they next grow",
        b.reserved,
    )
    yield _gauge("kv_sequences_admitted", "Sequences holding a share of the KV budget", b.admitted)
    yield _gauge(
        "kv_bytes_held_max",
        "Most KV bytes (live sequences and prompt cache) measured after any step",
        b.peak_held,
    )
    yield _counter(
        "kv_budget_overruns",
        "Steps after which the KV bytes held exceeded the budget (0 unless a bound is wrong)",
        b.overruns,
    )


def _rank_families(ranks: list[RankView]):
    """Per-rank families of an `mlx.launch` group (none for a single process)."""
    if not ranks:
        return
    count = GaugeMetricFamily(P + "distributed_ranks", "Ranks in the mlx.distributed group")
    count.add_metric([], float(len(ranks)))
    yield count
    families = {
        "up": ("rank_up", "1 while the rank answers heartbeats"),
        "kv_bytes": ("rank_kv_bytes", "KV cache bytes held by live sequences on each rank"),
        "prompt_cache_bytes": (
            "rank_prompt_cache_bytes",
            "KV bytes held by the prompt cache on each rank",
        ),
        "bytes_per_token": ("rank_kv_bytes_per_token", "Planned KV bytes per token on each rank"),
        "warmup_kv_bytes": ("rank_warmup_kv_bytes", "KV bytes of the warm-up batch on each rank"),
    }
    for field, (name, doc) in families.items():
        family = GaugeMetricFamily(P + name, doc, labels=["rank"])
        for view in ranks:
            family.add_metric([str(view.rank)], float(getattr(view, field)))
        yield family


def _draft_families(s):
    """Speculative decoding (only with a draft model)."""
    served = CounterMetricFamily(
        P + "draft_requests",
        "Requests asking for speculative decoding, by where they started (speculative "
        "decoding while nothing else ran, or the batch: the engine was busy or a seed was set)",
        labels=["served"],
    )
    for lane in ("speculative", "batch"):
        served.add_metric([lane], float(s.draft_requests.get(lane, 0)))
    yield served
    yield _counter(
        "draft_requests_moved",
        "Speculative sequences that moved into the batch when another request arrived",
        s.draft_requests_moved,
    )
    yield _counter(
        "draft_tokens_proposed", "Tokens the draft model proposed", s.draft_tokens_proposed
    )
    yield _counter(
        "draft_tokens_accepted", "Proposed tokens the model accepted", s.draft_tokens_accepted
    )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(P + name, doc)
    g.add_metric([], float(value))
    return g


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(P + name, doc)
    c.add_metric([], float(value))
    return c


class AgentCollector(Collector):
    """The agent APIs' numbers: the response store and hosted tools left out."""

    def __init__(self, counters: AgentCounters):
        self.counters = counters

    def collect(self) -> Iterator:
        store = self.counters.store
        yield _gauge("response_store_bytes", "Bytes held by stored responses", store.bytes)
        yield _gauge("response_store_max_bytes", "Response store byte cap", store.max_bytes)
        yield _gauge("response_store_entries", "Stored responses", len(store))
        yield _counter(
            "response_store_evictions", "Stored responses dropped for room", store.evictions
        )
        hosted = CounterMetricFamily(
            P + "hosted_tools_ignored",
            "Hosted tools (web_search, ...) in requests, left out of the prompt, by type",
            labels=["type"],
        )
        for kind, n in sorted(self.counters.hosted_tools.items()):
            hosted.add_metric([kind], float(n))
        yield hosted


def engine_kinds(view: ModelView) -> set[str]:
    """The cache kinds a resident model's plan has (always exported)."""
    assert view.loaded is not None
    plan = view.loaded.served.plan if isinstance(view.loaded.served.plan, dict) else {}
    return set(plan.get("kinds", ())) or set(view.loaded.engine.plan.kinds)


class ModelsCollector(Collector):
    """Every resident model's engine, and the models' residency (module docstring)."""

    def __init__(self, pool: ModelPool):
        self.pool = pool

    def collect(self) -> Iterator:
        views = self.pool.views()
        several = len(views) > 1
        merged: dict[str, Metric] = {}
        for view in views:
            if view.loaded is None:
                continue
            for family in EngineCollector(view.loaded.engine, engine_kinds(view)).collect():
                if not several:
                    yield family
                    continue
                into = merged.setdefault(
                    family.name,
                    Metric(family.name, family.documentation, family.type, family.unit),
                )
                into.samples += [
                    s._replace(labels={**s.labels, "model": view.name}) for s in family.samples
                ]
        yield from merged.values()
        yield from self.residency(views)

    def residency(self, views: list[ModelView]) -> Iterator:
        yield _gauge(
            "models_memory_bytes",
            "The memory budget of every resident model's weights and KV budget (--models-memory)",
            self.pool.budget,
        )
        yield _gauge(
            "models_bytes_held",
            "Weights and KV budgets resident and loading models hold against it",
            self.pool.held(),
        )
        yield _gauge(
            "models_bytes_held_max", "The most bytes models held at once", self.pool.peak_held
        )
        families = {
            "resident": GaugeMetricFamily(
                P + "model_resident", "1 while the model is in memory", labels=["model"]
            ),
            "loads": CounterMetricFamily(
                P + "model_loads", "Times the model was loaded", labels=["model"]
            ),
            "evictions": CounterMetricFamily(
                P + "model_evictions", "Times the model was evicted for room", labels=["model"]
            ),
            "weights": GaugeMetricFamily(
                P + "model_weights_bytes", "Bytes of the resident model's weights",
                labels=["model"],
            ),
            "kv": GaugeMetricFamily(
                P + "model_kv_budget_bytes", "The resident model's KV budget", labels=["model"]
            ),
            "requests": GaugeMetricFamily(
                P + "model_requests_in_flight", "Requests routed to the model, not yet answered",
                labels=["model"],
            ),
        }  # fmt: skip
        for v in views:
            resident = v.state is ModelState.READY and v.loaded is not None
            families["resident"].add_metric([v.name], float(resident))
            families["loads"].add_metric([v.name], float(v.loads))
            families["evictions"].add_metric([v.name], float(v.evictions))
            families["requests"].add_metric([v.name], float(v.requests))
            if v.footprint is not None:
                families["weights"].add_metric([v.name], float(v.footprint.weights))
                families["kv"].add_metric([v.name], float(v.footprint.kv))
        yield from families.values()


def make_registry(
    source: ModelPool | Engine, kinds: set[str] | None = None, counters: AgentCounters | None = None
) -> CollectorRegistry:
    """The registry of an app: its pool's models (or one engine, with the
    cache kinds always exported) and the agent APIs' numbers."""
    registry = CollectorRegistry(auto_describe=False)
    if isinstance(source, ModelPool):
        registry.register(ModelsCollector(source))
    else:
        registry.register(EngineCollector(source, kinds))
    if counters is not None:
        registry.register(AgentCollector(counters))
    return registry

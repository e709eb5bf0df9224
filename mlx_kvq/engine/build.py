"""The engine's parts, made once at startup from the plan and the options.

`build_model_side` chooses the batch's layout (block pools for the layers
that page, padded rows for the others), prices the KV budget from the plan
when one is set (and the draft model's caches, and the speculative lane's
own caches), and makes the prompt cache, the batch runner, the memory
accounting and the scheduler, and the prompt cache's disk tier when a
directory is given (`disk/`: it hooks into the memory accounting). That is
all the warm-up needs, so it can run while the tokenizer loads.
`build_request_side` then makes, from the tokenizer, the samplers, the
grammars, the refusals, the output processor, the plan's executor and the
metrics' reporter, each given the others it works with. The engine thread
only drives them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import StopSequences

from mlx_kvq.config import AUTO_BLOCK_SIZE
from mlx_kvq.plan import KVPlan

from .admission import Admission
from .budget import Capacity, CostModel, Ledger, capacity_tokens, share_for
from .disk import DiskSettings, DiskTier, open_tier
from .execution import PlanExecutor
from .inbox import Inbox
from .memory import KVMemory
from .metrics import EngineMetrics
from .output import OutputProcessor
from .processors import Grammars
from .prompt_cache import PromptCache
from .reporting import Reporter
from .runner import BatchRunner, Layout, RunnerOptions, choose_layout
from .sampling import SamplerPool
from .scheduler import Limits, Scheduler
from .speculation import DraftModel

log = logging.getLogger("mlx_kvq.engine")


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
    # tokens per block (None: padded rows; AUTO_BLOCK_SIZE: the plan's, `paged_block_size`)
    block_size: int | str | None = AUTO_BLOCK_SIZE
    max_queued_requests: int | None = None  # waiting requests before a 429 (None: no limit)
    warmup_gate: str | None = None  # warm-up waits until this file exists (tests)
    disk: DiskSettings | None = None  # the prompt cache's disk tier (None: memory only)


def materialize(model: Any) -> None:
    """Evaluate every array the model holds, private ones included.

    MLX arrays are bound to the stream of the thread that created them: a
    lazy array built at load time (e.g. a rope's `_freqs`) cannot be
    evaluated later from the engine thread. `mlx_lm.load` evaluates only the
    parameters, so evaluate the rest here, on the loading thread.
    """
    mx.eval([v for _, v in tree_flatten(model) if isinstance(v, mx.array)])


@dataclass
class ModelParts:
    """The parts that need the model and the plan alone: the warm-up runs on
    them while the tokenizer may still be loading."""

    layout: Layout
    capacity: Capacity | None
    prompt_cache: PromptCache
    runner: BatchRunner
    memory: KVMemory
    scheduler: Scheduler
    disk: DiskTier | None = None


@dataclass
class RequestParts:
    """The parts that turn requests into sequences and tokens into events:
    they need the tokenizer (its EOS ids, its vocabulary, its detokenizer)."""

    samplers: SamplerPool
    grammars: Grammars
    admission: Admission
    output: OutputProcessor
    executor: PlanExecutor
    reporter: Reporter


def _ledger(plan: KVPlan, o: EngineOptions, layout: Layout) -> Ledger | None:
    if o.kv_cache_memory is None:
        return None
    share = share_for(
        plan, o.kv_cache_memory, prefill_step=o.prefill_step_size,
        prompt_rows=o.prompt_concurrency, paged=layout.paged, block_size=layout.block_size or 0,
    )  # fmt: skip
    return Ledger([share])


def build_model_side(
    model: Any, plan: KVPlan, o: EngineOptions, draft: DraftModel | None
) -> ModelParts:
    """The engine's model-side parts for `model` under `plan`; see the module docstring."""
    materialize(model)
    if draft is not None:
        materialize(draft.model)
    layout = choose_layout(plan, o.block_size, on_disk=o.disk is not None)
    log.info("KV layout of the batch: %s", layout.description)
    ledger = _ledger(plan, o, layout)
    capacity = None
    if ledger is not None:
        capacity = ledger.capacity(capacity_tokens(o.max_context), o.max_context)
    # what a speculative sequence's draft-model caches cost (one row, no batch)
    draft_cost = None
    if ledger is not None and draft is not None:
        draft_cost = CostModel.from_plan(
            draft.plan, prefill_step=o.prefill_step_size, prompt_rows=1
        )
    # the speculative lane runs the model's own caches, not the block pools
    lane_cost = None
    if draft_cost is not None and layout.block_size is not None:
        lane_cost = CostModel.from_plan(plan, prefill_step=o.prefill_step_size, prompt_rows=1)
    runner = BatchRunner(
        model,
        RunnerOptions(
            o.decode_concurrency, o.prompt_concurrency, o.prefill_step_size, layout.block_size
        ),
        draft,
    )
    prompt_cache = PromptCache(o.prompt_cache_size, o.prompt_cache_bytes)
    memory = KVMemory(
        ledger, prompt_cache, pages=runner.pages, prompt_cache_bytes=o.prompt_cache_bytes,
        draft_cost=draft_cost, live_bytes=runner.live_bytes, lane_cost=lane_cost,
    )  # fmt: skip
    disk = None
    if o.disk is not None:
        disk = open_tier(o.disk, model, plan, layout.block_size, layout.paged, runner.pages)
        disk.staging = memory
        memory.disk = disk
    scheduler = Scheduler(
        Limits(o.decode_concurrency, o.prompt_concurrency), memory, lane=draft is not None
    )
    return ModelParts(layout, capacity, prompt_cache, runner, memory, scheduler, disk)


def build_request_side(
    tokenizer: Any,
    parts: ModelParts,
    plan: KVPlan,
    o: EngineOptions,
    inbox: Inbox,
    metrics: EngineMetrics,
    speculation: bool,
) -> RequestParts:
    """The engine's tokenizer-side parts, over its model-side `parts`."""
    runner, memory, prompt_cache = parts.runner, parts.memory, parts.prompt_cache
    # mlx_lm.server's XTC special tokens: the newline's tokens and EOS
    samplers = SamplerPool(xtc_special=(*tokenizer.encode("\n"), *tokenizer.eos_token_ids))
    grammars = Grammars(tokenizer)  # reads the vocabulary on a thread of its own
    admission = Admission(
        memory, metrics, tokenizer, grammars, samplers, max_context=o.max_context,
        max_queued=o.max_queued_requests, speculation=speculation,
        keeps_prompts=o.prompt_cache_size > 0,
    )  # fmt: skip
    eos_ids = frozenset(tokenizer.eos_token_ids)
    output = OutputProcessor(
        runner, parts.scheduler, memory, prompt_cache, metrics, eos_ids, inbox.admitted
    )
    executor = PlanExecutor(
        plan, runner, parts.scheduler, memory, prompt_cache, samplers, metrics, output,
        inbox.admitted, StopSequences([(t,) for t in sorted(eos_ids)]),
    )  # fmt: skip
    reporter = Reporter(
        metrics, parts.scheduler, runner, memory, prompt_cache, inbox, output, parts.disk
    )
    return RequestParts(samplers, grammars, admission, output, executor, reporter)


__all__ = [
    "EngineOptions",
    "ModelParts",
    "RequestParts",
    "build_model_side",
    "build_request_side",
    "materialize",
]

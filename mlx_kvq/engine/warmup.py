"""Readiness: a warm-up that proves the quantized batch path works.

Before `/health` says ready, the engine runs a small batch through exactly
the path requests take (plan caches, mlx-lm's `BatchGenerator`, extraction
for the prompt cache): one sequence long enough to pass `--quantized-kv-start`,
every sliding window and what a split layer keeps exact, joined while it decodes by two short ones of
different lengths (right padding, a merge into the running batch), then
checks with `cache_report` that every KV cache kind of the model ended up
quantized (`run_warmup`; with a draft model, one sequence through the
speculative lane too). Only one prompt is long: prefill is the warm-up's
cost. Its prompts are token ids, not text (`filler_tokens`), so it needs
no tokenizer and runs while the tokenizer loads. The report it leaves is
what `/health` shows.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_kvq.caches import cache_report, exact_tokens_held
from mlx_kvq.config import KVConfig, UnsupportedKVConfig, is_split
from mlx_kvq.plan import KV_KINDS

from .coordinator import WarmupVerdict

log = logging.getLogger("mlx_kvq.engine")

WARMUP_JOINING = (16, 13)  # short prompts that join the long one together: padding and merge
WARMUP_DECODE = 2  # tokens each short prompt generates (the long one twice that): in-place writes
WARMUP_MARGIN = 8  # tokens beyond the furthest threshold


class WarmupFailed(RuntimeError):
    """The warm-up ran but did not show the configured KV layout."""


class Status(str, Enum):
    """Where the engine is in its life, as `/health` reports it."""

    WARMING_UP = "warming_up"
    READY = "ready"
    DRAINING = "shutting_down"  # finishing what it has, refusing new requests
    FAILED = "failed"


@dataclass(frozen=True)
class ReadinessState:
    status: Status
    reason: str | None = None
    report: dict[str, Any] | None = None


class Readiness:
    """Thread-safe readiness flag with the reason for the current state."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = ReadinessState(Status.WARMING_UP)
        self.ready_event = threading.Event()

    def get(self) -> ReadinessState:
        with self._lock:
            return self._state

    @property
    def ready(self) -> bool:
        return self.get().status is Status.READY

    def set_ready(self, report: dict[str, Any]) -> None:
        with self._lock:
            self._state = ReadinessState(Status.READY, None, report)
        self.ready_event.set()

    def set_draining(self, reason: str) -> None:
        """Shutting down: requests already in flight finish, new ones are refused."""
        with self._lock:
            if self._state.status is not Status.FAILED:
                self._state = ReadinessState(Status.DRAINING, reason, self._state.report)

    def set_failed(self, reason: str) -> None:
        with self._lock:
            self._state = ReadinessState(Status.FAILED, reason, self._state.report)
        self.ready_event.set()


@dataclass(frozen=True)
class WarmupSpec:
    long: int  # the first prompt's length: past every threshold
    joining: tuple[int, ...]  # prompts inserted together once the first decodes
    max_tokens: int  # tokens each joining prompt generates
    must_exceed: int  # tokens a sequence must pass: window and quantized start

    @property
    def batch_size(self) -> int:
        return 1 + len(self.joining)

    @property
    def first_tokens(self) -> int:
        """Tokens the long prompt generates: enough to decode beside the others."""
        return 2 * self.max_tokens


def held_exact(plan: Any, block_size: int | None) -> int:
    """The most tokens a split-layout layer of `plan` holds exact before its
    first quantized token (`LayerPlan.exact_rows`; in the paged form of
    `block_size`-token blocks, `exact_tokens_held` less the slot being
    written)."""
    most = 0
    for p in plan.kv_layers:
        if p.quantized and is_split(p.key_spec, p.value_spec):
            most = max(most, p.exact_rows(sys.maxsize))
            if block_size:
                most = max(most, exact_tokens_held(block_size, p.key_spec, p.value_spec) - 1)
    return most


def warmup_spec(
    max_window: int | None, kv: KVConfig, max_context: int | None, exact: int = 0
) -> WarmupSpec:
    """Prompt lengths that carry every sequence past all thresholds (`exact`:
    the tokens a layer keeps exact before it quantizes one, `held_exact`)."""
    must_exceed = max(max_window or 0, kv.quantized_start + exact)
    longest = must_exceed + WARMUP_MARGIN
    spec = WarmupSpec(longest, WARMUP_JOINING, WARMUP_DECODE, must_exceed)
    if max_context is not None and longest + spec.first_tokens > max_context:
        raise UnsupportedKVConfig(
            f"the warm-up needs {longest + spec.first_tokens} tokens (past the sliding window, "
            f"--quantized-kv-start {kv.quantized_start} and the {exact} tokens kept exact) but "
            f"the plan allows a context of {max_context}; lower --quantized-kv-start or "
            "raise --max-kv-size"
        )
    return spec


def summarize(report: list[dict]) -> dict[str, dict[str, Any]]:
    """Fold a per-slot `cache_report` into one line per cache kind."""
    kinds: dict[str, dict[str, Any]] = {}
    for slot in report:
        k = kinds.setdefault(
            slot["kind"], {"slots": 0, "quantized": 0, "max_tokens": 0, "nbytes": 0}
        )
        k["slots"] += 1
        k["quantized"] += int(bool(slot.get("quantized")))
        k["max_tokens"] = max(k["max_tokens"], int(slot.get("tokens", 0)))
        k["nbytes"] += int(slot.get("nbytes", 0))
    return kinds


def verify_warmup(
    kv: KVConfig,
    kv_slots: int | None,
    batch_report: list[dict],
    extracted_report: list[dict],
    sequence_tokens: int,
    spec: WarmupSpec,
    rows: int = 1,
) -> dict[str, Any]:
    """Check the warm-up reports; return the readiness report (`batch_size`:
    the most sequences that decoded in one step, `rows`) or raise WarmupFailed."""
    batch, extracted = summarize(batch_report), summarize(extracted_report)
    problems = []
    if sequence_tokens <= spec.must_exceed:
        problems.append(f"sequence reached {sequence_tokens} tokens, needs > {spec.must_exceed}")
    seen = sum(k["slots"] for kind, k in batch.items() if kind in KV_KINDS)
    if kv_slots is not None and seen != kv_slots:
        problems.append(f"the batch held {seen} KV caches, the plan has {kv_slots}")
    problems += unquantized(kv, {"batch": batch, "extracted": extracted})
    if problems:
        raise WarmupFailed(
            "warm-up did not exercise the configured KV layout: " + "; ".join(problems)
        )
    return {
        "sequence_tokens": sequence_tokens,
        "batch_size": rows,
        "batch": batch,
        "extracted": extracted,
    }


def unquantized(kv: KVConfig, summaries: dict[str, dict]) -> list[str]:
    """Problems: KV caches left unquantized where the setting quantizes all
    (`summaries`: where -> `summarize` of a cache report)."""
    if not kv.enabled or kv.allow_partial:
        return []
    return [
        f"{s['slots'] - s['quantized']} of {s['slots']} {kind} caches were not quantized ({where})"
        for where, kinds in summaries.items()
        for kind, s in kinds.items()
        if kind in KV_KINDS and s["quantized"] < s["slots"]
    ]


def verify_speculation(
    kv: KVConfig,
    target_report: list[dict],
    draft_report: list[dict],
    windows: list[tuple[int, int]],
    num_draft_tokens: int,
) -> dict[str, Any]:
    """Check the speculative warm-up: both models' KV caches quantized as
    configured, every window within its size plus one rewindable step
    (`windows`: (slots held, window size) per window cache)."""
    target, draft = summarize(target_report), summarize(draft_report)
    problems = []
    problems += unquantized(kv, {"model": target, "draft model": draft})
    for held, size in windows:
        if held > size + num_draft_tokens + 1:
            problems.append(f"a window of {size} held {held} slots")
    if problems:
        raise WarmupFailed("speculative warm-up: " + "; ".join(problems))
    return {"model": target, "draft": draft}


def check_batch_path(
    make_cache: Callable[[], list],
    kv: KVConfig,
    report: Callable[[list], list[dict]] = cache_report,
    max_batch: int | None = None,
) -> None:
    """Refuse, before serving, a plan whose caches cannot honour the settings in a batch.

    Every cache must have a batch form (`merge`, of `max_batch` caches when
    the plan limits the batch: a model that runs one sequence at a time), and when
    `--quantized-kv-start` is above 0 the batch form of every KV cache must
    carry that start (it converts to quantized storage itself). A setting
    that would be ignored in the batch path is an error, never a silent
    fallback.
    """
    a, b = make_cache(), make_cache()
    for i, (ca, cb) in enumerate(zip(a, b, strict=True)):
        kinds = [slot["kind"] for slot in report([ca])]
        what = f"cache slot {i} ({'/'.join(kinds)}, {type(ca).__name__})"
        merge = getattr(type(ca), "merge", None)
        if merge is None:
            raise UnsupportedKVConfig(
                f"{what} has no batch form, so it cannot be served with continuous batching"
            )
        batch = merge([ca, cb][: max_batch or 2])
        if kv.quantized_start <= 0:
            continue
        members = getattr(batch, "caches", None) or [batch]
        for kind, member in zip(kinds, members, strict=False):
            if kind in KV_KINDS and getattr(member, "start", None) != kv.quantized_start:
                raise UnsupportedKVConfig(
                    f"--quantized-kv-start {kv.quantized_start} cannot be honoured in the "
                    f"batch path: the batch form of {what} ({type(member).__name__}) does "
                    "not convert at a start position; use --quantized-kv-start 0"
                )


FILLER_IDS = 4096  # the warm-up's prompts walk over ids below this (and the vocabulary)


def filler_tokens(model: Any) -> list[int]:
    """Token ids for the warm-up's prompts, chosen without the tokenizer (it
    loads while the warm-up runs): a walk over the ids below `FILLER_IDS`
    that every embedding table of `model` holds, 0 (often padding) left out."""
    tables = (nn.Embedding, nn.QuantizedEmbedding)
    rows = [m.weight.shape[0] for _, m in model.named_modules() if isinstance(m, tables)]
    n = min([FILLER_IDS, *rows])
    if n < 2:
        return [0]
    return [1 + (37 * i) % (n - 1) for i in range(n - 1)]


def run_warmup(
    runner: Any, plan: Any, kv: KVConfig, max_context: int | None, draft: Any
) -> tuple[WarmupVerdict, int]:
    """Run the readiness warm-up through the real batch path (and the
    speculative lane, with a draft model): this rank's verdict and the width
    of the model's logits (0 if the warm-up did not see them)."""
    t0 = time.monotonic()
    exact = held_exact(plan, None if runner.pages is None else runner.pages.block_size)
    spec = warmup_spec(plan.max_window, kv, max_context, exact)
    filler = filler_tokens(runner.model)
    first, *joining = [(filler * (n // len(filler) + 1))[:n] for n in (spec.long, *spec.joining)]
    run = runner.warm_up(first, spec.first_tokens, joining, spec.max_tokens, plan.make_cache)
    try:
        report = verify_warmup(
            kv,
            len(plan.kv_layers),
            run.batch_report,
            run.longest_report,
            run.longest,
            spec,
            run.rows,
        )
    except WarmupFailed as e:
        log.error("%s", e)
        return WarmupVerdict(False, error=str(e)), run.vocab
    if runner.lane is not None:
        try:
            report["speculative"] = _warmup_speculation(runner, plan, kv, draft, filler)
        except Exception as e:  # noqa: BLE001 - the draft path does not work: not ready
            log.error("speculative warm-up failed: %s", e)
            return WarmupVerdict(False, error=f"speculative warm-up failed: {e}"), run.vocab
    mx.clear_cache()
    report["seconds"] = round(time.monotonic() - t0, 3)
    log.info("warm-up done in %.2fs: %s", report["seconds"], report["batch"])
    return WarmupVerdict(True, report=report), run.vocab


def _warmup_speculation(runner, plan, kv: KVConfig, draft, filler: list[int]) -> dict:
    """One greedy sequence through the lane, past every window of both
    models, drafting and rewinding; the caches it leaves are checked."""
    windows = [plan.max_window or 0, draft.plan.max_window or 0]
    n = max(*windows, kv.quantized_start) + WARMUP_MARGIN
    k = draft.num_draft_tokens
    prompt = (filler * (n // len(filler) + 1))[:n]
    run = runner.warm_up_lane(prompt, plan.make_cache(), k, 4 * (k + 1))
    report = verify_speculation(kv, run.target_report, run.draft_report, run.windows, k)
    report.update(
        draft_model=draft.name, num_draft_tokens=k, prompt_tokens=n,
        generated=run.generated, accepted=run.accepted,
    )  # fmt: skip
    log.info(
        "speculative warm-up: %d tokens, %d drafted tokens accepted", run.generated, run.accepted
    )
    return report

"""The KV memory budget: prices, bounds, admission, in the engine itself.

- Every slot's price per token is exact: a cache holding n buffer slots
  holds exactly the bytes the cost model charges for n slots (quantized
  packing and 16-bit scales, the model's float32 when raw).
- The engine, under a small budget and a mix of short and long prompts,
  chunked prefill, prompt-cache hits and cancellations, never holds more
  than the budget nor more than the bound of the sequences it admitted,
  measured from inside after every step, and serves every request.
- Under one budget the default KV setting runs at least 3x as many
  sequences at once as unquantized caches.
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import mlx.core as mx
import pytest
from kvq_testing.budget import WINDOWS_8BIT, spy_checks
from kvq_testing.events import Collector, wait_until
from kvq_testing.tiny import save_tiny_model
from mlx_lm import load

from mlx_kvq.bench.serving_bench import BenchTokenizer
from mlx_kvq.caches import cache_report
from mlx_kvq.config import AUTO_BLOCK_SIZE, KVConfig
from mlx_kvq.defaults import DEFAULT_KV_CONFIG
from mlx_kvq.engine import (
    BudgetShare,
    Checkpoint,
    Engine,
    EngineOptions,
    ErrorEvent,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    Ledger,
    LocalCoordinator,
    PromptProgress,
    SamplingParams,
    Segment,
    Shape,
    TokenEvent,
)
from mlx_kvq.engine.budget import (
    CostModel,
    MachineMemory,
    Share,
    SlotCost,
    default_budget,
    share_for,
)
from mlx_kvq.engine.prompt_cache import PromptCache, cache_nbytes
from mlx_kvq.mlx_lm_internals import batch_caches
from mlx_kvq.plan import plan_kv

WAIT_S = 300
SETTINGS = {
    "K4/V3, windows 8-bit": WINDOWS_8BIT,
    "4-bit": KVConfig(bits=4),
    "8-bit": KVConfig(bits=8),
    "unquantized": KVConfig(),
    "4-bit from token 40": KVConfig(bits=4, quantized_start=40),
}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    # float32 weights, 2 sliding-window layers of 32 tokens and 2 full-attention layers
    path = save_tiny_model(
        tmp_path_factory.mktemp("budget") / "m", "gemma3_text", sliding_window=32,
        max_position_embeddings=4096,
    )  # fmt: skip
    return load(str(path))


class Sink:
    def __init__(self):
        self.done = threading.Event()
        self.tokens = 0
        self.end = None

    def __call__(self, event):
        if isinstance(event, TokenEvent):
            self.tokens += 1
        else:
            self.end = event
            self.done.set()


@pytest.mark.parametrize("name", list(SETTINGS))
def test_price_per_slot_is_what_caches_hold(loaded, name):
    model, _ = loaded
    plan = plan_kv(model, SETTINGS[name], batch=True)
    cost = share_for(plan, 1, prefill_step=2048, prompt_rows=8).cost
    for n in (1, 39, 41, 300):  # below and above quantized_kv_start, past the window
        caches = plan.make_cache()
        model(mx.array([list(range(1, n + 1))]), cache=caches)
        report = [r for r in cache_report(caches) if r["kind"] in ("full", "sliding")]
        assert len(report) == len(cost.slots) == 4
        for c, slot, r in zip(caches, cost.slots, report, strict=True):
            mx.eval(c.keys.parts, c.values.parts)
            held = c.keys.length  # buffer slots, used or not
            quantized = c.keys.quantized or c.values.quantized
            per_token = slot.stored if quantized else slot.raw
            assert r["nbytes"] == c.nbytes == per_token * held, (name, n, r)
            assert cost.slot_bytes(slot, held) >= r["nbytes"]


SPLIT_SETTINGS = {
    "split, keys per channel": KVConfig(
        bits=4, value_bits=3, key_scales="channel", key_group_size=32, sinks=4, residual=8
    ),
    "split, keys per token": KVConfig(bits=4, sinks=2, residual=5),
    "default": DEFAULT_KV_CONFIG,
}


@pytest.mark.parametrize("name", list(SPLIT_SETTINGS))
def test_the_split_layouts_padded_rows_are_within_their_price(loaded, name):
    """A split-layout row holds 16-bit sinks and an exact tail beside its
    quantized body, and a window drops its body a whole group at a time:
    what one row holds, fed a token at a time past the window and past
    several groups, never exceeds what the cost model charges for it."""
    model, _ = loaded
    plan = plan_kv(model, SPLIT_SETTINGS[name], batch=True)
    cost = share_for(plan, 1, prefill_step=16, prompt_rows=1).cost
    caches = plan.make_cache()
    model(mx.array([list(range(1, 17))]), cache=caches)
    most = 0
    for n in range(17, 140):
        model(mx.array([[n % 100 + 1]]), cache=caches)
        held = sum(c.nbytes for c in caches)
        most = max(most, held)
        assert held <= cost.bound([Shape(n, n)], prompting=[]), (name, n)
    assert most > 0


def test_prices_follow_the_setting(loaded):
    model, _ = loaded
    per = {
        name: share_for(plan_kv(model, kv, batch=True), 1, prefill_step=64, prompt_rows=4)
        for name, kv in SETTINGS.items()
    }
    # head dim 64, 2 KV heads, float32: raw 2*64*2*4 = 1024 B/token; K4/V3 with
    # 16-bit scale and bias per 64 elements: 2*64*(0.5 + 0.375 + 2*4/64) = 128;
    # its sliding windows are 8-bit: 2*64*(1 + 1 + 2*4/64) = 272
    assert [s.stored for s in per["unquantized"].cost.slots] == [1024] * 4
    assert [s.stored for s in per["K4/V3, windows 8-bit"].cost.slots] == [272, 128, 272, 128]
    assert [s.stored for s in per["4-bit"].cost.slots] == [144] * 4
    assert [s.stored for s in per["8-bit"].cost.slots] == [272] * 4
    assert per["K4/V3, windows 8-bit"].unquantized.slots == per["unquantized"].cost.slots
    for kv in SPLIT_SETTINGS.values():  # unquantized, a row holds nothing exact besides
        split = share_for(plan_kv(model, kv, batch=True), 1, prefill_step=64, prompt_rows=4)
        assert split.unquantized.slots == per["unquantized"].cost.slots
    assert [s.window for s in per["K4/V3, windows 8-bit"].cost.slots] == [32, None, 32, None]


def _cost(prompt_rows=2, step=16) -> CostModel:
    slots = (SlotCost(None, 10, 40), SlotCost(8, 10, 40))
    return CostModel(slots, 0, 0, step, prompt_rows, "K4/V4")


def test_bound_counts_padding_windows_and_prompt_rows():
    cost = _cost()
    decoding, prompting = cost.row_bounds(100, 20)
    assert decoding == 10 * (100 + 255) + 10 * 8
    assert prompting == 10 * (20 + 16 + 255) + 10 * (8 - 1 + 16)
    # the batch pads every row to its longest sequence
    assert cost.bound([Shape(20, 100), Shape(5, 10)]) == 2 * decoding
    big = Shape(490, 500)
    d, p = cost.row_bounds(500, 490)
    assert p > d and cost.bound([big] * 5) == 5 * d + 2 * (p - d)  # at most 2 prompt rows


def test_sequences_is_the_largest_count_that_fits():
    cost = _cost(prompt_rows=3)
    shape = Shape(300, 420)
    for budget in (10_000, 50_000, 123_456, 1_000_000):
        n = cost.sequences(budget, shape)
        assert cost.bound([shape] * n) <= budget < cost.bound([shape] * (n + 1))


def test_ledger_admits_grows_releases_and_explains():
    cost = _cost()
    shape = Shape(20, 100)
    one = cost.bound([shape])
    ledger = Ledger([Share(2 * one + 10, cost, cost.unquantized())])
    assert ledger.fits(shape)
    ledger.reserve(1, shape)
    ledger.reserve(2, shape)
    assert not ledger.fits(shape) and ledger.room() == 10
    ledger.release(1, after_step=True)  # a prompt row: freed after the next step
    assert not ledger.fits(shape)
    ledger.settle()
    assert ledger.fits(shape)
    # a row in its prompt is charged a prompt row (chunk padding); decoding, it holds less
    alone = Ledger([Share(10 * one, cost)])
    alone.reserve(1, Shape(90, 100))
    held = alone.reserved()
    alone.prompt_done(1)
    assert alone.reserved() == cost.bound([Shape(90, 100)], []) < held
    ledger.prompt_done(2)
    # growth is taken while it fits, refused (and nothing changed) when it does not
    assert ledger.grow(2, 150) and ledger.shapes[2] == Shape(20, 150)
    assert not ledger.grow(2, 10_000) and ledger.shapes[2] == Shape(20, 150)
    verdict = ledger.verdict(Shape(20, 2000))
    assert not verdict.fits_alone and verdict.needs == cost.bound([Shape(20, 2000)])
    assert ledger.longest_prompt(10_000) == max(
        n for n in range(1, 3000) if cost.bound([Shape(n, n + 1)]) <= ledger.budget
    )
    # a group admits and grows only what every rank holds
    small = Share(one, cost)
    group = Ledger([Share(10 * one, cost), small])
    group.reserve(1, shape)
    assert not group.fits(shape) and not group.verdict(Shape(20, 2000)).fits_alone
    assert not group.grow(1, 150)


def test_default_budget_from_the_machine():
    gib = 2**30
    size, how = default_budget(gib, MachineMemory(None, 16 * gib))
    assert size == 7 * gib and "50% of RAM" in how
    size, how = default_budget(gib, MachineMemory(32 * gib, 64 * gib))
    assert size == int(0.9 * 32 * gib) - gib and "working set" in how
    assert default_budget(20 * gib, MachineMemory(None, 16 * gib))[0] == 0


def _flood(engine: Engine, requests: list[tuple[list[int], int]], cancel=()) -> list[Sink]:
    sinks = []
    for i, (prompt, max_tokens) in enumerate(requests):
        sink = Sink()
        request = GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens))
        engine.submit(request, sink)
        sinks.append(sink)
        if i in cancel:
            time.sleep(0.02)
            engine.cancel(request.id)
            sink.cancelled = True
    for s in sinks:
        if not getattr(s, "cancelled", False):
            assert s.done.wait(WAIT_S), "a request was never answered"
    return sinks


def _engine(model, tokenizer, kv, budget, **options) -> Engine:
    plan = plan_kv(model, kv, batch=True)
    engine = Engine(model, tokenizer, plan, kv, EngineOptions(
        kv_cache_memory=budget, max_context=plan.max_context, **options))  # fmt: skip
    engine.start()
    assert engine.readiness.ready_event.wait(WAIT_S) and engine.readiness.ready
    return engine


@pytest.mark.parametrize(
    ("name", "budget", "block_size"),
    [("K4/V3, windows 8-bit", 700_000, AUTO_BLOCK_SIZE),
     ("K4/V3, windows 8-bit", 700_000, None),
     ("4-bit from token 40", 2_500_000, AUTO_BLOCK_SIZE),
     ("split, keys per channel", 900_000, AUTO_BLOCK_SIZE),
     ("split, keys per token", 1_200_000, AUTO_BLOCK_SIZE),
     ("split, keys per token", 1_200_000, None),
     ("default", 1_500_000, AUTO_BLOCK_SIZE)],
    ids=lambda v: "padded" if v is None else None,
)  # fmt: skip
def test_engine_never_holds_more_than_the_budget_or_the_bound(
    loaded, name, budget, block_size, monkeypatch
):
    """Mixed lengths, 16-token prefill chunks, prompt-cache hits and cancels,
    paged (the split settings: full-attention layers paged, windows in padded
    rows) and in padded rows alone (`--kv-block-size 0`)."""
    model, tokenizer = loaded
    measured = spy_checks(monkeypatch)
    kv = {**SETTINGS, **SPLIT_SETTINGS}[name]
    engine = _engine(model, tokenizer, kv, budget, prefill_step_size=16,
                     prompt_concurrency=3, prompt_cache_size=16, block_size=block_size)  # fmt: skip
    try:
        rng = random.Random(1)
        shared = [rng.randrange(1, 300) for _ in range(200)]
        _flood(engine, [(shared[:50], 4)])  # a conversation's first turn, in the prompt cache
        requests = [(shared[:80], 30), (shared[:120], 20)]  # its next turns
        for _ in range(10):
            if rng.random() < 0.3:
                prompt = shared[: rng.randrange(10, 160)]
            else:
                prompt = [rng.randrange(1, 300) for _ in range(rng.randrange(1, 100))]
            requests.append((prompt, rng.randrange(1, 40)))
        sinks = _flood(engine, requests, cancel={3, 9})
    finally:
        engine.stop()
    ends = [s.end for s in sinks if not getattr(s, "cancelled", False)]
    assert all(isinstance(e, FinishEvent) for e in ends), ends
    ledger = engine.budget
    assert ledger.overruns == 0 and ledger.bound_misses == 0
    assert 0 < ledger.peak_held <= budget
    assert len(measured) > 50
    for live, reserved, prompt_cache in measured:
        assert live <= reserved and live + prompt_cache <= budget
    # the bound is not vacuous: at its tightest the batch holds most of it (padded
    # rows: half, their buffers priced a growth step ahead)
    tightest = max(live / reserved for live, reserved, _ in measured if reserved)
    assert tightest > (0.6 if block_size else 0.5), tightest
    assert engine.metrics.snapshot().max_batch_size >= 2
    assert engine.prompt_cache.stats().hits > 0


def test_live_bytes_are_the_cache_report(loaded, monkeypatch):
    """What the engine measures after a step is what `cache_report` shows."""
    model, tokenizer = loaded
    pairs = []
    check = Ledger.check
    engines = []

    def spy(self, live, prompt_cache):
        caches = batch_caches(engines[0].runner.generator)
        pairs.append((live, sum(int(r["nbytes"]) for r in cache_report(caches))))
        return check(self, live, prompt_cache)

    monkeypatch.setattr(Ledger, "check", spy)
    engines.append(_engine(model, tokenizer, DEFAULT_KV_CONFIG, 10**7, prefill_step_size=32))
    try:
        _flood(engines[0], [(list(range(1, 90)), 40), (list(range(5, 30)), 60)])
    finally:
        engines[0].stop()
    assert pairs and all(live == reported for live, reported in pairs)
    assert max(live for live, _ in pairs) > 0


def test_default_setting_runs_3x_the_sequences_of_unquantized(loaded):
    """One budget, the same flood of 1,000-token conversations: sequences
    decoded together at once (the default keeps 4 sinks and its newest 128
    tokens exact, which short conversations do not amortize)."""
    model, tokenizer = loaded
    budget = 20_000_000
    at_once = {}
    for name, kv in (("unquantized", KVConfig()), ("default", DEFAULT_KV_CONFIG)):
        engine = _engine(model, tokenizer, kv, budget, prompt_cache_size=0)
        try:
            requests = [([1 + (i * 7 + j) % 300 for j in range(1000)], 16) for i in range(12)]
            sinks = _flood(engine, requests)
            assert all(isinstance(s.end, FinishEvent) for s in sinks)
            at_once[name] = engine.metrics.snapshot().max_batch_size
            assert engine.budget.overruns == 0 and engine.budget.peak_held <= budget
            # as many as decode together within the budget, no more
            cost = engine.budget.share.cost
            assert cost.bound([Shape(1000, 1016)] * at_once[name], []) <= budget
        finally:
            engine.stop()
    print(f"under {budget} bytes: sequences at once {at_once}")
    assert at_once["unquantized"] >= 1
    # (all twelve at once is as many as there are)
    assert at_once["default"] >= min(12, 3 * at_once["unquantized"])


def test_only_a_prompt_that_never_fits_is_refused_at_once(loaded):
    """max_tokens reserves nothing: a prompt that cannot fit even alone gets a
    400 at once, a short prompt with a huge max_tokens is served."""
    model, tokenizer = loaded
    engine = _engine(model, tokenizer, WINDOWS_8BIT, 400_000, max_queued_requests=2)
    try:
        longest = engine.budget.longest_prompt(4096, 32)
        sink = Sink()
        engine.submit(
            GenerationRequest(list(range(1, longest + 40)), SamplingParams(max_tokens=3)), sink
        )
        assert sink.done.is_set()  # answered inside submit(), not after a step
        assert isinstance(sink.end, ErrorEvent) and sink.end.status == 400
        assert "KV budget of 390.6 KiB" in sink.end.message
        told = engine.budget.longest_prompt(4096, 3)  # with this request's own reserve
        assert f"shorten the prompt to {told:,} tokens" in sink.end.message
        assert engine.metrics.snapshot().rejections == {"kv_budget": 1}
        served = Collector()
        request = GenerationRequest(list(range(1, longest)), SamplingParams(max_tokens=32_000))
        engine.submit(request, served)
        assert served.first_token.wait(WAIT_S)  # admitted and decoding
        engine.cancel(request.id)
        assert not [e for e in served.events if isinstance(e, ErrorEvent)]
        assert f"prompts of up to {engine.budget.longest_prompt(4096):,} tokens fit" in (
            engine.capacity.line
        )
    finally:
        engine.stop()


def test_one_long_sequence_under_a_small_budget_ends_with_length(loaded):
    """It grows while the budget holds it alone, then ends with length, never
    holding more than the budget."""
    model, tokenizer = loaded
    budget = 150_000
    engine = _engine(model, tokenizer, WINDOWS_8BIT, budget)
    try:
        cost = engine.budget.share.cost
        most = max(n for n in range(1, 2000) if cost.bound([Shape(20, n)], []) <= budget)
        no_eos = tuple((t, -1e9) for t in tokenizer.eos_token_ids)  # it never stops by itself
        served = Sink()
        params = SamplingParams(max_tokens=32_000, logit_bias=no_eos)
        engine.submit(GenerationRequest(list(range(1, 21)), params), served)
        assert served.done.wait(WAIT_S)
    finally:
        engine.stop()
    assert isinstance(served.end, FinishEvent) and served.end.reason == FinishReason.LENGTH
    assert most - 40 <= 20 + served.tokens <= most + 1
    assert engine.budget.overruns == 0 and 0 < engine.budget.peak_held <= budget


def test_a_request_waiting_behind_one_the_budget_ends_runs_after_it(loaded):
    """The first request grows until the budget cannot hold it even alone and
    ends with length; the second, waiting for room, then runs to its own
    limit. Its turn came in the step that ended the first, whose blocks stay
    in the pool until its rows leave the batch: it was once ended with no
    token, as if nothing would ever free memory."""
    model, tokenizer = loaded
    engine = _engine(model, tokenizer, DEFAULT_KV_CONFIG, 600_000, prompt_cache_size=0)
    no_eos = tuple((t, -1e9) for t in tokenizer.eos_token_ids)
    sinks = [Sink(), Sink()]
    try:
        for sink, max_tokens in zip(sinks, (32_000, 8), strict=True):
            prompt = [1 + (j * 7) % 300 for j in range(200)]
            params = SamplingParams(max_tokens=max_tokens, logit_bias=no_eos)
            engine.submit(GenerationRequest(prompt, params), sink)
        assert all(s.done.wait(WAIT_S) for s in sinks)
    finally:
        engine.stop()
    first, second = sinks
    assert first.end.reason == second.end.reason == FinishReason.LENGTH
    assert 200 < first.tokens < 32_000 and second.tokens == 8
    assert engine.budget.overruns == 0


class TwoRanks(LocalCoordinator):
    """A group of two in one process: the other rank has half this one's budget."""

    def agree_budget(self, mine: BudgetShare):
        return [mine, BudgetShare(mine.budget // 2, mine.cost, mine.unquantized)], 0


def test_a_group_admits_what_every_rank_holds(loaded):
    model, tokenizer = loaded
    budget = 1_200_000
    plan = plan_kv(model, WINDOWS_8BIT, batch=True)
    options = EngineOptions(kv_cache_memory=budget, max_context=plan.max_context)
    engine = Engine(model, tokenizer, plan, WINDOWS_8BIT, options, coordinator=TwoRanks())
    engine.start()
    try:
        assert engine.readiness.ready_event.wait(WAIT_S) and engine.readiness.ready
        shape = Shape(60, 120)
        cost = engine.budget.share.cost
        assert cost.sequences(budget // 2, shape) < cost.sequences(budget, shape)
        assert engine.capacity.ranks == 2 and "per rank (2 ranks)" in engine.capacity.line
        requests = [([1 + (i * 5 + j) % 300 for j in range(60)], 60) for i in range(8)]
        sinks = _flood(engine, requests)
        assert all(isinstance(s.end, FinishEvent) for s in sinks)
        # they hold what they have, not prompt + max_tokens: the half-budget
        # rank limits how many decode at once
        at_once = engine.metrics.snapshot().max_batch_size

        def decoding(rank_budget: int) -> int:  # rows of 61 tokens, none in its prompt
            return max(
                n for n in range(1, 64) if cost.bound([Shape(60, 61)] * n, []) <= rank_budget
            )

        assert 2 <= at_once <= decoding(budget // 2) < decoding(budget)
        # the prompt cache is charged by its entries' bound on each rank
        charged = sum(cost.entry_bytes(n) for n in engine.prompt_cache.token_counts())
        assert 0 < charged <= budget // 2
        assert engine.budget.overruns == 0 and engine.budget.bound_misses == 0
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def full_only(tmp_path_factory):
    # float32, 2 full-attention layers: its caches can be cut back to a prefix
    path = save_tiny_model(
        tmp_path_factory.mktemp("budget") / "llama", "llama", max_position_embeddings=4096
    )
    return load(str(path))


def test_a_reused_prefix_holds_only_what_it_covers(full_only):
    model, _ = full_only
    plan = plan_kv(model, WINDOWS_8BIT, batch=True)
    per_token = sum(s.stored for s in share_for(plan, 1, prefill_step=64, prompt_rows=1).cost.slots)
    tokens = [1 + i % 300 for i in range(300)]
    cache = plan.make_cache()
    model(mx.array([tokens]), cache=cache)
    assert cache[0].keys.length == 512  # buffers grow in 256-token steps
    pc = PromptCache(max_entries=4)
    assert pc.insert(tokens, cache)
    assert pc.nbytes == 300 * per_token  # the entry holds what it covers
    copy, covered = pc.fetch(tokens[:100] + [7])
    assert covered == 100
    assert cache_nbytes(copy) == 100 * per_token  # cut back and compacted, not 512 slots


def test_prompt_cache_reuse_and_insertions_stay_within_the_budget(full_only, monkeypatch):
    """A long turn in the prompt cache; a shorter prompt reuses its start (a copy
    cut back to it); a long new prompt makes the prompt cache yield. Measured
    inside the engine after admissions and insertions as well as after steps."""
    model, tokenizer = full_only
    budget = 360_000
    measured = spy_checks(monkeypatch)
    engine = _engine(model, tokenizer, WINDOWS_8BIT, budget, prefill_step_size=64)
    try:
        long = [1 + (i * 7) % 300 for i in range(600)]
        other = [2 + (i * 11) % 293 for i in range(800)]  # with the long turn: over budget
        sinks = _flood(engine, [(long, 2)])
        sinks += _flood(engine, [(long[:120] + [5], 2)])
        sinks += _flood(engine, [(other, 2)])
    finally:
        engine.stop()
    assert all(isinstance(s.end, FinishEvent) for s in sinks), [s.end for s in sinks]
    assert sinks[1].end.usage.cached_tokens == 120
    stats = engine.prompt_cache.stats()
    assert stats.hits == 1 and stats.evictions >= 1
    ledger = engine.budget
    assert ledger.overruns == 0 and ledger.bound_misses == 0
    assert len(measured) > engine.metrics.snapshot().steps  # not only after steps
    for live, reserved, prompt_cache in measured:
        assert live <= reserved and live + prompt_cache <= budget
    assert max(live + pc for live, _, pc in measured) > budget // 2


def test_kv_cache_memory_sizes():
    """--kv-cache-memory: bytes, or a decimal or binary suffix."""
    from mlx_kvq.commands.flags import parse_size

    sizes = {"1000000": 10**6, "64KiB": 64 << 10, "512MiB": 512 << 20, "2GiB": 2 << 30,
             "100KB": 10**5, "512MB": 512 * 10**6, "2GB": 2 * 10**9, "1.5 GiB": 3 << 29}  # fmt: skip
    assert {text: parse_size(text) for text in sizes} == sizes
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size("2 parsecs")


def test_the_server_starts_with_a_budget_that_holds_one_useful_prompt(loaded):
    """--max-tokens reserves nothing: a budget far below one default request's
    worst case starts, one that cannot hold a 256-token prompt is refused,
    priced in the layout the engine holds it in (paged here: padded rows
    would price the prompt's chunk besides)."""
    from mlx_kvq.commands.serve import USEFUL_PROMPT, kv_cache_memory
    from mlx_kvq.engine.memory import DECODE_RESERVE
    from mlx_kvq.engine.runner import choose_layout

    model, _ = loaded
    plan = plan_kv(model, DEFAULT_KV_CONFIG, batch=True)
    layout = choose_layout(plan, AUTO_BLOCK_SIZE)
    shape = Shape(USEFUL_PROMPT, USEFUL_PROMPT + DECODE_RESERVE)
    cost = share_for(plan, 1, prefill_step=2048, prompt_rows=8, paged=layout.paged,
                     block_size=layout.block_size).cost  # fmt: skip
    need = cost.bound([shape])
    assert need < share_for(plan, 1, prefill_step=2048, prompt_rows=8).cost.bound([shape])
    args = argparse.Namespace(
        kv_cache_memory=need, max_tokens=100_000, prefill_step_size=2048, prompt_concurrency=8
    )
    assert need < cost.bound([Shape(1, 4096)])  # one worst case of --max-tokens (the context)
    assert kv_cache_memory(args, model, plan) == need
    args.kv_cache_memory = need - 1
    with pytest.raises(ValueError, match=f"cannot hold one prompt of {USEFUL_PROMPT} tokens"):
        kv_cache_memory(args, model, plan)


def test_short_conversations_fit_more_sequences_at_the_default_than_unquantized(loaded):
    """The default's paged full-attention rows keep their newest tokens exact
    (16 bits) beside the blocks: a row is priced by the tail buffer's slots it
    holds (as many as the longest decoding row's, in steps of 32), not by the
    most a tail can hold (sinks + residual + a block), so sequences of 60
    tokens fit more at the default than unquantized (float32 here) under one
    budget, and what they hold stays within it."""
    model, tokenizer = loaded
    budget = 2_000_000
    at_once, fits = {}, {}
    for name, kv in (("unquantized", KVConfig()), ("default", DEFAULT_KV_CONFIG)):
        engine = _engine(model, tokenizer, kv, budget, prompt_cache_size=0, prompt_concurrency=2)
        try:
            requests = [([1 + (i * 7 + j) % 300 for j in range(56)], 24) for i in range(30)]
            sinks = _flood(engine, requests)
            assert all(isinstance(s.end, FinishEvent) for s in sinks)
            at_once[name] = engine.metrics.snapshot().max_batch_size
            ledger = engine.budget
            assert ledger.overruns == 0 and ledger.bound_misses == 0
            assert ledger.peak_held <= budget
            fits[name] = ledger.capacity(60).sequences
        finally:
            engine.stop()
    print(f"under {budget} bytes, 60-token sequences: at once {at_once}, fit {fits}")
    assert fits["default"] >= 1.5 * fits["unquantized"]
    assert at_once["default"] > at_once["unquantized"] >= 1


def test_rows_in_their_prompt_are_priced_by_their_length(loaded):
    """A row in its prompt holds no more exact tokens than it has: eight short
    prompts of 3 to 60 tokens, cut into right-padded batches whose padding
    stays in the tails until the chunk ends, are priced by the longest of
    them, not at the most a tail holds; what they hold stays within the bound
    at every step, and 60-token sequences fit more at the default than
    unquantized with eight rows in their prompt."""
    model, tokenizer = loaded
    budget = 2_000_000
    fits, at_once = {}, {}
    for name, kv in (("unquantized", KVConfig()), ("default", DEFAULT_KV_CONFIG)):
        engine = _engine(model, tokenizer, kv, budget, prompt_cache_size=0, prompt_concurrency=8)
        try:
            lengths = [3 + (i * 13) % 58 for i in range(24)]
            requests = [
                ([1 + (i * 7 + j) % 300 for j in range(n)], 16) for i, n in enumerate(lengths)
            ]
            sinks = _flood(engine, requests)
            assert all(isinstance(s.end, FinishEvent) for s in sinks)
            ledger = engine.budget
            assert ledger.overruns == 0 and ledger.bound_misses == 0
            fits[name] = ledger.capacity(60).sequences
            at_once[name] = engine.metrics.snapshot().max_batch_size
        finally:
            engine.stop()
    print(f"under {budget} bytes, 8 prompt rows: fit {fits}, at once {at_once}")
    assert fits["default"] > fits["unquantized"]


def test_a_long_row_joining_short_ones_was_priced_at_its_admission(loaded, monkeypatch):
    """The rows of a batch's tail buffer all get its longest row's slots, and a
    row joins the decoding batch after its prompt without asking the budget:
    long prompts (past residual + block) among short ones must not take the
    admitted rows' bound, or what they hold, past the budget at any step."""
    model, tokenizer = loaded
    budget = 1_500_000
    measured = spy_checks(monkeypatch)
    engine = _engine(model, tokenizer, DEFAULT_KV_CONFIG, budget, prompt_cache_size=0,
                     prompt_concurrency=4)  # fmt: skip
    try:
        requests = [
            ([1 + (i * 7 + j) % 300 for j in range(300 if i % 6 == 0 else 20)], 8 if i % 6 else 40)
            for i in range(18)
        ]
        sinks = _flood(engine, requests)
        assert all(isinstance(s.end, FinishEvent) for s in sinks)
        assert engine.metrics.snapshot().max_batch_size >= 3
    finally:
        engine.stop()
    ledger = engine.budget
    assert ledger.overruns == 0 and ledger.bound_misses == 0
    assert measured and all(r <= budget and live <= r for live, r, _ in measured)


def _held(plan, tokens: int, own: int | None = None) -> int:
    """Bytes a sequence of `tokens` tokens really holds: every full-attention
    layer its tokens (or `own` of them, the rest mapped from another), every
    window its size."""
    return sum(
        int(p.bytes_per_token() * ((tokens if own is None else own) if p.window is None
                                   else min(tokens, p.window)))
        for p in plan.kv_layers
    )  # fmt: skip


def _sessions(engine, prompts: list[list[int]], system: int, answer: int) -> list[Sink]:
    """Send every prompt at once, greedy, `answer` tokens each, with a
    checkpoint at the shared system prompt's end; wait for all, then stop."""
    checkpoints = (Checkpoint(system, Segment.SYSTEM),)
    sinks = [Sink() for _ in prompts]
    try:
        for prompt, sink in zip(prompts, sinks, strict=True):
            params = SamplingParams(max_tokens=answer, temperature=0.0)
            engine.submit(GenerationRequest(prompt, params, checkpoints=checkpoints), sink)
        assert all(s.done.wait(WAIT_S) for s in sinks)
    finally:
        engine.stop()
    return sinks


def _within_budget(ledger, budget: int, measured, sinks: list[Sink], answer: int) -> None:
    """The engine's own counters: no overrun, no bound missed, every step's
    bytes within the budget, and every session its whole answer (no EOS)."""
    assert ledger.overruns == 0 and ledger.bound_misses == 0
    assert 0 < ledger.peak_held <= budget
    assert all(live <= reserved and live + pc <= budget for live, reserved, pc in measured)
    assert [s.tokens for s in sinks] == [answer] * len(sinks)


def test_sessions_sharing_a_system_prompt_sent_together_stay_within_the_budget(loaded, monkeypatch):
    """Sixteen sessions with one long system prompt (a checkpoint at
    its end) sent at once to a hybrid model, under 1.5x what one whole session
    and the others' own tokens hold. No admission counts on a prefix the
    sequence does not map when it runs, and the oldest is never cut for memory
    the others hold: no overrun, and every session gets its whole answer."""
    model, _ = loaded
    measured = spy_checks(monkeypatch)
    plan = plan_kv(model, WINDOWS_8BIT, batch=True)
    n, own, answer = 16, 12, 75
    rng = random.Random(51)
    system = [rng.randrange(1, 300) for _ in range(500)]
    prompts = [system + [rng.randrange(1, 300) for _ in range(own)] for _ in range(n)]
    total = len(prompts[0]) + answer
    budget = int(1.5 * (_held(plan, total) + (n - 1) * _held(plan, total, own + answer)))
    engine = _engine(model, BenchTokenizer(384), WINDOWS_8BIT, budget, block_size=32,
                     prefill_step_size=128, decode_concurrency=n, prompt_cache_size=64)  # fmt: skip
    sinks = _sessions(engine, prompts, len(system), answer)
    ledger = engine.budget
    _within_budget(ledger, budget, measured, sinks, answer)
    assert all(s.end.reason is FinishReason.LENGTH for s in sinks)
    assert engine.metrics.snapshot().prefix_blocks_reused > 0  # the system prompt was shared


@pytest.mark.parametrize(
    ("name", "block_size", "prefill_step"),
    [("default", AUTO_BLOCK_SIZE, 256), ("K4/V3, windows 8-bit", 32, 128)],
)
def test_sessions_sent_together_compute_their_system_prompt_once(
    loaded, name, block_size, prefill_step, monkeypatch
):
    """Sixteen sessions sharing a 1,000-token system prompt (its end
    on no block boundary) sent at once, under 1.5x what one whole session
    holds plus what the other fifteen hold of their own, as the budget prices
    them. The first computes the prefix; the others wait for its copy and map
    it (full-attention blocks and the windows' state at its end), however
    tight the room the prompt cache gets: the prompt tokens computed are at
    most 1.2x the prefix and every session's own tokens, many decode at
    once, and nothing exceeds the budget."""
    from mlx_kvq.engine.runner import choose_layout

    model, _ = loaded
    measured = spy_checks(monkeypatch)
    kv = {**SETTINGS, **SPLIT_SETTINGS}[name]
    plan = plan_kv(model, kv, batch=True)
    layout = choose_layout(plan, block_size)
    n, own, answer = 16, 12, 75
    rng = random.Random(51)
    system = [rng.randrange(1, 300) for _ in range(1000)]
    prompts = [system + [rng.randrange(1, 300) for _ in range(own)] for _ in range(n)]
    total = len(prompts[0]) + answer
    cost = share_for(plan, 1, prefill_step=prefill_step, prompt_rows=8, paged=layout.paged,
                     block_size=layout.block_size).cost  # fmt: skip
    one = cost.bound([Shape(total, total)], prompting=[])
    per_block = sum(cost.block_bytes(s.key) for s in cost.slots if s.paged and s.window is None)
    shared = len(system) // layout.block_size * per_block  # the prefix's whole blocks
    budget = int(1.5 * one + (n - 1) * (one - shared))
    engine = _engine(model, BenchTokenizer(384), kv, budget, block_size=block_size,
                     prefill_step_size=prefill_step, decode_concurrency=n)  # fmt: skip
    engine.metrics.max_batch_size = 0
    before = engine.metrics.snapshot().prompt_tokens  # the warm-up's
    sinks = _sessions(engine, prompts, len(system), answer)
    ledger, figures = engine.budget, engine.metrics.snapshot()
    _within_budget(ledger, budget, measured, sinks, answer)
    computed = figures.prompt_tokens - before
    assert computed <= 1.2 * len(system) + n * own, computed
    assert figures.max_batch_size >= 14


def test_a_prompt_in_the_batch_is_cut_where_prompts_that_come_later_part_from_it(loaded):
    """Plain prompts sharing a long prefix (no checkpoints: `/v1/completions`
    on a model without a chat template), the first already prefilling, in
    64-token chunks, when the others arrive: its prompt is cut where theirs
    part from it, so they wait for that copy and map it (the prefix is
    computed once, windows and all), and every answer is what it is alone."""
    model, _ = loaded
    rng = random.Random(7)
    prefix = [rng.randrange(1, 300) for _ in range(600)]
    prompts = [prefix + [300 + i] + [rng.randrange(1, 300) for _ in range(19)] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    options = dict(block_size=32, prefill_step_size=64)
    engine = _engine(model, BenchTokenizer(384), WINDOWS_8BIT, 4_000_000, prompt_cache_size=0,
                     **options)  # fmt: skip
    try:  # each alone, nothing kept
        alone = []
        for p in prompts:
            c = Collector()
            engine.submit(GenerationRequest(p, params), c)
            alone.append(c.wait().tokens)
    finally:
        engine.stop()
    engine = _engine(model, BenchTokenizer(384), WINDOWS_8BIT, 4_000_000, prompt_cache_size=16,
                     **options)  # fmt: skip
    try:
        before = engine.metrics.snapshot().prompt_tokens
        sinks = [Collector() for _ in prompts]
        engine.submit(GenerationRequest(prompts[0], params, progress=True), sinks[0])
        wait_until(lambda: any(isinstance(e, PromptProgress) for e in sinks[0].events),
                   "the first prompt's first chunk")  # fmt: skip
        for p, c in zip(prompts[1:], sinks[1:], strict=True):
            engine.submit(GenerationRequest(p, params), c)
        for c in sinks:
            c.wait()
        computed = engine.metrics.snapshot().prompt_tokens - before
    finally:
        engine.stop()
    assert [c.tokens for c in sinks] == alone
    assert [c.end.usage.cached_tokens for c in sinks] == [0] + [len(prefix)] * 3
    # every prompt's last token is decoded, not prefilled
    assert computed == len(prompts[0]) - 1 + 3 * (len(prompts[1]) - len(prefix) - 1)

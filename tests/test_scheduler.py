"""Admission by what is held, growth, preemption and resumption, in the engine.

- A flood of requests whose max_tokens is far above what they say is
  admitted together under a budget that holds them as they really are.
- Under a budget too small for all of them, requests queue or are preempted
  (the most recently admitted first), and every one ends with the text it
  says alone; a preempted seeded request says the tokens it says alone.
- The bytes held never exceed the budget, nor the bound of what the
  sequences hold, after any step (measured inside the engine).
- The scheduler on its own: states, the order of admission and preemption.
"""

from __future__ import annotations

import logging
import re

import pytest
from kvq_testing.budget import WINDOWS_8BIT, spy_checks
from kvq_testing.events import Collector
from kvq_testing.scripted import save_scripted_model
from mlx_lm import load

from mlx_kvq.engine import (
    BudgetShare,
    Engine,
    EngineOptions,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    Ledger,
    LocalCoordinator,
    SamplingParams,
    Shape,
)
from mlx_kvq.engine.budget import Share, share_for
from mlx_kvq.engine.memory import DECODE_RESERVE, KVMemory
from mlx_kvq.engine.prompt_cache import PromptCache
from mlx_kvq.engine.prompts import chat_tokens
from mlx_kvq.engine.runner import choose_layout
from mlx_kvq.engine.scheduler import Limits, RequestStatus, Scheduler, Sequence
from mlx_kvq.engine.stops import StopMatcher
from mlx_kvq.plan import plan_kv

WAIT_S = 300
PIECES = [f"w{i:03d} " for i in range(90)]  # a 90-token answer, then EOS
ANSWER = "".join(PIECES)
N = 8


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path = save_scripted_model(
        tmp_path_factory.mktemp("sched") / "m", {"story": PIECES}, template="plain", arch="hybrid"
    )
    model, tokenizer = load(str(path))
    return model, tokenizer, plan_kv(model, WINDOWS_8BIT, batch=True)


def chat(tokenizer, i: int) -> list[int]:
    return chat_tokens(
        tokenizer, [{"role": "user", "content": f"Session {i:02d}: tell the story."}]
    )


def start(model, tokenizer, plan, budget, **options) -> Engine:
    engine = Engine(model, tokenizer, plan, WINDOWS_8BIT, EngineOptions(
        kv_cache_memory=budget, max_context=plan.max_context, **options))  # fmt: skip
    engine.start()
    assert engine.readiness.ready_event.wait(WAIT_S) and engine.readiness.ready
    return engine


def run(engine, prompts, **params) -> list[Collector]:
    sinks = []
    for p in prompts:
        c = Collector()
        engine.submit(GenerationRequest(p, SamplingParams(**params)), c)
        sinks.append(c)
    for c in sinks:
        c.wait()
    return sinks


def priced(plan, budget: int, step: int = 2048, block_size=EngineOptions().block_size) -> Share:
    """A share of `budget` priced as the engine lays the batch out (paged in
    blocks of `block_size`; None: padded rows)."""
    layout = choose_layout(plan, block_size)
    return share_for(
        plan, budget, prefill_step=step, prompt_rows=8, paged=layout.paged,
        block_size=layout.block_size or 0,
    )  # fmt: skip


def holds(
    plan, rows: int, prompt: int, total: int, prompting: int, step: int = 2048,
    block_size=EngineOptions().block_size,
) -> int:  # fmt: skip
    """The bound of `rows` sequences of `prompt` -> `total` tokens, `prompting`
    of them in their prompt (processed in chunks of `step` tokens)."""
    cost = priced(plan, 1, step, block_size).cost
    shapes = [Shape(prompt, total)] * rows
    return cost.bound(shapes, shapes[:prompting])


def test_a_flood_with_huge_max_tokens_is_admitted_together(scripted, monkeypatch):
    """Sixteen-chat style: max_tokens 32000, answers of 90 tokens; the budget
    holds the eight as they really are (their prompt and answer), nowhere near
    eight worst cases."""
    model, tokenizer, plan = scripted
    prompts = [chat(tokenizer, i) for i in range(N)]
    p = max(len(x) for x in prompts)
    budget = holds(plan, N, p, p + len(PIECES) + 2, N)
    measured = spy_checks(monkeypatch)
    engine = start(model, tokenizer, plan, budget, prompt_cache_size=0)
    try:
        sinks = run(engine, prompts, max_tokens=32_000)
    finally:
        engine.stop()
    for c in sinks:
        assert isinstance(c.end, FinishEvent) and c.end.reason == FinishReason.STOP
        assert c.text == ANSWER
    m = engine.metrics.snapshot()
    assert m.max_batch_size == N and m.preemptions == 0
    assert engine.budget.overruns == 0 and engine.budget.bound_misses == 0
    assert measured and all(live + pc <= budget and live <= bound for live, bound, pc in measured)


@pytest.mark.parametrize("cache_entries", [N, 0], ids=["kept-in-prompt-cache", "recomputed"])
def test_a_budget_too_small_preempts_and_every_text_is_unchanged(
    scripted, monkeypatch, caplog, cache_entries
):
    """Room for four sessions as they start, fewer whole ones: they are admitted
    by what they hold, the newest are preempted as the older ones grow, and
    each resumes where it stopped (from its cache kept in the prompt cache, or
    recomputing its tokens without one); every answer is the one it says alone."""
    model, tokenizer, plan = scripted
    prompts = [chat(tokenizer, i) for i in range(N)]
    p = max(len(x) for x in prompts)
    total = p + len(PIECES) + 2
    budget = holds(plan, 4, p, p + DECODE_RESERVE + 8, 4, step=8)  # four as they start
    whole = max(n for n in range(1, N) if holds(plan, n, p, total, 0, step=8) <= budget)
    assert whole < 4
    measured = spy_checks(monkeypatch)
    caplog.set_level(logging.INFO, logger="mlx_kvq.engine")
    engine = start(
        model, tokenizer, plan, budget, prompt_cache_size=cache_entries, prefill_step_size=8
    )
    try:
        sinks = run(engine, prompts, max_tokens=32_000)
    finally:
        engine.stop()
    for c in sinks:
        assert isinstance(c.end, FinishEvent) and c.end.reason == FinishReason.STOP
        assert c.text == ANSWER and c.end.usage.completion_tokens == len(PIECES) + 1
    m = engine.metrics.snapshot()
    assert m.preemptions > 0 and 0 < m.resumptions <= m.preemptions
    assert m.max_batch_size > whole  # admitted by what they held, not by their worst case
    assert engine.budget.overruns == 0 and engine.budget.bound_misses == 0
    assert measured and all(live + pc <= budget and live <= bound for live, bound, pc in measured)
    assert re.search(r"request \d+ preempted after \d+ tokens", caplog.text)
    resumed = [int(n) for n in re.findall(r"resumes after \d+ tokens \((\d+) of", caplog.text)]
    assert resumed and (all(n == 0 for n in resumed) if cache_entries == 0 else max(resumed) > 0)


class TwoRanks(LocalCoordinator):
    """A group of two in one process: the other rank holds a third of this one's budget."""

    def agree_budget(self, mine: BudgetShare):
        return [mine, BudgetShare(mine.budget // 3, mine.cost, mine.unquantized)], 0


def test_a_group_admits_and_preempts_by_its_smallest_rank(scripted):
    """This rank's budget holds all eight whole; the other rank's third does
    not: the group admits, grows and preempts by it, texts unchanged. Padded
    rows, whose growth steps make the third too small to finish without
    preempting (paged, admission alone keeps the group within it)."""
    model, tokenizer, plan = scripted
    prompts = [chat(tokenizer, i) for i in range(N)]
    p = max(len(x) for x in prompts)
    budget = holds(plan, N, p, p + len(PIECES) + 2, N, step=8, block_size=None)
    engine = Engine(model, tokenizer, plan, WINDOWS_8BIT, EngineOptions(
        kv_cache_memory=budget, max_context=plan.max_context, prefill_step_size=8,
        prompt_cache_size=N, block_size=None), coordinator=TwoRanks())  # fmt: skip
    engine.start()
    try:
        assert engine.readiness.ready_event.wait(WAIT_S) and engine.readiness.ready
        sinks = run(engine, prompts, max_tokens=32_000)
    finally:
        engine.stop()
    assert all(c.text == ANSWER for c in sinks)
    assert engine.metrics.snapshot().preemptions > 0
    assert engine.budget.overruns == 0 and engine.budget.bound_misses == 0


def test_a_preempted_seeded_request_says_what_it_says_alone(scripted, caplog):
    """Sampled with a seed at a temperature that makes the scripted model's
    text random: alone, then admitted last beside greedy sessions that outgrow
    the budget together (so it is preempted and resumes)."""
    model, tokenizer, plan = scripted
    no_eos = tuple((t, -1e9) for t in tokenizer.eos_token_ids)
    greedy = dict(max_tokens=80, logit_bias=no_eos)
    seeded = dict(max_tokens=80, logit_bias=no_eos, temperature=5.0, seed=1234)
    prompts = [chat(tokenizer, i) for i in range(4)]
    p = max(len(x) for x in prompts)
    budget = holds(plan, 4, p, p + DECODE_RESERVE + 8, 4, step=8)  # four as they start
    assert holds(plan, 4, p, p + 82, 0, step=8) > budget  # not as they end
    caplog.set_level(logging.INFO, logger="mlx_kvq.engine")
    engine = start(model, tokenizer, plan, budget, prompt_cache_size=8, prefill_step_size=8)
    try:
        (alone,) = run(engine, prompts[-1:], **seeded)
        engine.prompt_cache.trim_to(0)  # no cached answers: the flood starts afresh
        sinks = []
        for i, prompt in enumerate(prompts):
            c = Collector()
            request = GenerationRequest(prompt, SamplingParams(**(seeded if i == 3 else greedy)))
            c.request_id = request.id
            engine.submit(request, c)
            sinks.append(c)
        for c in sinks:
            c.wait()
    finally:
        engine.stop()
    assert f"request {sinks[-1].request_id} preempted" in caplog.text
    assert sinks[-1].tokens == alone.tokens and len(alone.tokens) == 80
    assert alone.text not in ANSWER  # sampled, not the script
    assert all(c.text == "".join(PIECES[:80]) for c in sinks[:3])
    assert engine.budget.overruns == 0


# ---------------------------------------------------------------- the scheduler alone
def sequence(prompt: int, max_tokens: int = 1000) -> Sequence:
    request = GenerationRequest(list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens))
    return Sequence(request, lambda e: None, None, StopMatcher(()), max_tokens)


def test_states_admission_order_and_vllm_preemption(scripted):
    """Admitted in order by what they hold; when the oldest cannot grow the
    newest is preempted and goes back to the head of the queue; alone and
    unable to grow, a sequence is exhausted."""
    _, _, plan = scripted
    budget = holds(plan, 3, 50, 50 + DECODE_RESERVE, 3, step=8)
    share = priced(plan, budget, 8)
    memory = KVMemory(Ledger([Share(budget, share.cost)]), PromptCache(0))
    scheduler = Scheduler(Limits(decode_rows=8, prompt_rows=8), memory)
    seqs = [sequence(50) for _ in range(4)]
    for s in seqs:
        scheduler.add(s)
    assert [s.status for s in seqs] == [RequestStatus.WAITING] * 4
    plan1 = scheduler.schedule()
    assert list(plan1.admitted) == seqs[:3]  # the fourth does not fit beside them
    assert seqs[3].status is RequestStatus.WAITING and list(scheduler.waiting) == [seqs[3]]
    for s in seqs[:3]:
        assert s.status is RequestStatus.PREFILLING
        scheduler.prompt_done(s)
        assert s.status is RequestStatus.RUNNING
    # the oldest outgrows its reserve: the newest running is preempted, first in the queue
    seqs[0].generated = [7] * 2 * DECODE_RESERVE
    plan2 = scheduler.schedule()
    assert list(plan2.preempted) == [seqs[2]] and not plan2.admitted
    assert seqs[2].status is RequestStatus.PREEMPTED and seqs[2].preemptions == 1
    assert list(scheduler.waiting) == [seqs[2], seqs[3]]
    # alone, a sequence that cannot grow any more is exhausted
    scheduler.finish(seqs[1])
    assert seqs[1].status is RequestStatus.FINISHED
    seqs[0].generated = [7] * 10_000
    plan3 = scheduler.schedule()
    assert list(plan3.exhausted) == [seqs[0]] and seqs[0].status is RequestStatus.FINISHED
    # then the preempted one resumes first, from its tokens so far
    assert plan3.admitted[0] is seqs[2] and seqs[2].status is RequestStatus.PREFILLING


def test_the_oldest_is_not_cut_for_memory_the_preempted_still_hold(scripted):
    """What a sequence preempted in this plan holds is freed only once
    it leaves the batch (a row in its prompt, after the next step). The oldest,
    alone then and still unable to grow, fits the budget alone: it is not
    exhausted but preempted too, and resumes first."""
    _, _, plan = scripted
    first, second = Shape(50, 50 + DECODE_RESERVE), Shape(50, 50 + DECODE_RESERVE)
    cost = priced(plan, 1, 8, block_size=None).cost
    budget = cost.bound([first, second], [second])
    memory = KVMemory(Ledger([Share(budget, cost)]), PromptCache(0))
    scheduler = Scheduler(Limits(decode_rows=8, prompt_rows=8), memory)
    oldest, newest = sequence(50), sequence(50)
    scheduler.add(oldest)
    assert list(scheduler.schedule().admitted) == [oldest]
    scheduler.prompt_done(oldest)
    scheduler.add(newest)
    assert list(scheduler.schedule().admitted) == [newest]  # still in its prompt
    oldest.generated = [7] * DECODE_RESERVE  # outgrows its reserve
    grown = Shape(50, 50 + 2 * DECODE_RESERVE + 1)
    assert cost.bound([grown], []) <= budget  # it fits alone
    plan1 = scheduler.schedule()
    assert not plan1.exhausted and list(plan1.preempted) == [newest, oldest]
    assert list(scheduler.waiting) == [oldest, newest]
    memory.ledger.settle()  # the step ran: the rows have left
    plan2 = scheduler.schedule()
    assert not plan2.exhausted and plan2.admitted[0] is oldest


def test_a_sequence_the_idle_engine_can_never_resume_is_exhausted(scripted):
    """Preempted long, it would resume through a prompt chunk that the budget
    cannot hold even alone: with nothing running to free memory, it ends
    (with length) instead of waiting forever."""
    _, _, plan = scripted
    budget = holds(plan, 1, 50, 50 + DECODE_RESERVE, 1, step=8)
    share = share_for(plan, budget, prefill_step=8, prompt_rows=8)
    scheduler = Scheduler(
        Limits(8, 8), KVMemory(Ledger([Share(budget, share.cost)]), PromptCache(0))
    )
    seq = sequence(50)
    seq.generated = [7] * 5000
    seq.preemptions = 1
    scheduler.add(seq)
    plan1 = scheduler.schedule()
    assert list(plan1.exhausted) == [seq] and not plan1.admitted
    assert seq.status is RequestStatus.FINISHED and not scheduler.busy

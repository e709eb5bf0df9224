"""Speculative decoding in the engine, in-process.

The model is a scripted hybrid (gemma3_text, windows of 16 tokens, 4-bit
KV caches); the draft model is the same script with one step changed, so it
proposes the wrong token there: drafts are accepted and rejected, and the
windows of both models wrap and rewind. Checked: the lane says the script
(what the batch says), the warm-up ran the lane, another request moves the
speculative sequence into the batch (while it decodes, or still prefills)
where it goes on with the same text, seeded requests never speculate,
cancelling frees the lane, the prompt cache reuses what the lane decoded, and every byte counts against the prompt-cache budget.
"""

from __future__ import annotations

import pytest
from kvq_testing.events import WAIT_S, Collector, wait_until
from kvq_testing.scripted import Reply, save_scripted_model
from mlx_lm import load

from mlx_kvq.config import KVConfig
from mlx_kvq.engine import (
    DraftModel,
    Engine,
    EngineOptions,
    ErrorEvent,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
)
from mlx_kvq.engine.prompts import chat_tokens
from mlx_kvq.plan import plan_kv
from mlx_kvq.speculative import check_speculation

PIECES = [f"w{i:02d} " for i in range(14)]
LOOP = Reply(["tick", "tock"], extra={("tock", "tick"): 25.0})  # never ends: holds the lane
SCRIPT = {"story": PIECES, "clock": LOOP}
# The draft says w07 after w04 (the model says w05): it is wrong there.
DRAFT_SCRIPT = {"story": Reply(PIECES, extra={("w04 ", "w07 "): 25.0}), "clock": LOOP}
ANSWER = "".join(PIECES)
FILLER = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 3
K = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    kv = KVConfig(bits=4, group_size=64)
    target_path = save_scripted_model(root / "model", SCRIPT, template="qwen3_keep_reasoning",
                                      arch="hybrid")  # fmt: skip
    draft_path = save_scripted_model(root / "draft", DRAFT_SCRIPT, template="qwen3_keep_reasoning",
                                     arch="hybrid")  # fmt: skip
    model, tokenizer = load(str(target_path))
    draft_model, draft_tokenizer = load(str(draft_path))
    plan = plan_kv(model, kv, batch=True)
    draft_plan = plan_kv(draft_model, kv)
    check_speculation(
        model, draft_model, plan.make_cache(), draft_plan.make_cache(),
        vocab=(tokenizer.vocab_size, draft_tokenizer.vocab_size),
    )  # fmt: skip
    return model, tokenizer, plan, kv, DraftModel(draft_model, draft_plan, "draft", K)


@pytest.fixture
def engine(models):
    model, tokenizer, plan, kv, draft = models
    eng = Engine(model, tokenizer, plan, kv,
                 EngineOptions(prompt_cache_size=8, prompt_cache_bytes=4_000_000,
                               max_context=plan.max_context),
                 draft=draft)  # fmt: skip
    eng.start()
    assert eng.readiness.ready_event.wait(WAIT_S) and eng.readiness.ready, eng.readiness.get()
    yield eng
    eng.stop()


def prompt(tokenizer, text=FILLER + " Tell the story.", history=()):
    messages = [*history, {"role": "user", "content": text}]
    return chat_tokens(tokenizer, messages)


def submit(engine, tokens, draft=K, **params):
    params.setdefault("max_tokens", 40)
    c = Collector()
    req = GenerationRequest(tokens, SamplingParams(**params), draft_tokens=draft)
    c.request_id = req.id
    engine.submit(req, c)
    return c


def test_lane_says_the_script_with_accepted_and_rejected_drafts(engine, models):
    tokenizer, plan = models[1], models[2]
    warm = engine.readiness.get().report["speculative"]
    assert warm["num_draft_tokens"] == K and warm["generated"] >= 4 * (K + 1)
    assert warm["prompt_tokens"] > plan.max_window
    for who in ("model", "draft"):
        assert all(s["quantized"] == s["slots"] for s in warm[who].values())

    tokens = prompt(tokenizer)
    assert len(tokens) > 2 * plan.max_window  # the windows wrap during the prompt
    c = submit(engine, tokens).wait()
    assert isinstance(c.end, FinishEvent), c.end
    assert c.text == ANSWER and c.end.reason.value == "stop"
    plain = submit(engine, tokens, draft=0).wait()
    assert plain.text == ANSWER
    s = engine.metrics.snapshot()
    assert s.draft_requests == {"speculative": 1}
    assert 0 < s.draft_tokens_accepted < s.draft_tokens_proposed


def test_another_request_moves_the_speculative_sequence_into_the_batch(engine, models):
    tokenizer = models[1]
    first = submit(engine, prompt(tokenizer, "The clock."), max_tokens=200)
    wait_until(lambda: len(first.tokens) >= 8, "speculative decoding to start")
    assert engine.runner.lane.busy
    others = [submit(engine, prompt(tokenizer, f"{FILLER} story {i}")) for i in range(2)]
    seeded = submit(engine, prompt(tokenizer), temperature=0.0, seed=7)
    for c in [first, *others, seeded]:
        c.wait()
        assert isinstance(c.end, FinishEvent), c.end
    # greedy: the moved sequence goes on in the batch with the same text
    assert first.text == "ticktock" * 100 and first.end.reason.value == "length"
    assert all(c.text == ANSWER for c in [*others, seeded])
    s = engine.metrics.snapshot()
    # the others started in the batch (the engine was busy; the seeded one never speculates)
    assert s.draft_requests == {"speculative": 1, "batch": 3}
    assert s.draft_requests_moved == 1
    assert not engine.runner.lane.busy


def test_a_request_with_logits_processors_is_decoded_in_the_batch(engine, models):
    """mlx-lm's speculative loop would show a penalty only the tokens since the
    cached prefix: such requests go to the batch even on an idle engine."""
    tokenizer = models[1]
    w05 = tokenizer.encode("w05 ")
    assert len(w05) == 1
    biased = submit(engine, prompt(tokenizer), logit_bias=((w05[0], -100.0),)).wait()
    assert isinstance(biased.end, FinishEvent), biased.end
    assert biased.text.startswith("".join(PIECES[:5])) and "w05" not in biased.text
    assert engine.metrics.snapshot().draft_requests == {"batch": 1}


def test_a_sequence_still_prefilling_moves_too(models):
    model, tokenizer, plan, kv, draft = models
    eng = Engine(model, tokenizer, plan, kv,
                 EngineOptions(prefill_step_size=32, max_context=plan.max_context),
                 draft=draft)  # fmt: skip
    eng.start()
    try:
        assert eng.readiness.ready_event.wait(WAIT_S) and eng.readiness.ready
        tokens = prompt(tokenizer, FILLER * 10 + " Tell the story.")
        first = submit(eng, tokens)
        wait_until(lambda: eng.runner.lane.busy, "speculative decoding to start")
        second = submit(eng, prompt(tokenizer), draft=0)
        for c in (first, second):
            c.wait()
            assert isinstance(c.end, FinishEvent) and c.text == ANSWER, c.end
        s = eng.metrics.snapshot()
        assert s.draft_requests_moved == 1 and s.draft_tokens_proposed == 0
    finally:
        eng.stop()


def test_cancel_frees_the_lane_and_the_next_turn_reuses_the_lane_answer(engine, models):
    tokenizer = models[1]
    tokens = prompt(tokenizer)
    doomed = submit(engine, prompt(tokenizer, "The clock."), max_tokens=300)
    wait_until(lambda: doomed.first_token.is_set(), "the first token")
    engine.cancel(doomed.request_id)
    wait_until(lambda: not engine.runner.lane.busy, "the lane to be freed")

    first = submit(engine, tokens).wait()
    history = [
        {"role": "user", "content": FILLER + " Tell the story."},
        {"role": "assistant", "content": first.text},
    ]
    second_tokens = prompt(tokenizer, "Again, the story.", history)
    assert second_tokens[: len(tokens) + len(first.tokens) - 1] == tokens + first.tokens[:-1]
    second = submit(engine, second_tokens).wait()
    assert second.text == ANSWER
    # the lane's cache holds the prompt and the answer (its final EOS when drafted)
    assert second.end.usage.cached_tokens >= len(tokens) + len(first.tokens) - 1
    assert engine.prompt_cache.nbytes <= 4_000_000


def test_the_lane_counts_against_the_kv_budget(models, monkeypatch):
    """Under a KV budget a speculative sequence reserves its draft model's
    caches too, and what the lane holds (both models) is measured with the
    batch: neither the budget nor the bound is exceeded, before and after the
    sequence moves into the batch."""
    from mlx_kvq.engine import Ledger

    model, tokenizer, plan, kv, draft = models
    budget = 3_000_000
    measured = []
    check = Ledger.check

    def spy(self, live, prompt_cache):
        measured.append((live, self.reserved(), prompt_cache, sum(self.extras.values())))
        return check(self, live, prompt_cache)

    monkeypatch.setattr(Ledger, "check", spy)
    eng = Engine(model, tokenizer, plan, kv,
                 EngineOptions(prompt_cache_size=8, kv_cache_memory=budget,
                               max_context=plan.max_context),
                 draft=draft)  # fmt: skip
    eng.start()
    try:
        assert eng.readiness.ready_event.wait(WAIT_S) and eng.readiness.ready
        first = submit(eng, prompt(tokenizer, "The clock."), max_tokens=120)
        wait_until(lambda: len(first.tokens) >= 8, "speculative decoding to start")
        other = submit(eng, prompt(tokenizer, f"{FILLER} story 1"))
        for c in (first, other):
            c.wait()
            assert isinstance(c.end, FinishEvent), c.end
        assert other.text == ANSWER
    finally:
        eng.stop()
    s = eng.metrics.snapshot()
    assert s.draft_requests == {"speculative": 1, "batch": 1} and s.draft_requests_moved == 1
    ledger = eng.budget
    assert ledger.overruns == 0 and ledger.bound_misses == 0 and not ledger.extras
    on_lane = [m for m in measured if m[3] > 0]
    assert on_lane and max(live for live, *_ in on_lane) > 0  # the lane's bytes were counted
    for live, reserved, prompt_cache, _ in measured:
        assert live <= reserved and live + prompt_cache <= budget


def test_a_failed_move_fails_the_lane_request_alone(models, monkeypatch):
    """When the lane's sequence cannot move into the batch, its own request
    gets the error and frees its reservation; the request that arrived runs."""
    model, tokenizer, plan, kv, draft = models
    eng = Engine(model, tokenizer, plan, kv,
                 EngineOptions(kv_cache_memory=3_000_000, max_context=plan.max_context),
                 draft=draft)  # fmt: skip
    eng.start()
    try:
        assert eng.readiness.ready_event.wait(WAIT_S) and eng.readiness.ready
        first = submit(eng, prompt(tokenizer, "The clock."), max_tokens=120)
        wait_until(lambda: len(first.tokens) >= 8, "speculative decoding to start")

        def broken(*args, **kw):
            raise RuntimeError("the move failed")

        monkeypatch.setattr(eng.runner.lane, "take", broken)
        other = submit(eng, prompt(tokenizer, f"{FILLER} story 1"), draft=0)
        assert isinstance(other.wait().end, FinishEvent), other.end
        assert other.text == ANSWER
        assert isinstance(first.wait().end, ErrorEvent) and "the move failed" in first.end.message
        assert not eng.runner.lane.busy and not eng.budget.shapes and not eng.budget.extras
    finally:
        eng.stop()

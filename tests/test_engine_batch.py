"""The engine in-process on a tiny hybrid model (sliding + full layers, quantized).

Covers batching of concurrent requests, cancellation releasing cache memory,
stop strings, prompt-cache reuse of a conversation, seeded sampling, and an
engine failure turning /health to 503 with the reason.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest
from kvq_testing.events import WAIT_S, Collector, wait_until
from kvq_testing.tiny import save_tiny_model
from mlx_lm import load

from mlx_kvq.config import KVConfig
from mlx_kvq.engine import (
    Engine,
    EngineOptions,
    ErrorEvent,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    Segment,
    TokenEvent,
)
from mlx_kvq.plan import plan_kv


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("engine") / "m", "llama:sliding")
    model, tokenizer = load(str(path))
    kv = KVConfig(bits=4, group_size=64)
    return model, tokenizer, plan_kv(model, kv, batch=True), kv


@pytest.fixture(scope="module")
def engine(loaded):
    model, tokenizer, plan, kv = loaded
    eng = Engine(
        model, tokenizer, plan, kv, EngineOptions(prompt_cache_size=8, max_context=plan.max_context)
    )
    eng.start()
    assert eng.readiness.ready_event.wait(WAIT_S)
    assert eng.readiness.ready, eng.readiness.get()
    yield eng
    eng.stop()


def submit(engine, prompt, **params):
    params.setdefault("max_tokens", 8)
    c = Collector()
    req = GenerationRequest(list(prompt), SamplingParams(**params))
    c.request_id = req.id
    engine.submit(req, c)
    return c


def test_warmup_report_shows_quantized_sliding_and_full(engine):
    report = engine.readiness.get().report
    for where in ("batch", "extracted"):
        for kind in ("sliding", "full"):
            s = report[where][kind]
            assert s["quantized"] == s["slots"] > 0
    assert report["sequence_tokens"] > engine.plan.max_window


def test_concurrent_requests_share_the_batch(engine, loaded):
    tokenizer = loaded[1]
    prompts = [tokenizer.encode(f"Request number {i} says hello") for i in range(6)]
    collectors = [submit(engine, p, max_tokens=12) for p in prompts]
    for p, c in zip(prompts, collectors, strict=True):
        c.wait()
        assert isinstance(c.end, FinishEvent), c.end
        assert c.end.usage.prompt_tokens == len(p)
        assert c.end.usage.completion_tokens == len(c.tokens)
        if c.end.reason == "length":
            assert len(c.tokens) == 12
    assert engine.metrics.snapshot().max_batch_size >= 2
    wait_until(lambda: engine.metrics.snapshot().batch_size == 0, "an idle batch")
    assert sum(engine.metrics.snapshot().kv_bytes_by_kind.values()) == 0


def test_cancel_removes_the_sequence_and_releases_its_cache(engine, loaded):
    tokenizer = loaded[1]
    before = engine.metrics.snapshot().requests.get("cancelled", 0)
    c = submit(engine, tokenizer.encode("a long story please"), max_tokens=400)
    assert c.first_token.wait(WAIT_S)
    wait_until(lambda: sum(engine.metrics.snapshot().kv_bytes_by_kind.values()) > 0, "KV held")
    engine.cancel(c.request_id)
    wait_until(
        lambda: engine.metrics.snapshot().requests.get("cancelled", 0) == before + 1,
        "the cancellation",
    )
    wait_until(lambda: sum(engine.metrics.snapshot().kv_bytes_by_kind.values()) == 0, "no KV")
    assert engine.metrics.snapshot().batch_size == 0
    assert not c.done.is_set()  # a cancelled request gets no more events
    ok = submit(engine, tokenizer.encode("after the cancel"), max_tokens=4).wait()
    assert isinstance(ok.end, FinishEvent)


def test_stop_string_ends_the_sequence_and_keeps_its_cache(engine, loaded):
    tokenizer = loaded[1]
    prompt = tokenizer.encode("Tell me a story about the river")
    free = submit(engine, prompt, max_tokens=16).wait()
    pieces = [e.text for e in free.events if isinstance(e, TokenEvent) and e.text.strip()]
    stop = pieces[len(pieces) // 2]
    expected = free.text[: free.text.find(stop)]
    stopped = submit(engine, prompt, max_tokens=16, stop=(stop,)).wait()
    assert stopped.end.reason == "stop"
    assert stopped.text == expected
    assert stop not in stopped.text
    assert stopped.end.usage.completion_tokens == len(stopped.tokens) <= 16


def test_conversation_reuses_the_cached_prefix(engine, loaded):
    tokenizer = loaded[1]
    turn1 = tokenizer.encode("System: be brief. User: hi there, how are you?")
    first = submit(engine, turn1, max_tokens=6).wait()
    turn2 = turn1 + first.tokens + tokenizer.encode(" User: and tomorrow?")
    second = submit(engine, turn2, max_tokens=6).wait()
    # the first answer ended by its limit: no step ran past its last token, so
    # the cache holds all of the turn but that token's K/V
    assert first.end.reason == "length"
    assert second.end.usage.cached_tokens == len(turn1) + len(first.tokens) - 1
    assert second.end.usage.prompt_tokens == len(turn2)
    stats = engine.prompt_cache.stats()
    assert stats.hits >= 1 and stats.nbytes > 0


def test_seeded_sampling_is_reproducible_in_any_batch(engine, loaded):
    tokenizer = loaded[1]
    prompt = tokenizer.encode("Pick some random words")
    alone = submit(engine, prompt, max_tokens=10, temperature=1.0, seed=7).wait()
    crowd = [submit(engine, tokenizer.encode(f"noise {i}"), max_tokens=10, temperature=1.0)
             for i in range(3)]  # fmt: skip
    again = submit(engine, prompt, max_tokens=10, temperature=1.0, seed=7).wait()
    for c in crowd:
        c.wait()
    assert alone.tokens == again.tokens


def test_too_long_prompt_is_refused(engine):
    c = submit(engine, [5] * (engine.max_context + 1)).wait()
    assert isinstance(c.end, ErrorEvent) and c.end.status == 400


def test_a_failing_sampler_fails_only_its_request(engine, loaded, monkeypatch):
    """A sampler that raises mid-decode ends its own request; the batch decodes on."""
    import mlx_kvq.engine.sampling as sampling

    tokenizer = loaded[1]
    prompts = [tokenizer.encode(f"Story {i} about the old bridge") for i in range(3)]
    expected = [submit(engine, p, max_tokens=24).wait().tokens for p in prompts]
    real = sampling.make_sampler
    calls = []

    def make_sampler(temp, **kw):
        if temp != 0.77:
            return real(temp=temp, **kw)

        def sampler(logprobs):
            calls.append(1)
            if len(calls) > 3:
                raise RuntimeError("sampler exploded")
            return mx.argmax(logprobs, axis=-1)

        return sampler

    monkeypatch.setattr(sampling, "make_sampler", make_sampler)
    before = engine.metrics.snapshot().requests.get("error", 0)
    others = [submit(engine, p, max_tokens=24) for p in prompts]
    bad = submit(engine, tokenizer.encode("this one breaks"), max_tokens=24, temperature=0.77)
    for c in [bad, *others]:
        c.wait()
    assert isinstance(bad.end, ErrorEvent) and "sampler exploded" in bad.end.message
    assert 0 < len(bad.tokens) < 24
    for c, want in zip(others, expected, strict=True):
        assert isinstance(c.end, FinishEvent), c.end
        assert c.tokens == want
    assert engine.metrics.snapshot().requests.get("error", 0) == before + 1
    assert engine.alive and engine.readiness.ready
    wait_until(lambda: sum(engine.metrics.snapshot().kv_bytes_by_kind.values()) == 0, "no KV")


def test_values_the_sampler_cannot_take_fail_alone(engine, loaded):
    """Settings that reach the engine unchecked fail their request, not the engine;
    a top_k at or above the vocabulary keeps every token (no top-k)."""
    tokenizer = loaded[1]
    prompt = tokenizer.encode("Pick some random words")
    bad_seed = submit(engine, prompt, temperature=0.7, seed=2**64).wait()
    assert isinstance(bad_seed.end, ErrorEvent) and bad_seed.end.status == 500
    wide = submit(engine, prompt, max_tokens=10, temperature=0.7, seed=3, top_k=10**6).wait()
    plain = submit(engine, prompt, max_tokens=10, temperature=0.7, seed=3).wait()
    assert isinstance(wide.end, FinishEvent) and wide.tokens == plain.tokens
    shared = submit(engine, prompt, max_tokens=4, temperature=0.7, top_k=10**6).wait()
    assert isinstance(shared.end, FinishEvent)
    assert engine.alive and engine.readiness.ready


class ExplodingModel:
    """Wraps a model; raises inside the forward pass once armed."""

    def __init__(self, model):
        self._model = model
        self.armed = False

    def __call__(self, *args, **kwargs):
        if self.armed:
            raise RuntimeError("simulated accelerator fault")
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_engine_failure_is_reported_by_health(loaded):
    from fastapi.testclient import TestClient

    from mlx_kvq.server.app import create_app
    from mlx_kvq.server.settings import ServerSettings

    model, tokenizer, plan, kv = loaded
    boom = ExplodingModel(model)
    eng = Engine(boom, tokenizer, plan, kv, EngineOptions())
    app = create_app(eng, ServerSettings(model_id="tiny", plan=plan.to_dict()))
    client = TestClient(app, base_url="http://127.0.0.1")
    eng.start()
    assert eng.readiness.ready_event.wait(WAIT_S)
    assert client.get("/health").status_code == 200
    boom.armed = True
    failed = submit(eng, tokenizer.encode("this will fail")).wait()
    assert isinstance(failed.end, ErrorEvent) and failed.end.status == 503
    r = client.get("/health")
    assert r.status_code == 503
    assert r.json()["status"] == "failed"
    assert "simulated accelerator fault" in r.json()["reason"]
    assert client.get("/live").status_code == 200
    late = submit(eng, tokenizer.encode("after the failure")).wait()
    assert isinstance(late.end, ErrorEvent) and late.end.status == 503
    mx.clear_cache()


def test_requests_queued_during_a_failed_warmup_get_an_error(loaded, tmp_path):
    model, tokenizer, plan, kv = loaded
    boom = ExplodingModel(model)
    boom.armed = True
    gate = tmp_path / "gate"
    eng = Engine(boom, tokenizer, plan, kv, EngineOptions(warmup_gate=str(gate)))
    eng.start()
    early = submit(eng, tokenizer.encode("queued before the warm-up"))
    assert eng.readiness.get().status == "warming_up"
    gate.touch()
    early.wait()
    assert isinstance(early.end, ErrorEvent) and early.end.status == 503
    state = eng.readiness.get()
    assert state.status == "failed" and "simulated accelerator fault" in state.reason
    eng.stop()


def test_the_warm_up_runs_while_the_tokenizer_is_still_loading(loaded, engine, caplog):
    """`serve` loads the tokenizer beside the warm-up: an engine made without
    one warms up on token ids alone, stays warming up until it is attached,
    then answers as the engine that had it from the start. One stopped while
    waiting for it ends."""
    model, tokenizer, plan, kv = loaded
    prompt = tokenizer.encode("the river runs under the bridge")
    expected = submit(engine, prompt, max_tokens=6).wait().tokens

    def warm_ups() -> int:
        return sum("warm-up done" in r.getMessage() for r in caplog.records)

    options = EngineOptions(prompt_cache_size=8, max_context=plan.max_context)
    with caplog.at_level(logging.INFO, logger="mlx_kvq.engine"):
        eng = Engine(model, None, plan, kv, options)
        eng.start()
        try:
            wait_until(lambda: warm_ups() == 1, "the warm-up without a tokenizer")
            assert eng.readiness.get().status == "warming_up"
            eng.attach(tokenizer)
            assert eng.readiness.ready_event.wait(WAIT_S) and eng.readiness.ready
            assert submit(eng, prompt, max_tokens=6).wait().tokens == expected
            with pytest.raises(RuntimeError, match="already"):
                eng.attach(tokenizer)
        finally:
            eng.stop()
        waiting = Engine(model, None, plan, kv, options)
        waiting.start()
        wait_until(lambda: warm_ups() == 2, "the second warm-up")
        waiting.stop()
        assert not waiting.alive and waiting.readiness.get().status != "ready"


@pytest.mark.parametrize(
    "kv",
    [
        KVConfig(bits=4, max_kv_size=32),
        KVConfig(),
        KVConfig(key_bits=8, value_bits=4),
        KVConfig(bits=3, window_bits=8, rotation="hadamard"),
    ],
    ids=["max-kv-size", "unquantized", "split-bits", "window-bits"],
)
def test_other_kv_settings_warm_up_and_serve(loaded, kv):
    model, tokenizer = loaded[0], loaded[1]
    plan = plan_kv(model, kv, batch=True)
    eng = Engine(model, tokenizer, plan, kv, EngineOptions(max_context=plan.max_context))
    eng.start()
    try:
        assert eng.readiness.ready_event.wait(WAIT_S)
        state = eng.readiness.get()
        assert state.status == "ready", state.reason
        assert state.report["sequence_tokens"] > (plan.max_window or 0)
        if kv.window_bits is not None:  # each kind warmed up at its own width
            widths = {(p.kind, p.window is not None, p.key_spec.bits) for p in plan.kv_layers}
            assert (True, 8) in {(b, w) for _, b, w in widths}
            assert (False, 3) in {(b, w) for _, b, w in widths}
            batch = state.report["batch"]
            assert all(k["quantized"] == k["slots"] for k in batch.values())
        long_prompt = tokenizer.encode(" ".join(["river bridge mountain"] * 20))
        assert len(long_prompt) > 32
        c = submit(eng, long_prompt, max_tokens=8).wait()
        assert isinstance(c.end, FinishEvent)
        assert c.end.usage.completion_tokens == len(c.tokens)
    finally:
        eng.stop()


@pytest.mark.parametrize("block_size", [16, None])  # paged and padded rows
def test_prompts_of_different_lengths_are_prefilled_without_padding(loaded, block_size, tmp_path):
    """A long prompt and a short one admitted in the same step: the step gives
    both the short one's tokens (mlx-lm right-pads a step's chunks to the
    longest, computing the padding), then the long one goes on alone; each
    answer is the one it gets alone."""
    model, tokenizer, plan, kv = loaded
    long, short = list(range(3, 303)), list(range(40, 60))
    options = dict(prompt_cache_size=0, max_context=plan.max_context, prefill_step_size=128,
                   block_size=block_size)  # fmt: skip
    eng = Engine(model, tokenizer, plan, kv, EngineOptions(**options))
    eng.start()
    alone = [submit(eng, p, max_tokens=4).wait().tokens for p in (long, short)]
    eng.stop()
    calls = []
    inner = type(model).__call__

    def recording(self, inputs, *args, **kwargs):
        calls.append(tuple(inputs.shape))
        return inner(self, inputs, *args, **kwargs)

    gate = tmp_path / "gate"
    eng = Engine(model, tokenizer, plan, kv, EngineOptions(**options, warmup_gate=str(gate)))
    eng.start()
    both = [submit(eng, p, max_tokens=4) for p in (long, short)]  # queued: admitted together
    type(model).__call__ = recording
    try:
        gate.touch()
        assert [c.wait().tokens for c in both] == alone
    finally:
        type(model).__call__ = inner
        eng.stop()
    # both take the short one's tokens but its last (it starts decoding); the
    # warm-up's own calls are shorter, and nothing with both rows is wider
    assert (2, len(short) - 1) in calls, calls
    assert max(n for rows, n in calls if rows == 2) == len(short) - 1, calls
    assert (1, 128) in calls  # the long one's next chunks, alone


def test_the_answer_finishes_before_its_cache_is_stored(engine, loaded, monkeypatch):
    """The finish event goes out first: storing the cache waits for the batch's
    step ahead, which the answer does not need."""
    tokenizer = loaded[1]
    c = Collector()
    seen_at_store = []
    store = type(engine.memory).store_prompt

    def recording(self, tokens, cache, segment=Segment.ANSWER):
        if segment is Segment.ANSWER:
            seen_at_store.append(c.done.is_set())
        return store(self, tokens, cache, segment)

    monkeypatch.setattr(type(engine.memory), "store_prompt", recording)
    req = GenerationRequest(
        tokenizer.encode("Store me after the answer"), SamplingParams(max_tokens=3)
    )
    engine.submit(req, c)
    c.wait()
    assert isinstance(c.end, FinishEvent)
    wait_until(lambda: seen_at_store, "the answer's cache stored")
    assert seen_at_store == [True]

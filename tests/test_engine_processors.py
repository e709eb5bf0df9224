"""Per-request logits processors and samplers inside the engine's batch.

A scripted model (kvq_testing.scripted) loops `ticktock...` unless a penalty,
a bias or XTC lets it say `done`; requests with different settings run in
one batch and each gets what mlx-lm's own `generate` with the same
processors says. A processor that raises fails its own request only; a
grammar (`response_format`) constrains the answer; prompt progress reaches
only requests that asked for it.
"""

from __future__ import annotations

import logging

import pytest
from kvq_testing.events import WAIT_S, Collector
from kvq_testing.scripted import Reply, save_scripted_model, token_id
from mlx_lm import generate, load
from mlx_lm.sample_utils import make_logits_processors

import mlx_kvq.engine.processors as processors
import mlx_kvq.engine.sampling as sampling
from mlx_kvq.config import KVConfig
from mlx_kvq.engine import (
    Engine,
    EngineOptions,
    ErrorEvent,
    FinishEvent,
    GenerationRequest,
    PromptProgress,
    SamplingParams,
)
from mlx_kvq.engine.processors import json_grammar
from mlx_kvq.plan import plan_kv

MAX_TOKENS = 12
SCRIPT = {
    "capital": ["Paris is the capital of France."],
    "jason": ["{", '"city"', ": ", '"Paris"', "}"],
    "clock": Reply(["tick", "tock", "done"], extra={("tock", "tick"): 20.5}),
}
LOOP = "ticktock" * (MAX_TOKENS // 2)
# settings -> what the clock says (tick 20.5 against done 20 after tock)
LOOP_BREAKS = {
    "none": ({}, LOOP),
    "repetition": ({"repetition_penalty": 1.1}, "ticktockdone"),
    "repetition, context 1": ({"repetition_penalty": 1.1, "repetition_context_size": 1}, LOOP),
    "presence": ({"presence_penalty": 1.0}, "ticktockdone"),
    "presence, context 1": ({"presence_penalty": 1.0, "presence_context_size": 1}, LOOP),
    "frequency": ({"frequency_penalty": 0.2}, "ticktock" * 3 + "done"),
    "frequency, context 4": ({"frequency_penalty": 0.2, "frequency_context_size": 4}, LOOP),
    "bias": ({"logit_bias": {"done": 1.0}}, "ticktockdone"),
}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = save_scripted_model(tmp_path_factory.mktemp("processors") / "m", SCRIPT)
    model, tokenizer = load(str(path))
    return path, model, tokenizer


@pytest.fixture(scope="module")
def engine(loaded):
    _, model, tokenizer = loaded
    kv = KVConfig(bits=4, group_size=64)
    options = EngineOptions(prefill_step_size=32)  # several prefill steps for progress events
    eng = Engine(model, tokenizer, plan_kv(model, kv, batch=True), kv, options)
    eng.start()
    assert eng.readiness.ready_event.wait(WAIT_S) and eng.readiness.ready
    yield eng
    eng.stop()


def prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def params(path, settings: dict, **kw) -> SamplingParams:
    settings = dict(settings)
    if "logit_bias" in settings:
        settings["logit_bias"] = tuple(
            (token_id(path, p), b) for p, b in settings["logit_bias"].items()
        )
    return SamplingParams(max_tokens=kw.pop("max_tokens", MAX_TOKENS), **settings, **kw)


def submit(engine, tokens, p: SamplingParams, progress: bool = False) -> Collector:
    c = Collector()
    engine.submit(GenerationRequest(tokens, p, progress=progress), c)
    return c


def test_penalties_and_bias_per_request_in_one_batch(engine, loaded):
    """Each request of one batch gets the text mlx-lm's generate gives with its processors."""
    path, model, tokenizer = loaded
    tokens = prompt(tokenizer, "What does the clock say?")
    for settings, want in LOOP_BREAKS.values():
        kw = dict(settings)
        if "logit_bias" in kw:
            kw["logit_bias"] = {token_id(path, p): b for p, b in kw["logit_bias"].items()}
        reference = generate(model, tokenizer, tokens, max_tokens=MAX_TOKENS,
                             logits_processors=make_logits_processors(**kw))  # fmt: skip
        assert reference == want
    runs = {name: submit(engine, tokens, params(path, s)) for name, (s, _) in LOOP_BREAKS.items()}
    for name, c in runs.items():
        assert isinstance(c.wait().end, FinishEvent), (name, c.end)
        assert c.text == LOOP_BREAKS[name][1], name
    assert engine.metrics.snapshot().max_batch_size >= 2  # they shared a batch


def test_xtc_cuts_the_top_choice_with_its_own_key_chain(engine, loaded):
    """XTC (probability 1, threshold 0.1) removes tick (p 0.62) in favour of done
    (p 0.38), seeded or not; at temperature 0.02 sampling alone says tick
    (done's chance is e**-25)."""
    path, _, tokenizer = loaded
    tokens = prompt(tokenizer, "What does the clock say?")
    xtc = {"xtc_probability": 1.0, "xtc_threshold": 0.1}
    high = {"xtc_probability": 1.0, "xtc_threshold": 0.5}  # only tick is above 0.5: no cut
    runs = [
        submit(engine, tokens, params(path, xtc, temperature=0.02)),
        submit(engine, tokens, params(path, xtc, temperature=0.02, seed=5)),
        submit(engine, tokens, params(path, xtc, temperature=0.02, seed=5)),
        submit(engine, tokens, params(path, high, temperature=0.02, seed=6)),
        submit(engine, tokens, params(path, xtc)),  # greedy: XTC is a sampling method
    ]
    texts = [c.wait().text for c in runs]
    assert texts == ["ticktockdone", "ticktockdone", "ticktockdone", LOOP, LOOP]


def test_a_failing_processor_fails_only_its_request(engine, loaded, monkeypatch):
    path, _, tokenizer = loaded
    tokens = prompt(tokenizer, "What does the clock say?")
    real = processors.make_logits_processors
    calls = []

    def make(*args):
        out = real(*args)
        if args[2] == 7:  # repetition_context_size 7 marks the request that breaks

            def explode(context, logits):
                calls.append(1)
                if len(calls) > 3:
                    raise RuntimeError("processor exploded")
                return logits

            out.append(explode)
        return out

    monkeypatch.setattr(processors, "make_logits_processors", make)
    before = engine.metrics.snapshot().requests.get("error", 0)
    others = [submit(engine, tokens, params(path, s)) for s, _ in LOOP_BREAKS.values()]
    bad = submit(engine, tokens, params(path, {"repetition_context_size": 7}))
    for c in [bad, *others]:
        c.wait()
    assert isinstance(bad.end, ErrorEvent) and "processor exploded" in bad.end.message
    assert 0 < len(bad.text) < len(LOOP)
    assert [c.text for c in others] == [want for _, want in LOOP_BREAKS.values()]
    assert engine.metrics.snapshot().requests.get("error", 0) == before + 1
    assert engine.alive and engine.readiness.ready


def counting_sampler(monkeypatch, raise_at: int | None = None) -> list:
    """Make every sampler count its draws (the list returned), raising at draw `raise_at`."""
    real = sampling.make_sampler
    calls: list = []

    def make(**kw):
        inner = real(**kw)

        def sample(logprobs):
            calls.append(1)
            if len(calls) == raise_at:
                raise RuntimeError("sampler exploded")
            return inner(logprobs)

        return sample

    monkeypatch.setattr(sampling, "make_sampler", make)
    return calls


def test_a_sampler_error_after_the_last_token_fails_no_later_request(engine, loaded, monkeypatch):
    """The batch samples one token ahead, unless every row ends by its limit:
    a shared sampler that raises while drawing the unused token after a
    request's last one (a stop string ends it, which the batch cannot know)
    must not fail the next request with the same settings."""
    path, _, tokenizer = loaded
    calls = counting_sampler(monkeypatch, raise_at=3)
    tokens = prompt(tokenizer, "What does the clock say?")
    first = submit(engine, tokens, params(path, {}, temperature=0.013, stop=("tock",)))
    assert isinstance(first.wait().end, FinishEvent) and first.text == "tick"
    assert first.end.reason.value == "stop" and len(calls) == 3
    second = submit(engine, tokens, params(path, {}, temperature=0.013))
    assert isinstance(second.wait().end, FinishEvent), second.end
    assert second.text == LOOP


def test_rows_ending_by_their_limit_draw_nothing_ahead(engine, loaded, monkeypatch):
    """When every row of the batch ends with the current token by its
    `max_tokens`, no step is computed past it (a forward nobody would use,
    which the next request would wait behind): one draw per token."""
    path, _, tokenizer = loaded
    calls = counting_sampler(monkeypatch)
    tokens = prompt(tokenizer, "What does the clock say?")
    # a temperature no other test uses: the engine keeps one sampler per setting
    done = submit(engine, tokens, params(path, {}, temperature=0.017, max_tokens=2)).wait()
    assert done.text == "ticktock" and done.end.reason.value == "length"
    assert len(calls) == 2


def test_grammars_constrain_the_answer(engine, loaded):
    path, _, tokenizer = loaded
    free = submit(engine, prompt(tokenizer, "The capital?"), params(path, {}))
    enum = json_grammar({"type": "string", "enum": ["yes", "no"]})
    forced = submit(engine, prompt(tokenizer, "The capital?"), params(path, {}, grammar=enum))
    any_object = json_grammar(None)
    scripted_json = submit(engine, prompt(tokenizer, "jason"), params(path, {}, grammar=any_object))
    assert free.wait().text == "Paris is the capital of France."
    # the model's own choice is not JSON: among the allowed tokens (logit 0 each)
    # greedy takes the lowest id, and the grammar closes the string
    assert forced.wait().text == '"no"' and forced.end.reason.value == "stop"
    assert scripted_json.wait().text == '{"city": "Paris"}'


def test_the_engine_is_ready_before_llguidance_reads_the_vocabulary(loaded, caplog):
    """Reading the vocabulary holds the GIL for seconds: it waits for the
    first request with a grammar, not for readiness, and requests without
    one never start it."""
    path, model, tokenizer = loaded

    def reads() -> int:
        return sum("llguidance read the vocabulary" in r.getMessage() for r in caplog.records)

    kv = KVConfig(bits=4, group_size=64)
    with caplog.at_level(logging.DEBUG, logger="mlx_kvq.engine"):
        eng = Engine(model, tokenizer, plan_kv(model, kv, batch=True), kv, EngineOptions())
        eng.start()
        try:
            assert eng.readiness.ready_event.wait(WAIT_S) and eng.readiness.ready
            plain = submit(eng, prompt(tokenizer, "The capital?"), params(path, {}))
            assert plain.wait().text == "Paris is the capital of France."
            assert reads() == 0
            enum = json_grammar({"type": "string", "enum": ["yes", "no"]})
            forced = submit(eng, prompt(tokenizer, "The capital?"), params(path, {}, grammar=enum))
            assert forced.wait().text == '"no"'
            assert reads() == 1
        finally:
            eng.stop()


def test_an_impossible_grammar_fails_only_its_request(engine, loaded):
    path, _, tokenizer = loaded
    assert engine.grammars.check("not a grammar {") is not None
    bad = submit(
        engine, prompt(tokenizer, "The capital?"), params(path, {}, grammar="not a grammar {")
    )
    ok = submit(engine, prompt(tokenizer, "The capital?"), params(path, {}))
    assert isinstance(bad.wait().end, ErrorEvent)
    assert ok.wait().text == "Paris is the capital of France."


def test_prompt_progress_only_when_asked(engine, loaded):
    path, _, tokenizer = loaded
    tokens = prompt(tokenizer, "The capital? " + "Lorem ipsum dolor sit amet. " * 12)
    asked = submit(engine, tokens, params(path, {}), progress=True)
    quiet = submit(
        engine, prompt(tokenizer, "The capital? " + "Sed do eiusmod. " * 20), params(path, {})
    )
    progress = [
        (e.processed, e.total) for e in asked.wait().events if isinstance(e, PromptProgress)
    ]
    assert len(progress) >= 3  # 32-token prefill steps
    assert progress == sorted(progress) and progress[-1][0] == progress[-1][1]
    assert len(tokens) - 32 < progress[-1][1] <= len(tokens)  # less what the prompt cache held
    assert not [e for e in quiet.wait().events if isinstance(e, PromptProgress)]
    assert quiet.text == asked.text == "Paris is the capital of France."


def test_grammars_read_the_vocabulary_when_started_or_first_needed(loaded):
    """llguidance's reading of the vocabulary holds the GIL, so the server
    leaves it to the first request that needs it: a first use starts it, and
    starting twice (`start`) is one read."""
    _, _, tokenizer = loaded
    started = processors.Grammars(tokenizer)
    started.start()
    started.start()
    assert started.available and started.check(json_grammar(None)) is None
    unstarted = processors.Grammars(tokenizer)
    assert unstarted.check("not a grammar {") is not None

"""The last four architectures: sparse-attention indexers and deepseek_v41.

deepseek_v32 and glm_moe_dsa (DeepSeek sparse attention over latent
attention), minimax_m3_vl (block-sparse attention) keep their indexer's keys
in a second cache that the model code touches directly; deepseek_v41 keeps
its own `LayerCache` (window, compressed rows, index keys). On their tiny
float32 configurations (`kvq_testing.archs`):

- every KV leaf is quantized, the index keys included, windows stay bounded,
  and the plan's bytes per row match the bytes held;
- at 8 bits the greedy tokens equal the unquantized run's;
- prompt-cache files round trip and generation continues identically;
- the serving engine warms up and serves them (deepseek_v41 one sequence at
  a time, like mlx-lm's server).

Weight seeds: sparse attention picks keys (top-k keys, or top-k blocks) by
score, a discontinuous choice; quantization noise flips it where two scores
are within about 1e-3 of each other, which random weights produce often
(deepseek_v32 seed 1: a flipped top-k set at query rows 30 and 39, score gap
5e-4 at the boundary). The seeds below were chosen, as in
test_models_generate.py, where the unquantized 10-token greedy path has a
top-2 log-prob margin of at least 0.025 and no such flip.
"""

from __future__ import annotations

import argparse
import importlib
import threading

import mlx.core as mx
import numpy as np
import pytest
from kvq_testing import archs
from mlx.utils import tree_flatten

import mlx_kvq
from mlx_kvq.caches import KVQDeepseekV41Cache, KVQIndexerCache, cache_report
from mlx_kvq.caches.deepseek_v41 import KVQCompressedRows, KVQWindowRows
from mlx_kvq.config import KVConfig, QuantSpec, UnsupportedKVConfig
from mlx_kvq.defaults import DEFAULT_KV_CONFIG
from mlx_kvq.generate import load_prompt_cache, save_prompt_cache
from mlx_kvq.plan import KV_KINDS, plan_kv

mlx_generate = importlib.import_module("mlx_lm.generate")

SEEDS = {"deepseek_v32": 8, "glm_moe_dsa": 0, "minimax_m3_vl": 0, "deepseek_v41": 3}
MODELS = list(SEEDS)
KINDS = {
    "deepseek_v32": {"full", "indexer"},
    "glm_moe_dsa": {"full", "indexer"},
    "minimax_m3_vl": {"full", "indexer"},
    "deepseek_v41": {"sliding", "compressed", "indexer"},
}
N_TOKENS = 10
PREFILL_STEP = 16  # the 40-token prompt in 3 chunks (windows of 8 wrap; top-k from 16 keys)
Q8 = QuantSpec(8)


@pytest.fixture(scope="module")
def models():
    return {name: archs.build_model(name, seed=seed) for name, seed in SEEDS.items()}


def _greedy(model, cache=None, prompt=None, n=N_TOKENS) -> list[int]:
    prompt = archs.prompt_tokens() if prompt is None else prompt
    gen = mlx_generate.generate_step(
        prompt, model, prompt_cache=cache, max_tokens=n, prefill_step_size=PREFILL_STEP
    )
    return [int(t) for t, _ in gen]


@pytest.mark.parametrize("cfg", [KVConfig(bits=4), DEFAULT_KV_CONFIG], ids=["4bit", "default"])
@pytest.mark.parametrize("name", MODELS)
def test_every_kv_leaf_quantized_bounded_and_as_planned(models, name, cfg):
    """With plain 4-bit and with the default (rotation; bounded layers at their
    own width), which indexers without values must take too."""
    model = models[name]
    plan = plan_kv(model, cfg)
    assert plan.max_batch == (1 if name == "deepseek_v41" else None)
    cache = plan.make_cache()
    assert len(_greedy(model, cache)) == N_TOKENS

    report = [r for r in cache_report(cache) if r["kind"] in KV_KINDS]
    assert len(report) == len(plan.kv_layers) == sum(p.quantized for p in plan.kv_layers)
    assert all(r["quantized"] for r in report), report
    assert {r["kind"] for r in report} == KINDS[name]
    for p, r in zip(plan.kv_layers, report, strict=True):
        assert p.kind == r["kind"]
        if p.window is not None:  # the 50-token run wrapped every window
            assert r["tokens"] == p.window
        if p.kind == "compressed":  # one row per `ratio` tokens
            assert r["tokens"] == (archs.PROMPT_LEN + N_TOKENS - 1) // p.ratio
    leaves = [c for slot in cache for c in _kv_leaves(slot)]
    for p, c in zip(plan.kv_layers, leaves, strict=True):
        assert c.nbytes == round(p.bytes_per_row() * c.key_store.length)


SPLIT = KVConfig(
    key_bits=5, value_bits=4, rotation="hadamard", key_scales="channel", key_group_size=128,
    sinks=4, residual=16,
)  # fmt: skip


@pytest.mark.parametrize("name", MODELS)
def test_split_setting_falls_back_per_token_where_a_kind_has_no_split_form(models, name):
    """Indexer models set their attention caches' `.keys` themselves and
    deepseek_v41's layer fields have no per-channel form: under a split
    setting every layer gets per-token keys in the setting's channel groups
    (a key group of 128 tokens is no channel group), the plan says so for
    each, and generation runs."""
    model = models[name]
    plan = plan_kv(model, SPLIT)
    for p in plan.kv_layers:
        k = p.key_spec
        assert (k.bits, k.group_size, k.per_channel, k.sinks, k.residual) == (5, 64, False, 0, 0)
        where = f"cache slot {p.slot} member {p.member} ({p.kind})"
        assert any(n.startswith(where) and "per token" in n for n in plan.notes), where
    assert len(_greedy(model, plan.make_cache())) == N_TOKENS


def _kv_leaves(slot) -> list:
    from mlx_kvq.caches import KVQCache, leaves

    return [c for c in leaves(slot) if isinstance(c, KVQCache)]


@pytest.mark.parametrize("name", MODELS)
def test_8bit_tokens_match_unquantized(models, name):
    model = models[name]
    want = _greedy(model)
    assert _greedy(model, mlx_kvq.make_prompt_cache(model, kv_bits=8)) == want


@pytest.mark.parametrize("name", MODELS)
def test_prompt_file_round_trip_continues_identically(models, name, tmp_path):
    model = models[name]
    tokens = archs.prompt_tokens()

    def prefill():
        cache = mlx_kvq.make_prompt_cache(model, kv_bits=8, quantized_kv_start=20)
        for i in range(0, 37, 12):  # chunks, then single tokens
            model(tokens[None, i : min(i + 12, 37)], cache=cache)
        for i in range(37, 40):
            model(tokens[None, i : i + 1], cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    saved = prefill()
    path = str(tmp_path / f"{name}.safetensors")
    save_prompt_cache(path, saved, {"model": name})
    expect = KVConfig(bits=8, quantized_start=20)
    loaded, meta = load_prompt_cache(path, return_metadata=True, expect=expect)
    assert meta["model"] == name and "8b/g64" in meta["mlx_kvq"]
    assert [type(c) for c in loaded] == [type(c) for c in saved]
    for a, b in zip(tree_flatten([c.state for c in saved]), tree_flatten([c.state for c in loaded]),
                    strict=True):  # fmt: skip
        if isinstance(a[1], mx.array):
            assert a[1].dtype == b[1].dtype and mx.array_equal(a[1], b[1]).item(), a[0]
        else:
            assert a == b
    with pytest.raises(UnsupportedKVConfig):  # every leaf is checked, the index keys too
        load_prompt_cache(path, expect=KVConfig(bits=4))
    never_saved = _greedy(model, prefill(), prompt=mx.array([7]), n=6)
    assert _greedy(model, loaded, prompt=mx.array([7]), n=6) == never_saved


# -- what the model code does with the caches ----------------------------------------
def _rows(rng, *shape):
    return mx.array(rng.standard_normal(shape).astype(np.float32))


def test_indexer_cache_shows_the_model_arrays_and_keeps_keys_only():
    rng = np.random.default_rng(0)
    cache = KVQIndexerCache(Q8, Q8)
    k = _rows(rng, 1, 1, 5, 64)
    got, _ = cache.update_and_fetch(k, k)  # deepseek_v32 passes its keys twice
    assert isinstance(got, mx.array) and mx.abs(got - k).max().item() < 0.05
    held = cache.nbytes
    assert cache.value_store.shape[-1] == 0  # no values kept
    cache.values = mx.zeros_like(cache.keys)  # the model dropping its copy
    assert cache.nbytes == held and cache.value_store.shape[-1] == 0
    other = mx.ones((3,))
    tied = mx.depends(other, (cache.keys, cache.values))  # the model's graph tie
    assert mx.array_equal(tied, other).item()
    with pytest.raises(TypeError, match="values"):
        cache.values = mx.zeros((3,))
    got, _ = cache.update_and_fetch(k[..., :1, :], k[..., :0])  # minimax: zero-width values
    assert got.shape == (1, 1, 6, 64) and cache.offset == 6


def test_layer_cache_appends_what_the_model_assigns_and_bounds_the_window():
    rng = np.random.default_rng(1)
    leaves = {
        "window": KVQWindowRows(Q8, Q8, max_rows=8),
        "compress_kv": KVQCompressedRows(Q8, Q8, ratio=4),
    }
    cache = KVQDeepseekV41Cache(8, leaves)
    for n in (5, 6, 1, 1):
        kv = _rows(rng, 1, n, 64)
        out = cache.update_window(kv)
        assert mx.abs(out[:, -n:] - kv).max().item() < 0.05
        assert cache.window.shape[1] == min(8, cache.offset)
    assert cache.leaves["window"].key_store.length == 8  # bounded
    first = _rows(rng, 1, 3, 64)
    cache.compress_kv = first  # `_append(None, new)`
    more = _rows(rng, 1, 2, 64)
    cache.compress_kv = mx.concatenate([cache.compress_kv, more], axis=1)  # `_append(old, new)`
    assert cache.leaves["compress_kv"].offset == 5
    assert mx.abs(cache.compress_kv[:, 3:] - more).max().item() < 0.05
    window = cache.window
    cache.window = mx.depends(cache.window, mx.ones((1,)))  # a pipeline stage's send tie
    assert mx.array_equal(cache.window, window).item()
    with pytest.raises(TypeError, match="only grow"):
        cache.compress_kv = first[:, :2]
    with pytest.raises(TypeError, match="not planned"):
        cache.index_k = first


def test_deepseek_v41_pipeline_stages_are_refused_at_plan_time(models):
    model = models["deepseek_v41"]
    model.model.pipeline_size = 2
    try:
        with pytest.raises(UnsupportedKVConfig, match="pipeline"):
            plan_kv(model, KVConfig(bits=4))
    finally:
        model.model.pipeline_size = 1


# -- serving ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["deepseek_v41", "minimax_m3_vl"])
def test_the_engine_warms_up_and_serves(name, tmp_path):

    from kvq_testing.tiny import save_tiny_model
    from mlx_lm import load

    from mlx_kvq.commands.serve import add_parser, engine_options
    from mlx_kvq.engine import (
        Engine,
        FinishEvent,
        GenerationRequest,
        SamplingParams,
        TokenEvent,
        check_batch_path,
    )

    model, tokenizer = load(str(save_tiny_model(tmp_path / "m", name)))
    kv = KVConfig(bits=4)
    plan = plan_kv(model, kv, batch=True)
    check_batch_path(plan.make_cache, kv, max_batch=plan.max_batch)
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    flags = sub.choices["serve"].parse_args(
        ["--decode-concurrency", "8", "--prompt-concurrency", "4", "--prompt-cache-size", "4",
         "--max-queued-requests", "16"]
    )  # fmt: skip
    options = engine_options(flags, plan.max_context, None, plan.max_batch)
    assert options.decode_concurrency == (1 if name == "deepseek_v41" else 8)
    engine = Engine(model, tokenizer, plan, kv, options)
    engine.start()
    try:
        assert engine.readiness.ready_event.wait(120)
        state = engine.readiness.get()
        assert state.status == "ready", state.reason
        for kind in KINDS[name]:
            for where in ("batch", "extracted"):
                s = state.report[where][kind]
                assert s["quantized"] == s["slots"] > 0, (where, kind)
        done = [threading.Event() for _ in range(3)]
        events = [[] for _ in range(3)]
        for i in range(3):

            def sink(ev, i=i):
                events[i].append(ev)
                if not isinstance(ev, TokenEvent):
                    done[i].set()

            prompt = tokenizer.encode(f"Tell me story number {i}")
            engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=5)), sink)
        for i in range(3):
            assert done[i].wait(120)
            assert isinstance(events[i][-1], FinishEvent), events[i][-1]
            assert len(events[i]) == 6
        assert engine.metrics.snapshot().max_batch_size == (1 if name == "deepseek_v41" else 3)
    finally:
        engine.stop()

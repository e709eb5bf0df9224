"""Bounded layers with their own width (`--kv-window-bits`, KVConfig.window_bits).

Sliding windows, chunked attention and `--max-kv-size` bounds hold a fixed
number of tokens, so they can be stored wider at a fixed cost. Checked on
every cache kind: the plan gives each layer its width, the bytes the plan
estimates are the bytes the caches hold, prompt-cache files keep and check
the per-kind settings, the command line resolves the default and keeps
`--kv-bits N`'s mlx-lm meaning.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
import pytest
from kvq_testing.archs import build_model
from kvq_testing.helpers import tiny_model

import mlx_kvq
from mlx_kvq import KVConfig, UnsupportedKVConfig
from mlx_kvq.caches import KVQCache, cache_report
from mlx_kvq.commands import main
from mlx_kvq.commands.flags import add_kv_flags, kv_config
from mlx_kvq.commands.startup import ModelSource, kv_setting
from mlx_kvq.config import QuantSpec
from mlx_kvq.defaults import DEFAULT_FULL_KV_CONFIG, DEFAULT_KV_CONFIG
from mlx_kvq.evaluate import held_storage
from mlx_kvq.generate import load_prompt_cache, save_prompt_cache
from mlx_kvq.plan import plan_kv

CFG = KVConfig(bits=3, window_bits=8, rotation="hadamard")


def _models():
    return {
        "gemma3_text (sliding + full)": tiny_model("gemma3_text"),
        "gemma4_text (KV-shared, head dims 64/128)": tiny_model("gemma4_text"),
        "llama4 (chunked + full)": build_model("llama4"),
        "llama (full, bounded by --max-kv-size)": tiny_model("llama"),
    }


@pytest.fixture(scope="module")
def models():
    return _models()


def _cfg(name: str) -> KVConfig:
    return CFG.with_(max_kv_size=24) if "max-kv-size" in name else CFG


def test_specs_resolve_per_kind():
    assert CFG.specs() == (QuantSpec(3, 64, "hadamard"),) * 2
    assert CFG.specs(bounded=True) == (QuantSpec(8, 64, "hadamard"),) * 2
    mixed = KVConfig(key_bits=4, value_bits=3)
    assert mixed.specs(bounded=True) == mixed.specs()  # no window bits: one width
    assert "windows 8b/g64+rot" in CFG.describe()
    with pytest.raises(ValueError, match="kv bits must be one of"):
        KVConfig(bits=4, window_bits=7)
    with pytest.raises(ValueError, match="give --kv-bits"):
        KVConfig(window_bits=8)


def test_plan_gives_bounded_layers_their_width_and_bytes_equal_bytes_held(models):
    for name, model in models.items():
        cfg = _cfg(name)
        plan = plan_kv(model, cfg)
        for p in plan.kv_layers:
            want = 8 if p.window is not None else 3
            assert (p.key_spec.bits, p.value_spec.bits) == (want, want), (name, p)
        assert any(p.window is not None for p in plan.kv_layers), name
        if "chunked" in name:
            continue  # see the next test
        for context in (256, 512, 2048):
            held = held_storage(model, cfg, context)
            assert plan.estimate(context)["bytes"] == held["bytes"], (name, context)


def test_bytes_per_token_are_exact_for_every_slot_held(models):
    """Every cache's bytes are the plan's bytes per token times the slots it
    holds. (A chunked cache, like mlx-lm's, holds its chunk plus the tokens
    of the current step's 256-slot growth, which the plan's estimate at a
    context does not count: the per-token cost is exact, the slot count is
    not.)"""
    for name, model in models.items():
        plan = plan_kv(model, _cfg(name))
        cache = plan.make_cache()
        tokens = mx.arange(1, 301).reshape(1, -1) % 200
        for s in range(0, 300, 100):
            model(tokens[:, s : s + 100], cache=cache)
        model(mx.array([[3]]), cache=cache)
        leaves = [c for c in cache if isinstance(c, KVQCache)]
        layers = [p for p in plan.layers if p.is_kv]
        assert len(leaves) == len(layers), name
        for p, c in zip(layers, leaves, strict=True):
            assert c.nbytes == round(p.bytes_per_token() * c.keys.length), (name, p.slot)
        if "KV-shared" in name:
            assert plan.shared_layers > 0


def test_caches_hold_their_planned_width_through_a_forward_pass(models):
    for name, model in models.items():
        cfg = _cfg(name)
        plan = plan_kv(model, cfg)
        cache = plan.make_cache()
        tokens = mx.arange(1, 41).reshape(1, -1)
        for s in range(0, 40, 16):
            model(tokens[:, s : s + 16], cache=cache)
        model(mx.array([[3]]), cache=cache)
        leaves = [c for c in cache if isinstance(c, KVQCache)]
        assert leaves and all(c.quantized for c in leaves), name
        for c in leaves:
            want = 8 if c.bounded else 3
            assert (c.keys.spec.bits, c.values.spec.bits) == (want, want), (name, type(c))
        assert all(r["quantized"] for r in cache_report(cache) if r["kind"] != "state")


def test_prompt_file_keeps_and_checks_per_kind_widths(tmp_path):
    model = tiny_model("gemma3_text")
    cache = mlx_kvq.make_prompt_cache(model, kv_bits=3, kv_window_bits=8, kv_rotation="hadamard")
    model(mx.arange(1, 30).reshape(1, -1), cache=cache)
    mx.eval([c.state for c in cache])
    path = str(tmp_path / "w.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path, expect=CFG)
    for a, b in zip(cache, loaded, strict=True):
        assert (a.key_spec, a.value_spec, a.bounded) == (b.key_spec, b.value_spec, b.bounded)
        for x, y in zip(a.keys.parts, b.keys.parts, strict=True):
            # the file holds the tokens the cache covers, not its buffer's unused tail
            held = y.shape[-2]
            assert held >= (min(a.offset, a.max_size) if a.bounded else a.offset)
            assert mx.array_equal(x[..., :held, :], y).item()
    for bad in (CFG.with_(window_bits=None), CFG.with_(window_bits=6), KVConfig(bits=8)):
        with pytest.raises(UnsupportedKVConfig, match="layer 0"):
            load_prompt_cache(path, expect=bad)
    # Continuing from the loaded cache gives the tokens the original gives.
    gen = [
        [
            int(t)
            for t, _ in mlx_kvq.generate_step(
                mx.array([7]),
                model,
                prompt_cache=c,
                max_tokens=6,
                kv_bits=3,
                kv_window_bits=8,
                kv_rotation="hadamard",
            )
        ]  # fmt: skip
        for c in (cache, loaded)
    ]
    assert gen[0] == gen[1]


def test_converting_filled_unquantized_caches_uses_the_per_kind_widths():
    model = tiny_model("gemma3_text")
    from mlx_lm.models import cache as mlx_cache

    filled = mlx_cache.make_prompt_cache(model)
    model(mx.arange(1, 20).reshape(1, -1), cache=filled)
    out = list(
        mlx_kvq.generate_step(
            mx.array([5]), model, prompt_cache=filled, max_tokens=2, kv_bits=3, kv_window_bits=8
        )
    )
    assert len(out) == 2
    assert {(c.bounded, c.keys.spec.bits) for c in filled} == {(True, 8), (False, 3)}


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_kv_flags(p)
    return p.parse_args(list(argv))


def test_command_line_default_and_explicit_bits():
    assert kv_config(_args()) == DEFAULT_KV_CONFIG
    plain = kv_config(_args("--kv-bits", "4"))  # mlx-lm's meaning: one width, no rotation
    assert plain.window_bits is None and plain.rotation == "none"
    assert plain.specs(bounded=True) == plain.specs() == (QuantSpec(4), QuantSpec(4))
    both = kv_config(_args("--kv-bits", "3", "--kv-window-bits", "8"))
    assert both.specs(bounded=True) == (QuantSpec(8), QuantSpec(8))
    only = kv_config(_args("--kv-window-bits", "6"))
    assert only.specs() == DEFAULT_KV_CONFIG.specs()
    assert only.specs(bounded=True)[0].bits == 6


def test_the_default_follows_the_models_layout(capsys):
    """No bits flag: a model with a bounded layer gets the hybrid default, one
    whose layers all hold the whole context the full-attention default (and
    `mlx-kvq plan` says which); `--max-kv-size` bounds every layer; bits flags
    are the user's."""
    nowhere = ModelSource("not-on-disk", "test")
    full, hybrid = tiny_model("llama"), tiny_model("gemma3_text")
    assert kv_setting(_args(), nowhere, full) == DEFAULT_FULL_KV_CONFIG
    assert kv_setting(_args(), nowhere, hybrid) == DEFAULT_KV_CONFIG
    assert kv_setting(_args(), nowhere) == DEFAULT_KV_CONFIG  # not loaded yet: no layout known
    bounded = kv_setting(_args("--max-kv-size", "64"), nowhere, full)
    assert bounded == DEFAULT_KV_CONFIG.with_(max_kv_size=64)
    assert kv_setting(_args("--kv-bits", "4"), nowhere, full) == kv_config(_args("--kv-bits", "4"))
    only = kv_setting(_args("--kv-window-bits", "6", "--kv-rotation", "none"), nowhere, full)
    assert only == DEFAULT_FULL_KV_CONFIG.with_(window_bits=6, rotation="none")
    for model, want in (("demo:full", DEFAULT_FULL_KV_CONFIG), ("demo:gemma", DEFAULT_KV_CONFIG)):
        assert main(["plan", "--model", model]) == 0
        assert f"], {want.describe()}, " in capsys.readouterr().out.splitlines()[0]


def test_batch_forms_keep_each_kinds_width():
    rng = np.random.default_rng(0)
    model = tiny_model("gemma3_text")
    plan = plan_kv(model, CFG, batch=True)
    rows = [plan.make_cache(), plan.make_cache()]
    for i, cache in enumerate(rows):
        n = 12 + 5 * i
        tokens = mx.array(rng.integers(1, 200, size=(1, n)))
        model(tokens, cache=cache)
    merged = [type(a).merge([a, b]) for a, b in zip(*rows, strict=True)]
    model(mx.array([[1], [2]]), cache=merged)
    other = [type(a).merge([a]) for a in plan.make_cache()]
    model(mx.array([[4, 5, 6]]), cache=other)
    model(mx.array([[7]]), cache=other)
    for m, o in zip(merged, other, strict=True):
        m.extend(o)
        m.filter([0, 2])
    model(mx.array([[1], [2]]), cache=merged)
    for m in merged:
        want = 8 if m.bounded else 3
        assert (m.keys.spec.bits, m.values.spec.bits) == (want, want)
        assert m.keys.quantized and m.values.quantized
        one = m.extract(1)
        assert one.bounded == m.bounded and one.keys.spec.bits == want
        assert one.nbytes == round(plan.layers[merged.index(m)].bytes_per_token() * one.keys.length)


def test_deepseek_v41_window_rows_take_the_bounded_width(tmp_path):
    """deepseek_v41's LayerCache: its `window` field is bounded (8 bits here),
    its compressed rows and indexer keys are not (3 bits); bytes as planned,
    and a prompt file of it is checked field by field."""
    from mlx_kvq.caches import leaves

    model = build_model("deepseek_v41", seed=3)
    plan = plan_kv(model, CFG)
    widths = {(p.kind, p.key_spec.bits) for p in plan.kv_layers}
    assert widths == {("sliding", 8), ("compressed", 3), ("indexer", 3)}
    cache = plan.make_cache()
    model(mx.arange(1, 41).reshape(1, -1), cache=cache)
    model(mx.array([[3]]), cache=cache)
    held = [c for slot in cache for c in leaves(slot) if isinstance(c, KVQCache)]
    assert len(held) == len(plan.kv_layers)
    for p, c in zip(plan.kv_layers, held, strict=True):
        assert (c.kind, c.key_spec.bits, c.bounded) == (
            p.kind,
            p.key_spec.bits,
            p.window is not None,
        )
        assert c.nbytes == round(p.bytes_per_row() * c.key_store.length)
    path = str(tmp_path / "v41.safetensors")
    save_prompt_cache(path, cache)
    load_prompt_cache(path, expect=CFG)
    with pytest.raises(UnsupportedKVConfig, match="was stored as"):
        load_prompt_cache(path, expect=CFG.with_(window_bits=None))


def test_window_bits_zero_leaves_bounded_layers_unquantized_on_request():
    with pytest.raises(ValueError, match="--allow-partial-kv"):
        KVConfig(bits=3, window_bits=0)
    cfg = KVConfig(bits=3, window_bits=0, allow_partial=True)
    assert cfg.specs(bounded=True) == (QuantSpec(None), QuantSpec(None))
    assert kv_config(_args("--kv-bits", "3", "--kv-window-bits", "0", "--allow-partial-kv")) == cfg
    model = tiny_model("gemma3_text")
    model.set_dtype(mx.float16)  # the plan counts unquantized elements at 2 bytes
    plan = plan_kv(model, cfg)
    assert plan.partial and "PARTIAL" in plan.summary()
    assert {(p.window is not None, p.quantized) for p in plan.kv_layers} == {
        (True, False),
        (False, True),
    }
    for context in (256, 512):
        assert plan.estimate(context)["bytes"] == held_storage(model, cfg, context)["bytes"]

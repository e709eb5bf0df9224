"""The per-layer plan: decided by declaration, checked at load time, reported."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from kvq_testing.archs import build_model
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import gemma3_text

from mlx_kvq import KVConfig, UnsupportedKVConfig
from mlx_kvq.caches import cache_report
from mlx_kvq.generate import make_prompt_cache
from mlx_kvq.plan import plan_kv

GEMMA3 = dict(
    model_type="gemma3_text", hidden_size=128, num_hidden_layers=4, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=128,
    sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=64,
)  # fmt: skip


def _gemma3(**over):
    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict({**GEMMA3, **over}))
    model.set_dtype(mx.float32)
    return model


class SneakyCache(mlx_cache.KVCache):
    """Looks quantizable (`to_quantized` works) but nobody declared it."""

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        return super().to_quantized(group_size, bits)


class SneakyModel(gemma3_text.Model):
    forward_calls = 0

    def __call__(self, *args, **kwargs):
        SneakyModel.forward_calls += 1
        return super().__call__(*args, **kwargs)

    def make_cache(self):
        caches = super().make_cache()
        caches[1] = SneakyCache()
        return caches


def test_undeclared_cache_type_fails_before_any_forward_pass():
    model = SneakyModel(gemma3_text.ModelArgs.from_dict(GEMMA3))
    SneakyModel.forward_calls = 0
    with pytest.raises(UnsupportedKVConfig) as err:
        plan_kv(model, KVConfig(bits=4))
    assert "cache slot 1" in str(err.value) and "SneakyCache" in str(err.value)
    assert SneakyModel.forward_calls == 0
    with pytest.raises(UnsupportedKVConfig):
        make_prompt_cache(model, kv_bits=4)


def test_plan_covers_every_slot_with_bytes_and_windows():
    plan = plan_kv(_gemma3(), KVConfig(bits=4))
    assert [p.kind for p in plan.layers] == ["sliding", "full", "sliding", "full"]
    assert all(p.quantized for p in plan.layers)
    assert {p.window for p in plan.layers if p.kind == "sliding"} == {8}
    # 2 kv heads x (64 + 64) dims x (4/8 + 4/64) bytes
    assert all(p.bytes_per_token() == pytest.approx(2 * 128 * 0.5625) for p in plan.layers)
    assert plan.summary().startswith("gemma3_text: 4/4 KV layers quantized")
    est = plan.estimate(1000)
    assert est["by_kind"]["sliding"]["bytes"] == round(2 * 8 * 144)
    assert est["ratio"] < 0.29


def test_plan_bytes_per_token_match_bytes_held():
    model = _gemma3()
    plan = plan_kv(model, KVConfig(bits=4))
    cache = plan.make_cache()
    model(mx.arange(256).reshape(1, -1) % 128, cache=cache)
    for p, r in zip(plan.layers, cache_report(cache), strict=True):
        held_slots = cache[p.slot].keys.length
        assert r["nbytes"] == pytest.approx(p.bytes_per_token() * held_slots, rel=0.05)


def test_partial_quantization_needs_explicit_option_and_is_loud():
    with pytest.raises(ValueError, match="allow-partial-kv"):
        KVConfig(bits=4, skip_layers=(1,))
    plan = plan_kv(_gemma3(), KVConfig(bits=4, skip_layers=(1,), allow_partial=True))
    first_line = plan.table().splitlines()[0]
    assert first_line.startswith("WARNING: PARTIAL") and "3/4 KV layers quantized" in first_line
    cache = plan.make_cache()
    assert type(cache[1]) is mlx_cache.KVCache


def test_recurrent_state_is_reported_as_state():
    plan = plan_kv(build_model("qwen3_next"), KVConfig(bits=4))
    kinds = {p.kind for p in plan.layers}
    assert "state" in kinds and "full" in kinds
    assert "state (recurrent, not a KV cache)" in plan.table()
    assert all(p.quantized for p in plan.kv_layers)


def test_group_size_not_dividing_head_dim_is_refused_at_plan_time():
    model = _gemma3(head_dim=96, query_pre_attn_scalar=96)
    with pytest.raises(UnsupportedKVConfig, match="head dimension 96 .* group size 64"):
        plan_kv(model, KVConfig(bits=4))
    assert plan_kv(model, KVConfig(bits=4, group_size=32)).layers[0].quantized


def test_max_kv_size_bounds_full_layers_too():
    model = _gemma3()
    plan = plan_kv(model, KVConfig(bits=4, max_kv_size=32))
    assert all(p.window is not None for p in plan.layers)
    cache = plan.make_cache()
    for _ in range(3):
        model(mx.arange(40).reshape(1, -1) % 128, cache=cache)
    assert all(r["tokens"] <= 32 for r in cache_report(cache))


def test_plan_to_dict_is_json():
    d = plan_kv(_gemma3(), KVConfig(bits=8)).to_dict()
    assert json.loads(json.dumps(d, default=str))["quantized_layers"] == 4


def test_a_slot_never_written_is_refused_for_batching_at_plan_time():
    """nemotron-nas replaces some attention blocks: their cache slots stay
    empty, which mlx-lm's batch caches cannot carry through a padded prompt
    batch; one sequence at a time (`generate`) plans and runs."""
    model = build_model("nemotron-nas")
    single = plan_kv(model, KVConfig(bits=4))
    unused = [p.slot for p in single.layers if p.kind == "unused"]
    assert unused
    with pytest.raises(UnsupportedKVConfig, match=f"cache slot {unused[0]} is never written"):
        plan_kv(model, KVConfig(bits=4), batch=True)

"""Bad KV settings fail with a clear ValueError naming the setting when the
caches are made (`mlx_kvq.make_prompt_cache`), never inside a forward pass."""

from __future__ import annotations

import mlx.core as mx
import pytest
from kvq_testing.helpers import tiny_model

import mlx_kvq
from mlx_kvq.caches import KVQWindowCache
from mlx_kvq.config import QuantSpec


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def gemma():
    return tiny_model("gemma3_text")


def _raises_at_make(model, match: str, **kwargs):
    with pytest.raises(ValueError, match=match) as info:
        mlx_kvq.make_prompt_cache(model, **kwargs)
    # Raised by the settings or the planner, not from inside model code.
    frames = [str(entry.path) for entry in info.traceback]
    assert not any("mlx_lm/models/" in f for f in frames), frames
    return info.value


@pytest.mark.parametrize("bits", [1, 7, 16])
@pytest.mark.parametrize("which", ["kv_bits", "kv_key_bits", "kv_value_bits"])
def test_unsupported_bits(llama, gemma, bits, which):
    for model in (llama, gemma):
        kwargs = {which: bits} if which == "kv_bits" else {"kv_bits": 4, which: bits}
        err = _raises_at_make(model, r"kv bits must be one of \(2, 3, 4, 5, 6, 8\)", **kwargs)
        assert f"got {bits}" in str(err)


@pytest.mark.parametrize("group", [0, 16, 48, 256])
def test_unsupported_group_size(llama, group):
    err = _raises_at_make(llama, "kv group size", kv_bits=4, kv_group_size=group)
    assert f"got {group}" in str(err)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_head_dim_not_divisible_by_group(head_dim):
    model = tiny_model("llama", head_dim=head_dim)
    err = _raises_at_make(model, f"head dimension {head_dim}", kv_bits=4, kv_group_size=64)
    assert isinstance(err, mlx_kvq.UnsupportedKVConfig)
    assert "group size 64" in str(err)
    if head_dim == 96:  # 32 divides 96: the suggested group size works
        assert "--kv-group-size 32" in str(err)
        cache = mlx_kvq.make_prompt_cache(model, kv_bits=4, kv_group_size=32)
        assert all(c.key_spec.group_size == 32 for c in cache)


def test_head_dim_128_group_128_ok_and_64_refused():
    model = tiny_model("llama", head_dim=128, hidden_size=256)
    assert mlx_kvq.make_prompt_cache(model, kv_bits=4, kv_group_size=128)
    _raises_at_make(tiny_model("llama"), "head dimension 64", kv_bits=4, kv_group_size=128)


@pytest.mark.parametrize("size", [1, 3, 4])
def test_max_kv_size_not_above_sink_tokens(llama, gemma, size):
    for model in (llama, gemma):
        err = _raises_at_make(model, "max_size", kv_bits=4, max_kv_size=size)
        assert "keep" in str(err) and "max kv size" in str(err)
    cache = mlx_kvq.make_prompt_cache(llama, kv_bits=4, max_kv_size=5)
    assert all(isinstance(c, KVQWindowCache) and (c.max_size, c.keep) == (5, 4) for c in cache)


@pytest.mark.parametrize("max_size,keep", [(4, 4), (2, 4), (0, 0)])
def test_window_cache_refuses_max_size_not_above_keep(max_size, keep):
    with pytest.raises(ValueError, match=rf"max_size \({max_size}\).*keep \({keep}\)"):
        KVQWindowCache(max_size, QuantSpec(4), QuantSpec(4), keep=keep)


def test_other_settings(llama):
    _raises_at_make(llama, "quantized kv start", kv_bits=4, quantized_kv_start=-1)
    _raises_at_make(llama, "max kv size must be positive", kv_bits=4, max_kv_size=0)
    _raises_at_make(llama, "rotation", kv_bits=4, kv_rotation="random")
    _raises_at_make(llama, "allow-partial", kv_bits=4, kv_skip_layers=(0,))


def test_generate_step_refuses_before_any_forward(llama):
    calls = []

    class Spy:
        layers = llama.layers

        def __call__(self, *a, **k):
            calls.append(1)
            return llama(*a, **k)

    with pytest.raises(ValueError, match="kv bits"):
        next(mlx_kvq.generate_step(mx.array([1, 2, 3]), Spy(), kv_bits=9))
    assert calls == []

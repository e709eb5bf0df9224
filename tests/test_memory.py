"""Memory: at 4 bits, group 64, every KV layer holds at most 0.29x the bytes
of a float16 cache holding the same token slots (theory: (4/8 + 2*2/64) / 2
= 0.28125 per element, packed data plus 16-bit scales and biases).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from kvq_testing.helpers import prompt_tokens, tiny_model
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import cache as mlx_cache

import mlx_kvq
from mlx_kvq.caches import KVQCache, cache_report

THEORY = (4 / 8 + 2 * 2 / 64) / 2
LIMIT = 0.29
PROMPT, CHUNK, DECODE = 264, 132, 3  # crosses mlx-lm's 256-token buffer step


def _run(model, cache):
    tokens = prompt_tokens(PROMPT + DECODE)[None]
    for i in range(0, PROMPT, CHUNK):
        model(tokens[:, i : i + CHUNK], cache=cache)
    for i in range(PROMPT, PROMPT + DECODE):
        model(tokens[:, i : i + 1], cache=cache)
    mx.eval([c.state for c in cache])


def _state_bytes(c) -> int:
    return sum(v.nbytes for _, v in tree_flatten(c.state) if isinstance(v, mx.array))


@pytest.mark.parametrize("name", ["gemma3_text", "gemma4_text", "cohere2"])
def test_4bit_layers_against_float16_caches(name):
    """Float16 model: mlx-lm's float16 caches and ours hold the same slots."""
    model = tiny_model(name)
    model.update(tree_map(lambda p: p.astype(mx.float16), model.parameters()))
    ref = mlx_cache.make_prompt_cache(model)
    ours = mlx_kvq.make_prompt_cache(model, kv_bits=4, kv_group_size=64)
    _run(model, ref)
    _run(model, ours)
    assert len(ours) == len(ref)
    for i, (q, r) in enumerate(zip(ours, ref, strict=True)):
        assert isinstance(q, KVQCache) and q.quantized
        assert r.keys.dtype == mx.float16
        assert q.keys.length == r.keys.shape[2]  # the same token slots
        ratio = q.nbytes / r.nbytes
        assert ratio <= LIMIT, (i, ratio)
        assert ratio == pytest.approx(THEORY, abs=1e-9), (i, ratio)
        # What a prompt file would hold: the same ratio, bookkeeping aside.
        assert _state_bytes(q) / _state_bytes(r) <= LIMIT
    report = cache_report(ours)
    assert all(e["quantized"] for e in report)
    total = sum(e["nbytes"] for e in report)
    assert total / sum(r.nbytes for r in ref) <= LIMIT


def test_4bit_layers_against_float16_slots_moe():
    """gpt_oss runs in float32 on the CPU (MoE): compare every layer with a
    float16 cache of the slots it holds (its float32 twin's bytes / 2)."""
    model = tiny_model("gpt_oss")
    ref = mlx_cache.make_prompt_cache(model)
    ours = mlx_kvq.make_prompt_cache(model, kv_bits=4, kv_group_size=64)
    _run(model, ref)
    _run(model, ours)
    for i, (q, r) in enumerate(zip(ours, ref, strict=True)):
        assert q.quantized and r.keys.dtype == mx.float32
        assert q.keys.length == r.keys.shape[2]
        fp16 = r.nbytes // 2
        assert q.nbytes / fp16 <= LIMIT, i
        assert q.nbytes / fp16 == pytest.approx(THEORY, abs=1e-9)

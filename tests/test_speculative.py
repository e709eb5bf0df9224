"""Speculative decoding with quantized caches on both models."""

from __future__ import annotations

import mlx.core as mx
import pytest
from kvq_testing import archs
from kvq_testing.tiny import write_tokenizer
from mlx.utils import tree_map

from mlx_kvq import UnsupportedKVConfig
from mlx_kvq.caches import KVQWindowCache, cache_report
from mlx_kvq.generate import make_prompt_cache, stream_generate


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer

    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    return load_tokenizer(path)


def _tokens(responses):
    return [r.token for r in responses]


def test_speculative_equals_plain_greedy_with_quantized_caches(tokenizer):
    target = archs.build_model("llama")
    draft = archs.build_model("qwen2")  # another architecture, same vocabulary
    prompt = archs.prompt_tokens(20).tolist()
    plain = _tokens(stream_generate(target, tokenizer, prompt, max_tokens=12, kv_bits=8))
    caches = make_prompt_cache(target, kv_bits=8) + make_prompt_cache(draft, kv_bits=8)
    spec = list(
        stream_generate(target, tokenizer, prompt, max_tokens=12, draft_model=draft,
                        num_draft_tokens=3, prompt_cache=caches, kv_bits=8)
    )  # fmt: skip
    assert _tokens(spec) == plain
    report = cache_report(caches)
    assert report and all(r["quantized"] for r in report)
    # The target's caches were rewound to exactly the accepted tokens.
    n_target = len(target.layers)
    assert {c.offset for c in caches[:n_target]} == {len(prompt) + len(plain) - 1}


def perturbed(name: str, noise: float = 0.05, seed: int = 5):
    """The tiny model `name` with every weight nudged: a draft that agrees with
    the original on some tokens and not on others."""
    model = archs.build_model(name)
    key = mx.random.key(seed)

    def nudge(x):
        nonlocal key
        key, sub = mx.random.split(key)
        return x + noise * mx.random.normal(x.shape, key=sub) * x.std()

    model.update(tree_map(nudge, model.parameters()))
    return model


@pytest.mark.parametrize("num_draft", [1, 3, 6])
def test_speculative_rewinds_wrapped_windows_exactly(tokenizer, num_draft):
    """gemma3_text (windows of 8) drafted by a nudged copy of itself, which
    agrees on some tokens: the windows (target's and draft's) wrap during the
    prompt and keep wrapping, every rejection rewinds them, and greedy
    speculative decoding says what plain decoding says."""
    target = archs.build_model("gemma3_text")
    draft = perturbed("gemma3_text")
    prompt = archs.prompt_tokens(30).tolist()
    plain = _tokens(stream_generate(target, tokenizer, prompt, max_tokens=24, kv_bits=8))
    caches = make_prompt_cache(target, kv_bits=8) + make_prompt_cache(draft, kv_bits=8)
    spec = list(
        stream_generate(target, tokenizer, prompt, max_tokens=24, draft_model=draft,
                        num_draft_tokens=num_draft, prompt_cache=caches, kv_bits=8)
    )  # fmt: skip
    assert _tokens(spec) == plain
    assert any(r.from_draft for r in spec) and not all(r.from_draft for r in spec)
    windows = [c for c in caches if isinstance(c, KVQWindowCache)]
    assert windows and all(c.offset > c.max_size for c in windows)
    for c in windows:  # bounded: the window plus the tokens kept to rewind one step
        assert c.keys.length <= c.max_size + num_draft + 1
        assert c._evicted is None or c._evicted[0].length <= num_draft + 1


def test_speculative_refuses_unrewindable_caches_before_generating(tokenizer):
    target = archs.build_model("gemma3_text")
    draft = archs.build_model("llama")
    # a window left unquantized is mlx-lm's RotatingKVCache: it cannot rewind
    with pytest.raises(UnsupportedKVConfig, match="slot 0 cannot be rewound"):
        next(
            stream_generate(
                target, tokenizer, [1, 2, 3], max_tokens=4, draft_model=draft, kv_bits=4,
                allow_partial_kv=True, kv_skip_layers=(0,),
            )
        )  # fmt: skip

"""Speculative decoding with quantized caches on both models."""

from __future__ import annotations

import pytest
from kvq_testing import archs
from kvq_testing.tiny import write_tokenizer

from mlx_kvq import UnsupportedKVConfig
from mlx_kvq.caches import cache_report
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


def test_speculative_refuses_sliding_windows_before_generating(tokenizer):
    target = archs.build_model("gemma3_text")
    draft = archs.build_model("llama")
    with pytest.raises(UnsupportedKVConfig, match="sliding-window"):
        next(
            stream_generate(
                target, tokenizer, [1, 2, 3], max_tokens=4, draft_model=draft, kv_bits=4
            )
        )

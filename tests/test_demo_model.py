"""The embedded demo model loads offline with mlx-lm, is hybrid-attention and speaks English."""

from __future__ import annotations

import re

import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from mlx_lm.models.cache import KVCache, RotatingKVCache  # noqa: E402

from mlx_kvq.demo import DEMO_DIR, demo_model_path, heldout_path  # noqa: E402

MAX_BYTES = 25 * 1024 * 1024
# Measured 28.7 for the shipped weights (see mlx_kvq/demo/README.md); a uniform guess
# over the 4096-token vocabulary would score 4096.
MAX_HELDOUT_PPL = 45.0


@pytest.fixture(scope="module")
def demo():
    """(model, tokenizer, config) of the demo model, loaded once for the module."""
    return mlx_lm.load(str(demo_model_path()), return_config=True)


def test_files_within_size_budget() -> None:
    """Everything shipped under mlx_kvq/demo stays within 25 MB."""
    total = sum(f.stat().st_size for f in DEMO_DIR.rglob("*") if f.is_file())
    assert total <= MAX_BYTES, f"demo files total {total / 2**20:.1f} MiB"
    names = {f.name for f in demo_model_path().iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names


def test_config_is_hybrid_attention(demo) -> None:
    """gemma3_text with head_dim 64, sliding-window and full-attention layers."""
    model, _, config = demo
    assert config["model_type"] == "gemma3_text"
    assert config["head_dim"] == 64
    pattern, n = config["sliding_window_pattern"], config["num_hidden_layers"]
    sliding = [(i + 1) % pattern != 0 for i in range(n)]
    assert any(sliding) and sum(not s for s in sliding) >= 2
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert 4 * config["sliding_window"] <= 512
    caches = model.make_cache()
    assert [isinstance(c, RotatingKVCache) for c in caches] == sliding
    assert all(isinstance(c, KVCache) for c, s in zip(caches, sliding, strict=True) if not s)


def test_tokenizer_chat_template_and_eos(demo) -> None:
    """The chat template renders and both <eos> and <end_of_turn> stop generation."""
    _, tokenizer, _ = demo
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids).endswith("<start_of_turn>model\n")
    eot = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert {tokenizer.eos_token_id, eot} <= set(tokenizer.eos_token_ids)
    assert tokenizer.decode(tokenizer.encode("And God said", add_special_tokens=False)) == (
        "And God said"
    )


def test_greedy_generation_is_english(demo) -> None:
    """Greedy continuation is mostly alphabetic words."""
    model, tokenizer, _ = demo
    text = mlx_lm.generate(model, tokenizer, "And God said", max_tokens=20)
    words = text.split()
    assert len(words) >= 8, text
    english = [w for w in words if re.fullmatch(r"[\"'(]*[A-Za-z]+['’]?[A-Za-z]*[.,;:!?)\"']*", w)]
    assert len(english) >= 0.7 * len(words), text


def test_heldout_perplexity(demo) -> None:
    """Perplexity over the first 256 tokens of the held-out text is far below the vocab size."""
    model, tokenizer, _ = demo
    ids = tokenizer.encode(heldout_path().read_text())[:256]
    assert len(ids) == 256
    x = mx.array([ids])
    logits = model(x[:, :-1]).astype(mx.float32)
    nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, x[:, 1:, None], -1)[..., 0]
    ppl = float(mx.exp(nll.mean()))
    assert ppl < MAX_HELDOUT_PPL, ppl

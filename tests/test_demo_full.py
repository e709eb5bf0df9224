"""The full-attention demo model (`demo:full`): a qwen3 every command can name.

It is the second judge of the default KV setting (docs/quality.md): full
attention on every layer, more query heads per KV head than the gemma demo,
q/k norms, trained on different text (CPython's docstrings) with the KJV as
its out-of-domain text.
"""

from __future__ import annotations

import argparse
import json

import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from mlx_lm.models.cache import KVCache, make_prompt_cache  # noqa: E402

from mlx_kvq.commands import main  # noqa: E402
from mlx_kvq.commands.startup import model_source  # noqa: E402
from mlx_kvq.demo import (  # noqa: E402
    DEMO_FULL_DIR,
    DEMO_MODEL_DIR,
    demo_model_path,
    demo_texts,
    modern_path,
    resolve_model,
)

# Measured 189 on the first 256 tokens of modern.txt with the shipped weights
# (mlx_kvq/demo/README.md: an undertrained model); a uniform guess scores 4096.
MAX_MODERN_PPL = 300.0


@pytest.fixture(scope="module")
def full():
    return mlx_lm.load(str(demo_model_path("full")), return_config=True)


def test_names_resolve_in_one_place() -> None:
    assert resolve_model("demo:full") == (str(DEMO_FULL_DIR), "mlx-kvq-demo-full")
    assert resolve_model("demo:gemma") == (str(DEMO_MODEL_DIR), "mlx-kvq-demo")
    assert resolve_model(None) == resolve_model("demo:gemma")
    assert resolve_model("/some/dir") == ("/some/dir", None)
    with pytest.raises(ValueError, match="demo:gemma, demo:full"):
        resolve_model("demo:llama")
    for given, location, served in (
        ("demo:full", DEMO_FULL_DIR, "mlx-kvq-demo-full"),
        (None, DEMO_MODEL_DIR, "mlx-kvq-demo"),
        ("/some/dir", "/some/dir", "/some/dir"),
    ):
        src = model_source(argparse.Namespace(model=given))
        assert (src.location, src.served_id) == (str(location), served)
    named = model_source(argparse.Namespace(model="demo:full", served_model_name="x"))
    assert named.served_id == "x"
    assert list(demo_texts("full")) == ["modern", "heldout"]
    assert list(demo_texts()) == ["heldout", "modern"]


def test_config_is_full_attention_gqa_with_qk_norm(full) -> None:
    model, _, config = full
    gemma = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    ratio = config["num_attention_heads"] // config["num_key_value_heads"]
    assert ratio > gemma["num_attention_heads"] // gemma["num_key_value_heads"]
    assert config["head_dim"] == 64
    assert all(type(c) is KVCache for c in make_prompt_cache(model))
    attn = model.layers[0].self_attn
    assert attn.k_norm.weight.shape == (64,) and attn.q_norm.weight.shape == (64,)
    assert config["max_position_embeddings"] >= 1024
    size = sum(f.stat().st_size for f in DEMO_FULL_DIR.iterdir())
    assert size < 10 * 2**20, size


def test_modern_perplexity_and_eos(full) -> None:
    model, tokenizer, _ = full
    ids = tokenizer.encode(modern_path().read_text())[:256]
    x = mx.array([ids])
    logits = model(x[:, :-1]).astype(mx.float32)
    nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, x[:, 1:, None], -1)[..., 0]
    assert float(mx.exp(nll.mean())) < MAX_MODERN_PPL
    eot = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert {tokenizer.eos_token_id, eot} <= set(tokenizer.eos_token_ids)


def test_eval_json_on_any_english_text(tmp_path, capsys) -> None:
    text = tmp_path / "letter.txt"
    text.write_text(
        "Dear neighbour, the meeting about the new bridge has moved to Thursday evening. "
        "Please bring the drawings you showed us last week, and a copy of the budget. "
        "We will start at seven and expect to finish before nine, weather permitting. " * 10
    )
    # longer than the default's exact tokens (sinks, the last 128, a key group)
    rc = main(
        ["eval", "--model", "demo:full", "--text", str(text), "--context", "384",
         "--chunk", "32", "--windows", "1", "--json", "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "demo:full"
    (row,) = data["settings"][0]["texts"]
    assert row["text"] == "letter" and row["tokens_scored"] == 383
    assert 0 < row["kl_mean"] < 0.1 and 0.5 < row["top1"] <= 1.0
    assert 1 < row["ppl_base"] < 4096

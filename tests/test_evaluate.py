"""Quality evaluation: evaluate() on a tiny model, rotation exactness, CLI JSON."""

from __future__ import annotations

import json
import math

import mlx.core as mx
import pytest
from mlx_lm.models import gemma3_text

from mlx_kvq import evaluate as ev
from mlx_kvq.attention import quantized_attention
from mlx_kvq.commands import main
from mlx_kvq.config import AUTO_BLOCK_SIZE, KVConfig, QuantSpec
from mlx_kvq.quant import Store, rotate

CONTEXT, CHUNK, WINDOWS = 48, 16, 2


@pytest.fixture(scope="module")
def tiny():
    """A float32 gemma3_text: 2 sliding layers (window 16) and 1 full layer."""
    mx.random.seed(0)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=2, head_dim=64, vocab_size=128, num_key_value_heads=1,
        sliding_window=16, sliding_window_pattern=3, query_pre_attn_scalar=64,
    )  # fmt: skip
    model = gemma3_text.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    tokens = mx.random.randint(0, 128, (200,)).tolist()
    return model, tokens


def _eval(tiny, cfg, **kw):
    model, tokens = tiny
    kw = {"context": CONTEXT, "chunk": CHUNK, "windows": WINDOWS, "progress": False, **kw}
    return ev.evaluate(model, tokens, cfg, **kw)


def test_unquantized_against_itself_is_identical(tiny):
    r = _eval(tiny, KVConfig())
    assert math.isfinite(r["ppl_base"]) and r["ppl_base"] > 1
    assert r["ppl"] == r["ppl_base"]
    assert r["rel_ppl_change"] == 0.0
    assert r["kl_mean"] == 0.0 and r["kl_max"] == 0.0 and r["kl_p99"] == 0.0
    assert r["top1"] == 1.0
    assert r["windows"] == WINDOWS
    assert r["tokens_scored"] == WINDOWS * (CONTEXT - 1)
    assert r["bits_per_element"] == 32.0  # a float32 model's own caches
    assert r["rel_ppl_change_se"] == r["kl_mean_se"] == r["top1_se"] == 0.0


def test_quantized_settings_order_by_bits(tiny):
    model, tokens = tiny
    cfgs = [KVConfig(bits=8), KVConfig(bits=4), KVConfig(bits=8, rotation="hadamard")]
    r8, r4, r8rot = ev.evaluate_many(
        model, tokens, cfgs, context=CONTEXT, chunk=CHUNK, windows=WINDOWS, progress=False
    )
    for r in (r8, r4, r8rot):
        assert math.isfinite(r["ppl"]) and r["kl_mean"] >= -1e-6
        assert r["ppl_base"] == r8["ppl_base"]  # one shared unquantized run
    assert r8["kl_mean"] < 1e-2 and r8rot["kl_mean"] < 1e-2
    assert r8["kl_mean"] < r4["kl_mean"]
    assert r8["top1"] >= 0.9
    assert r4["rel_ppl_change_se"] > 0.0  # spread across the two windows
    assert r4["kl_mean_se"] > 0.0 and r4["kl_p99_se"] > 0.0
    assert r4["kl_mean"] <= r4["kl_p99"] <= r4["kl_max"]
    assert r8["bits_per_element"] == pytest.approx(8.5)
    assert r4["bits_per_element"] == pytest.approx(4.5)


def test_mixed_widths_count_bits(tiny):
    r = _eval(tiny, KVConfig(key_bits=3, value_bits=2, group_size=64))
    assert r["bits_per_element"] == pytest.approx(3.0)
    assert math.isfinite(r["ppl"])


def test_chunk_size_does_not_change_unquantized_scores(tiny):
    a = _eval(tiny, KVConfig(), chunk=16)
    b = _eval(tiny, KVConfig(), chunk=5)
    assert a["ppl_base"] == pytest.approx(b["ppl_base"], rel=1e-4)


def test_windows_and_bos():
    assert ev.window_starts(1000, 100, 1) == [0]
    assert ev.window_starts(50, 100, 4) == [0]
    s = ev.window_starts(1000, 100, 4)
    assert s[0] == 0 and s[-1] == 900 and len(s) == 4
    wins = ev.cut_windows(list(range(10, 30)), 5, 3, bos=1)
    assert all(w[0] == 1 and len(w) == 5 for w in wins)


# -- rotation is exact for attention -----------------------------------------------
def _qkv(seed=1, L=12, S=40, D=64, n_q=4, n_kv=2):
    mx.random.seed(seed)
    q = mx.random.normal((1, n_q, L, D))
    k = mx.random.normal((1, n_kv, S, D)) * mx.where(mx.arange(D) % 17 == 3, 10.0, 1.0)
    v = mx.random.normal((1, n_kv, S, D))
    return q, k, v


def test_rotation_is_orthonormal_and_self_inverse():
    x = mx.random.normal((3, 64))
    assert mx.allclose(rotate(rotate(x)), x, atol=1e-5)
    assert mx.allclose(mx.linalg.norm(rotate(x), axis=-1), mx.linalg.norm(x, axis=-1), atol=1e-4)


def test_rotation_leaves_scores_and_outputs_unchanged_in_float32():
    q, k, v = _qkv()
    scale = 64**-0.5
    scores = (q * scale) @ mx.repeat(k, 2, axis=1).swapaxes(-1, -2)
    scores_rot = (rotate(q) * scale) @ mx.repeat(rotate(k), 2, axis=1).swapaxes(-1, -2)
    assert mx.abs(scores - scores_rot).max().item() < 1e-4
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    out = rotate(
        mx.fast.scaled_dot_product_attention(
            rotate(q), rotate(k), rotate(v), scale=scale, mask="causal"
        )
    )
    assert mx.abs(ref - out).max().item() < 1e-4


def _dequantize32(x):
    """Dequantized in float32 (scales cast up first), back in the original basis."""
    w = mx.dequantize(
        x.data, x.scales.astype(mx.float32), x.biases.astype(mx.float32),
        group_size=x.group_size, bits=x.bits,
    )  # fmt: skip
    return rotate(w) if x.rotated else w


@pytest.mark.parametrize("bits", [8, 4])
def test_rotated_quantized_attention_equals_attention_on_its_dequantized_kv(bits):
    """Attention undoes the rotation exactly: the only error left is that of
    the quantized values themselves (same for both sides here)."""
    q, k, v = _qkv()
    scale = 64**-0.5
    spec = QuantSpec(bits, 64, "hadamard")
    kq, vq = Store.encode(k, spec).fetch(), Store.encode(v, spec).fetch()
    assert kq.rotated and vq.rotated
    out = quantized_attention(q, kq, vq, scale, mask="causal")
    ref = mx.fast.scaled_dot_product_attention(
        q, _dequantize32(kq), _dequantize32(vq), scale=scale, mask="causal"
    )
    assert mx.abs(out - ref).max().item() < 1e-4


def test_rotation_lowers_key_error_with_outlier_channels():
    q, k, v = _qkv()
    scale = 64**-0.5
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    errs = {}
    for rot in ("none", "hadamard"):
        kq = Store.encode(k, QuantSpec(4, 64, rot)).fetch()
        out = quantized_attention(q, kq, v, scale, mask="causal")
        errs[rot] = (mx.linalg.norm(out - ref) / mx.linalg.norm(ref)).item()
    assert errs["hadamard"] < errs["none"]


# -- command line -------------------------------------------------------------------
def test_cli_json_is_well_formed(tiny, monkeypatch, capsys):
    model, tokens = tiny
    texts = {"a": (tokens, None), "b": (tokens[::-1], None)}
    monkeypatch.setattr(ev, "load_eval_inputs", lambda m, t, dtype="auto": (model, None, texts))
    rc = main(
        ["eval", "--kv-bits", "4", "--kv-rotation", "hadamard", "--context", str(CONTEXT),
         "--chunk", str(CHUNK), "--windows", "2", "--json", "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    (one,) = data["settings"]
    assert [t["text"] for t in one["texts"]] == ["a", "b"]
    keys = ("ppl_base", "ppl", "rel_ppl_change", "kl_mean", "kl_mean_se", "kl_p99", "top1")
    for t in one["texts"]:
        for key in (*keys, "top1_se", "rel_ppl_change_se"):
            assert isinstance(t[key], float) and math.isfinite(t[key])
    assert one["bits_per_element"] == pytest.approx(4.5)
    assert one["held_context"] == 2048 and one["kv_bytes"] > 0
    assert one["kv_config"]["rotation"] == "hadamard" and one["kv_config"]["bits"] == 4
    assert one["setting"] == "K 4b/g64+rot V 4b/g64+rot"


def test_cli_scores_several_settings_against_one_reference(tiny, monkeypatch, capsys):
    model, tokens = tiny
    monkeypatch.setattr(
        ev, "load_eval_inputs", lambda m, t, dtype="auto": (model, None, {"a": (tokens, None)})
    )
    rc = main(
        ["eval", "--kv-group-size", "32", "--setting", "--kv-bits 8", "--setting",
         "--kv-key-bits 4 --kv-value-bits 0", "--setting", "--kv-bits 4 --kv-group-size 64",
         "--context", str(CONTEXT), "--chunk", str(CHUNK), "--windows", "2", "--json",
         "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    names = [s["setting"] for s in data["settings"]]
    # The flags outside --setting apply to every setting that does not set them.
    assert names == ["K 8b/g32 V 8b/g32", "K 4b/g32 V fp16", "K 4b/g64 V 4b/g64"]
    bases = {s["texts"][0]["ppl_base"] for s in data["settings"]}
    assert len(bases) == 1  # one unquantized reference, shared
    kl = [s["texts"][0]["kl_mean"] for s in data["settings"]]
    assert kl[0] < kl[2] and kl[0] < kl[1]
    assert all(s["seconds"] > 0 for s in data["settings"]) and data["reference_seconds"] > 0
    # The same setting alone measures the same figures (in the server's layout).
    (alone,) = ev.evaluate_many(
        model, tokens, [KVConfig(bits=8, group_size=32)], context=CONTEXT, chunk=CHUNK,
        windows=2, progress=False, block_size=AUTO_BLOCK_SIZE,
    )  # fmt: skip
    assert alone["kl_mean"] == pytest.approx(kl[0], rel=1e-5)
    with pytest.raises(SystemExit) as e:
        main(["eval", "--setting", "--kv-bits 7"])
    assert e.value.code == 2


def test_cli_table_and_bad_setting(tiny, monkeypatch, capsys):
    model, tokens = tiny
    monkeypatch.setattr(
        ev, "load_eval_inputs", lambda m, t, dtype="auto": (model, None, {"a": (tokens, None)})
    )
    assert main(["eval", "--kv-key-bits", "8", "--context", "32", "--chunk", "16", "--windows", "1",
                    "--no-progress"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "KV K 8b/g64 V fp16" in out and "\n| a | " in out
    with pytest.raises(SystemExit):
        main(["eval", "--kv-bits", "7"])


def test_decode_tail_feeds_one_token_at_a_time(tiny):
    assert ev._spans(10, 4, 3) == [(0, 4), (4, 7), (7, 8), (8, 9), (9, 10)]
    assert ev._spans(5, 4, 9) == [(i, i + 1) for i in range(5)]
    model, tokens = tiny
    # 24 decode steps run the sliding rings (window 16) past their wrap point.
    chunked, rq = ev.evaluate_many(
        model, tokens, [KVConfig(), KVConfig(bits=8)], context=CONTEXT, chunk=CHUNK,
        windows=1, progress=False,
    )  # fmt: skip
    decoded, rq_dec = ev.evaluate_many(
        model, tokens, [KVConfig(), KVConfig(bits=8)], context=CONTEXT, chunk=CHUNK,
        windows=1, progress=False, decode=24,
    )  # fmt: skip
    assert decoded["decode"] == 24 and decoded["kl_mean"] == 0.0
    assert decoded["ppl_base"] == pytest.approx(chunked["ppl_base"], rel=1e-4)
    assert rq_dec["kl_mean"] < 1e-2 and rq_dec["top1"] >= 0.9
    # Quantizing a token does not depend on how it arrived: same scores either way.
    assert rq_dec["ppl"] == pytest.approx(rq["ppl"], rel=1e-3)


def test_cli_defaults_to_the_default_setting_and_zero_turns_it_off(tiny, monkeypatch, capsys):
    from mlx_kvq.defaults import DEFAULT_KV_CONFIG

    model, tokens = tiny
    monkeypatch.setattr(
        ev, "load_eval_inputs", lambda m, t, dtype="auto": (model, None, {"a": (tokens, None)})
    )
    common = ["--context", "32", "--chunk", "16", "--windows", "1", "--json", "--no-progress"]
    assert main(["eval", *common]) == 0
    (data,) = json.loads(capsys.readouterr().out)["settings"]
    assert data["setting"] == DEFAULT_KV_CONFIG.describe()
    # the layout the server holds (its block size): eval scores what it serves
    assert data["paged_layers"] > 0
    assert main(["eval", "--kv-block-size", "0", *common]) == 0
    (own,) = json.loads(capsys.readouterr().out)["settings"]
    assert own["paged_layers"] == 0
    assert main(["eval", "--kv-bits", "0", *common]) == 0
    (data,) = json.loads(capsys.readouterr().out)["settings"]
    t = data["texts"][0]
    assert t["kl_mean"] == 0.0 and t["top1"] == 1.0 and data["bits_per_element"] == 32.0

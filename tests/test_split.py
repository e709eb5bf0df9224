"""The split layout: exact sinks and residual around a quantized body, per-channel keys."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from mlx_lm.models import gemma3_text

from mlx_kvq import attention
from mlx_kvq import evaluate as ev
from mlx_kvq.caches import (
    KVQSplitBatchCache,
    KVQSplitBatchWindowCache,
    KVQSplitCache,
    KVQSplitChunkedCache,
    KVQSplitWindowCache,
    cache_report,
)
from mlx_kvq.config import KVConfig, QuantSpec
from mlx_kvq.generate import get_plan
from mlx_kvq.quant import SplitKV
from mlx_kvq.split import SplitStore

D = 64


def _kv(n: int, seed: int, heads: int = 2, dtype=mx.float16) -> tuple[mx.array, mx.array]:
    k1, k2 = mx.random.split(mx.random.key(seed))
    k = mx.random.normal((1, heads, n, D), key=k1)
    k = k * mx.where(mx.arange(D) % 16 == 3, 12.0, 1.0)  # outlier channels, fixed across tokens
    v = mx.random.normal((1, heads, n, D), key=k2)
    return k.astype(dtype), v.astype(dtype)


def _spec(bits=4, group=32, per_channel=True, sinks=4, residual=8, rotation="none"):
    return QuantSpec(bits, group, rotation, per_channel, sinks, residual)


@pytest.mark.parametrize("per_channel", [True, False])
def test_store_parts_follow_the_spec_whatever_the_chunks(per_channel):
    k_spec = _spec(per_channel=per_channel)
    v_spec = _spec(per_channel=False)
    keys, values = _kv(180, 0)
    one, steps = SplitStore(k_spec, v_spec), SplitStore(k_spec, v_spec)
    one.append(keys, values)
    done = 0
    for n in (3, 50, 1, 1, 20, 64, 41):
        steps.append(keys[..., done : done + n, :], values[..., done : done + n, :])
        done += n
        s = steps
        assert s.head_len == min(4, done) and s.offset == done
        unit = 32 if per_channel else 1
        assert s.body_len % unit == 0
        if done > 4 + 8 + unit:
            assert 8 <= s.tail_len < 8 + unit
    # where a token is stored does not depend on how it arrived
    for a, b in zip(one.fetch(), steps.fetch(), strict=True):
        assert a.lengths == b.lengths
        assert mx.array_equal(a.dequantize(mx.float32), b.dequantize(mx.float32)).item()
    k, v = one.dequantize(mx.float32)
    exact = mx.concatenate([keys[..., :4, :], keys[..., -one.tail_len :, :]], axis=2)
    got = mx.concatenate([k[..., :4, :], k[..., -one.tail_len :, :]], axis=2)
    assert mx.array_equal(got, exact.astype(mx.float32)).item()  # head and tail unquantized
    body = keys[..., 4 : 4 + one.body_len, :].astype(mx.float32)
    err = mx.abs(k[..., 4 : 4 + one.body_len, :] - body)
    # within one 4-bit step of each group's range (MLX's affine rounding)
    g = (1, 2, -1, 32, D) if per_channel else (1, 2, -1, 1, D)
    axis = 3 if per_channel else 4
    step = (body.reshape(g).max(axis) - body.reshape(g).min(axis)) / 15
    assert 0 < (err.reshape(g).max(axis) / step).max().item() <= 1.0
    # bytes: 16-bit exact parts, packed body with its scales and biases
    tokens, heads = one.held, 2
    exact_b = (one.head_len + one.tail_len) * heads * D * 2 * 2
    body_b = one.body_len * heads * D * 2 * (4 / 8 + 4 / 32)
    assert one.nbytes >= exact_b + body_b and tokens == 180


def test_per_channel_scales_follow_outlier_channels():
    keys, values = _kv(256, 1, dtype=mx.float32)
    errs = {}
    for per_channel in (False, True):
        s = SplitStore(
            _spec(per_channel=per_channel, sinks=0, residual=0), _spec(per_channel=False)
        )
        s.append(keys, values)
        k, _ = s.dequantize(mx.float32)
        errs[per_channel] = mx.abs(k - keys)[..., : s.body_len, :].mean().item()
    assert errs[True] < 0.5 * errs[False]


def _dense(q, k: SplitKV, v: SplitKV, scale, mask):
    kd, vd = k.dequantize(mx.float32), v.dequantize(mx.float32)
    return mx.fast.scaled_dot_product_attention(q, kd, vd, scale=scale, mask=mask)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
@pytest.mark.parametrize("L", [1, 3, 24])
def test_split_attention_equals_attention_on_its_dequantized_kv(monkeypatch, native, rotation, L):
    if not native:
        monkeypatch.setattr(attention, "_native", lambda: False)
    k_spec = _spec(rotation=rotation)
    v_spec = _spec(per_channel=False, rotation=rotation)
    s = SplitStore(k_spec, v_spec)
    keys, values = _kv(300, 2, dtype=mx.float32)
    s.append(keys, values)
    k, v = s.fetch()
    assert k.body.per_channel and k.lengths == (4, s.body_len, s.tail_len)
    q = mx.random.normal((1, 6, L, D), key=mx.random.key(3))
    mask = "causal" if L > 1 else None
    got = attention.scaled_dot_product_attention(q, k, v, None, scale=0.125, mask=mask)
    want = _dense(q, k, v, 0.125, mask)
    assert mx.allclose(got, want, atol=2e-4, rtol=1e-3).item()


def test_causal_query_blocks_read_no_later_key_group(monkeypatch):
    """A prefill longer than a query block: each block reads the split
    layout's keys only up to its last row (`SplitKV.reach` / `upto`: a
    per-channel body cut at whole groups), and gets what attention over the
    whole dequantized cache gets."""
    s = SplitStore(_spec(), _spec(per_channel=False))
    keys, values = _kv(800, 4, dtype=mx.float32)
    s.append(keys, values)
    k, v = s.fetch()
    h, b, t = k.lengths
    assert (k.reach(1), k.reach(h + 1), k.reach(h + 32), k.reach(h + b + 1)) == (
        h, h + 32, h + 32, h + b + 1,
    )  # fmt: skip
    assert k.upto(h + 32).lengths == (h, 32, 0) and v.upto(h + b + 1).lengths == (h, b, 1)
    L = 700  # blocks of 512 query rows: the first sees keys [0, 612)
    q = mx.random.normal((1, 6, L, D), key=mx.random.key(5))
    read = []
    attend = attention._attend
    monkeypatch.setattr(
        attention, "_attend", lambda q, k, *a: read.append(k.shape[2]) or attend(q, k, *a)
    )
    got = attention.scaled_dot_product_attention(q, k, v, None, scale=0.125, mask="causal")
    assert read == [k.reach(100 + 512), 800]  # the first block stops at its last row's group
    want = _dense(q, k, v, 0.125, "causal")
    assert mx.allclose(got, want, atol=2e-4, rtol=1e-3).item()


def _tiny(dtype=mx.float16):
    mx.random.seed(0)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
        num_attention_heads=2, head_dim=64, vocab_size=128, num_key_value_heads=1,
        sliding_window=16, sliding_window_pattern=3, query_pre_attn_scalar=64,
    )  # fmt: skip
    model = gemma3_text.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def test_every_token_exact_computes_what_mlx_lm_computes():
    """Residual longer than the text: nothing is quantized, so the split caches
    (windows with their masks, the full layer, chunked prefill then decode)
    give the unquantized model's distributions, up to attention's float32 sums."""
    model = _tiny()
    tokens = mx.random.randint(0, 128, (200,), key=mx.random.key(4)).tolist()
    cfg = KVConfig(bits=4, key_scales="channel", key_group_size=32, residual=1000, sinks=4)
    plan = get_plan(model, cfg)
    assert {type(c) for c in plan.make_cache()} == {KVQSplitCache, KVQSplitWindowCache}
    r = ev.evaluate(model, tokens, cfg, context=90, chunk=16, windows=2, progress=False, decode=20)
    assert r["kl_mean"] < 1e-4 and r["top1"] > 0.98


def test_windows_stay_bounded_and_quantize_as_they_age():
    model = _tiny(mx.float32)
    cfg = KVConfig(bits=4, key_scales="channel", key_group_size=32, residual=8, sinks=4)
    caches = get_plan(model, cfg).make_cache()
    ids = mx.random.randint(0, 128, (1, 150), key=mx.random.key(5))
    model(ids[:, :100], cache=caches)
    for t in range(100, 150):
        mx.eval(model(ids[:, t : t + 1], cache=caches))
        for c in caches:
            if isinstance(c, KVQSplitWindowCache):
                assert c.size() <= c.max_size + 31 and c.store.head_len == 0
            else:
                assert c.size() == t + 1 and c.store.head_len == 4
    assert all(r["quantized"] for r in cache_report(caches))


def test_window_mask_is_what_positions_say():
    spec_k, spec_v = _spec(sinks=0, residual=4), _spec(per_channel=False, sinks=0, residual=4)
    w = KVQSplitWindowCache(40, spec_k, spec_v)
    keys, values = _kv(200, 6, heads=1)
    done = 0
    for n in (30, 30, 1, 1, 25, 1, 7, 1):
        mask = w.make_mask(n, window_size=40)
        k, _ = w.update_and_fetch(keys[..., done : done + n, :], values[..., done : done + n, :])
        pos = mx.arange(w.store.first, done + n)
        q = mx.arange(done, done + n)[:, None]
        want = (pos[None] <= q) & (pos[None] > q - 40)
        assert k.shape[2] == pos.size
        if mask is None:
            assert want.all().item()
        elif isinstance(mask, str):
            assert mask == "causal" and mx.array_equal(want, pos[None] <= q).item()
        else:
            assert mx.array_equal(mask, want).item()
        done += n


def test_rewind_restores_what_the_window_saw():
    spec_k, spec_v = _spec(sinks=0, residual=4), _spec(per_channel=False, sinks=0, residual=4)
    w = KVQSplitWindowCache(40, spec_k, spec_v)
    w.set_rewind(6)
    keys, values = _kv(160, 7, heads=1)
    w.update_and_fetch(keys[..., :150, :], values[..., :150, :])
    before = w.keys_and_values()[0].dequantize(mx.float32)
    for t in range(150, 156):
        w.update_and_fetch(keys[..., t : t + 1, :], values[..., t : t + 1, :])
    assert w.trim(6) == 6 and w.offset == 150
    after = w.keys_and_values()[0].dequantize(mx.float32)
    visible = 40 - 1  # what the next query sees before its own token
    assert mx.allclose(after[..., -visible:, :], before[..., -visible:, :], atol=2e-3).item()


def test_chunked_cache_reports_where_its_run_starts():
    spec_k, spec_v = _spec(sinks=0, residual=0), _spec(per_channel=False, sinks=0, residual=0)
    c = KVQSplitChunkedCache(64, spec_k, spec_v)
    keys, values = _kv(200, 8, heads=1)
    done = 0
    for n in (50, 50, 50, 1, 1):
        c.maybe_trim_front()
        k, _ = c.update_and_fetch(keys[..., done : done + n, :], values[..., done : done + n, :])
        done += n
        assert c.start_position + k.shape[2] == done == c.offset
        assert c.start_position <= max(0, done - n - 64)


def test_batch_rows_compute_what_each_sequence_computes():
    model = _tiny(mx.float32)
    cfg = KVConfig(bits=4, key_scales="channel", key_group_size=32, residual=8, sinks=4)
    plan = get_plan(model, cfg)
    a = mx.random.randint(0, 128, (1, 70), key=mx.random.key(9))
    b = mx.random.randint(0, 128, (1, 45), key=mx.random.key(10))
    ca, cb = plan.make_cache(), plan.make_cache()
    model(a, cache=ca)
    model(b, cache=cb)
    batch = [type(x).merge([x, y]) for x, y in zip(ca, cb, strict=True)]
    assert {type(c) for c in batch} == {KVQSplitBatchCache, KVQSplitBatchWindowCache}
    step = mx.array([[5], [7]])
    got = model(step, cache=batch)[:, -1]
    want_a = model(step[:1], cache=ca)[:, -1]
    want_b = model(step[1:], cache=cb)[:, -1]
    assert mx.allclose(got[0], want_a[0], atol=1e-4).item()
    assert mx.allclose(got[1], want_b[0], atol=1e-4).item()
    # a right-padded prompt: the padding is dropped at finalize, nothing of it quantized
    for c in batch:
        c.prepare(lengths=[3, 1], right_padding=[0, 2])
    model(mx.array([[1, 2, 3], [4, 0, 0]]), cache=batch)
    for c in batch:
        c.finalize()
    model(mx.array([[1, 2, 3]]), cache=ca)
    model(mx.array([[4]]), cache=cb)
    got = model(step, cache=batch)[:, -1]
    assert mx.allclose(got[1], model(step[1:], cache=cb)[0, -1], atol=1e-4).item()
    assert mx.allclose(got[0], model(step[:1], cache=ca)[0, -1], atol=1e-4).item()
    one = batch[2].extract(1)
    assert type(one) is KVQSplitCache and one.offset == cb[2].offset


def test_prompt_file_round_trip(tmp_path):
    from mlx_kvq.generate import load_prompt_cache, save_prompt_cache

    model = _tiny(mx.float32)
    cfg = KVConfig(bits=4, key_scales="channel", key_group_size=32, residual=8, sinks=4)
    caches = get_plan(model, cfg).make_cache()
    ids = mx.random.randint(0, 128, (1, 90), key=mx.random.key(11))
    model(ids, cache=caches)
    path = str(tmp_path / "p.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path, expect=cfg)
    for a, b in zip(caches, loaded, strict=True):
        assert type(a) is type(b) and a.offset == b.offset and a.size() == b.size()
        ka, kb = a.keys_and_values()[0], b.keys_and_values()[0]
        assert mx.array_equal(ka.dequantize(mx.float32), kb.dequantize(mx.float32)).item()
    step = mx.array([[3]])
    assert mx.allclose(model(step, cache=caches), model(step, cache=loaded), atol=1e-5).item()


def test_plan_declares_the_layout_per_kind_and_counts_its_bytes():
    model = _tiny(mx.float32)
    cfg = KVConfig(bits=4, value_bits=3, key_scales="channel", key_group_size=32, residual=8,
                   sinks=4)  # fmt: skip
    plan = get_plan(model, cfg)
    full = [p for p in plan.layers if p.kind == "full"][0]
    sliding = [p for p in plan.layers if p.kind == "sliding"][0]
    assert "K 4b/c32 V 3b/g64, 4 sinks + 8 recent exact" in full.label()
    assert sliding.key_spec.sinks == 0 and "8 recent exact" in sliding.label()
    held = ev.held_storage(model, cfg, 500)
    est = plan.estimate(500)
    assert held["bytes"] <= est["bytes"] <= 1.3 * held["bytes"]
    assert math.isclose(held["bits_per_element"], 8 * held["bytes"] / (held["fp16_bytes"] / 2))


def test_bad_split_settings_are_refused():
    with pytest.raises(ValueError, match="needs quantized keys"):
        KVConfig(bits=4, key_bits=0, key_scales="channel")
    with pytest.raises(ValueError, match="shape a quantized cache"):
        KVConfig(residual=8)
    with pytest.raises(ValueError, match=">= 0"):
        QuantSpec(4, residual=-1)

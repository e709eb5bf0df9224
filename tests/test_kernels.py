"""The native CPU kernels: built by a plain install on Linux, equal to MLX's
dequantize-then-multiply, and a clean fallback when they are not there."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from kvq_testing.helpers import tiny_model

from mlx_kvq import attention, kernels
from mlx_kvq.config import QuantSpec
from mlx_kvq.quant import QuantizedKV, Store

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="built on Linux only")
EVERY_WIDTH = pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])  # every packed width
EVERY_GROUP = pytest.mark.parametrize("gs", [32, 64, 128])


@linux
def test_built_and_in_use_after_a_plain_install():
    status = kernels.native_status()
    assert status.available, status.reason
    assert mx.__version__ in status.reason


def _packed(rng, shape, bits, gs, scale_dtype, extra=7):
    """Packed K/V as caches hand them out: a token-axis view of a longer buffer."""
    x = mx.array(rng.standard_normal((*shape[:2], shape[2] + extra, shape[3])).astype(np.float32))
    w, s, b = mx.quantize(x, group_size=gs, bits=bits)
    view = QuantizedKV(w, s.astype(scale_dtype), b.astype(scale_dtype), bits, gs)
    view = view.map(lambda a: a[..., : shape[2], :])
    dense = mx.dequantize(
        view.data, view.scales.astype(mx.float32), view.biases.astype(mx.float32),
        group_size=gs, bits=bits,
    )  # fmt: skip
    return view, dense


@linux
@EVERY_WIDTH
@EVERY_GROUP
def test_kernels_equal_dequantize_then_multiply(bits, gs):
    assert kernels.native_status().available
    rng = np.random.default_rng(bits * 1000 + gs)
    scale_dtype = {32: mx.float16, 64: mx.bfloat16, 128: mx.float32}[gs]
    k, kd = _packed(rng, (2, 3, 611, 128), bits, gs, scale_dtype)
    q = mx.array(rng.standard_normal((2, 3, 5, 128)).astype(np.float32))
    p = mx.softmax(mx.array(rng.standard_normal((2, 3, 5, 611)).astype(np.float32)), axis=-1)
    scores, weighted = kernels.packed_scores(q, k), kernels.packed_weighted(p, k)
    assert scores.dtype == weighted.dtype == mx.float32
    np.testing.assert_allclose(scores, q @ kd.swapaxes(-1, -2), atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(weighted, p @ kd, atol=2e-5, rtol=1e-4)


@linux
@EVERY_WIDTH
@EVERY_GROUP
def test_channel_kernel_equals_dequantize_then_multiply(bits, gs):
    """Per-channel keys (channel-major, packed along the tokens) at every width."""
    assert kernels.native_status().available
    rng = np.random.default_rng(bits * 100 + gs)
    N = 3 * 128
    x = mx.array(rng.standard_normal((2, 3, N, 64)).astype(np.float32))
    w, s, b = mx.quantize(x.swapaxes(-1, -2), group_size=gs, bits=bits)
    k = QuantizedKV(w, s.astype(mx.float16), b.astype(mx.float16), bits, gs, False, True)
    kd = mx.dequantize(w, s.astype(mx.float16).astype(mx.float32),
                       b.astype(mx.float16).astype(mx.float32), group_size=gs, bits=bits)  # fmt: skip
    q = mx.array(rng.standard_normal((2, 3, 5, 64)).astype(np.float32))
    np.testing.assert_allclose(kernels.channel_scores(q, k), q @ kd, atol=2e-4, rtol=1e-4)


@linux
def test_kernels_broadcast_one_cache_over_batch_and_take_transposed_rows():
    rng = np.random.default_rng(0)
    k, kd = _packed(rng, (1, 2, 300, 64), 4, 64, mx.float16)
    q = mx.array(rng.standard_normal((3, 5, 2, 64)).astype(np.float32)).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(
        kernels.packed_scores(q, k), q @ kd.swapaxes(-1, -2), atol=2e-4, rtol=1e-4
    )


@linux
@pytest.mark.parametrize("key_bits,value_bits,rotation", [(4, 3, "hadamard"), (8, 4, "none")])
@pytest.mark.parametrize("mask", [None, "causal", "sinks"])
def test_decode_attention_same_with_and_without_the_kernels(
    monkeypatch, key_bits, value_bits, rotation, mask
):
    """The native decode path (in place on the views) and MLX's operations
    (per-head split, quantized_matmul) give the same attention."""
    rng = np.random.default_rng(key_bits)
    B, n_q, n_kv, L, S, D = 2, 8, 2, 1, 4100, 64
    x = mx.array(rng.standard_normal((B, n_kv, S + 60, D)).astype(np.float32))
    keys = Store.encode(x, QuantSpec(key_bits, 64, rotation)).fetch()
    values = Store.encode(-x, QuantSpec(value_bits, 64, rotation)).fetch()
    keys, values = (v.map(lambda a: a[..., :S, :]) for v in (keys, values))
    q = mx.array(rng.standard_normal((B, n_q, L, D)).astype(np.float32))
    sinks = mx.array(rng.standard_normal(n_q).astype(np.float32)) if mask == "sinks" else None
    m = "causal" if mask == "sinks" else mask
    native = attention.quantized_attention(q, keys, values, 0.125, m, sinks)
    monkeypatch.setattr(attention, "_native", lambda: False)
    fallback = attention.quantized_attention(q, keys, values, 0.125, m, sinks)
    np.testing.assert_allclose(native, fallback, atol=1e-5, rtol=1e-4)


def _softmax_reference(scores, shift, window, n_rep, sinks):
    """MLX's softmax under the mask `Causal` describes, sinks as a first column."""
    B, H, R, S = scores.shape
    rows = R // n_rep
    m = attention.Causal(shift, window)
    seen = m.array(rows, S)
    seen = mx.broadcast_to(seen[:, :, 0] if seen.ndim == 5 else seen, (B, 1, rows, S))
    seen = mx.tile(seen, (1, 1, n_rep, 1))
    logits = mx.where(seen, scores, -mx.inf)
    if sinks is None:
        return mx.softmax(logits, axis=-1, precise=True)
    column = mx.broadcast_to(sinks.reshape(1, H, n_rep, 1, 1), (B, H, n_rep, rows, 1))
    logits = mx.concatenate([column.reshape(B, H, R, 1), logits], axis=-1)
    return mx.softmax(logits, axis=-1, precise=True)[..., 1:]


@linux
@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_causal_softmax_equals_masked_softmax(window, with_sinks):
    """Per-sequence shifts (paged rows of different lengths), a window, sinks,
    rows that see no key at all (all zeros, or all weight on the sink)."""
    rng = np.random.default_rng(window + with_sinks)
    B, H, n_rep, rows, S = 3, 2, 3, 13, 75
    scores = mx.array(8 * rng.standard_normal((B, H, n_rep * rows, S)).astype(np.float32))
    sinks = mx.array(rng.standard_normal(H * n_rep).astype(np.float32)) if with_sinks else None
    shift = (40, 61, -3)  # the last sequence's first three rows see nothing
    got = kernels.causal_softmax(scores, shift, window, n_rep, sinks)
    want = _softmax_reference(scores, shift, window, n_rep, sinks)
    np.testing.assert_allclose(got, mx.where(mx.isnan(want), 0, want), atol=1e-6, rtol=1e-5)
    assert mx.all(got[2, :, :3] == 0).item()


@linux
def test_causal_softmax_does_not_depend_on_where_the_keys_are_cut():
    """A row cut to the keys it sees (`Causal.visible`), or padded with masked
    slots, computes bit for bit what the whole row computes: every layout of
    the same keys (padded rows, paged rows, trimmed blocks) agrees exactly."""
    rng = np.random.default_rng(3)
    scores = mx.array(rng.standard_normal((1, 1, 7, 300)).astype(np.float32))
    whole = kernels.causal_softmax(scores, (250,), 100, 1, None)
    lo, hi = attention.Causal((250,), 100).visible(7, 300)
    assert lo % 8 == 0 and 0 < lo and hi == 257
    cut = kernels.causal_softmax(scores[..., lo:hi], (250 - lo,), 100, 1, None)
    assert mx.array_equal(cut, whole[..., lo:hi]).item()
    assert mx.all(whole[..., hi:] == 0).item() and mx.all(whole[..., :lo] == 0).item()
    masked = mx.where(attention.Causal((250,), 100).array(7, 300), scores, -mx.inf)
    free = kernels.causal_softmax(masked, (299,), 0, 1, None)  # every key, masked by -inf
    assert mx.array_equal(free, whole).item()


@linux
@pytest.mark.parametrize("window", [None, 200])
def test_raw_prefill_through_the_native_softmax_equals_mx_fast(monkeypatch, window):
    """A long prefill chunk over raw K/V (query blocks, keys cut to what each
    block sees, the native softmax) is the attention mx.fast computes."""
    rng = np.random.default_rng(5)
    B, n_q, n_kv, L, S, D = 1, 6, 2, 700, 1500, 64
    q = mx.array(rng.standard_normal((B, n_q, L, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((B, n_kv, S, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, n_kv, S, D)).astype(np.float32))
    monkeypatch.setattr(attention, "_QUERY_BLOCK", 128)
    mask = "causal" if window is None else attention.Causal((S - L,), window)
    got = attention.quantized_attention(q, k, v, 0.125, mask)
    dense = mask if window is None else mask.array(L, S)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=dense)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


@linux
def test_cpu_prefill_over_raw_kv_takes_the_native_softmax(monkeypatch):
    """mlx-lm's attention call with raw K/V and a "causal" prefill chunk runs
    through the native softmax on the CPU (not mx.fast's CPU path), with
    mx.fast's result; a decode row keeps mx.fast."""
    calls = []
    inner = attention.causal_softmax
    monkeypatch.setattr(
        attention, "causal_softmax", lambda *a, **k: calls.append(1) or inner(*a, **k)
    )
    rng = np.random.default_rng(8)
    q = mx.array(rng.standard_normal((1, 4, 40, 32)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 90, 32)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, 90, 32)).astype(np.float32))
    got = attention.scaled_dot_product_attention(q, k, v, None, 0.2, "causal")
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    assert calls
    calls.clear()
    attention.scaled_dot_product_attention(q[:, :, :1], k, v, None, 0.2, None)
    assert not calls


def test_fallbacks_say_why(monkeypatch):
    """Turned off, missing, or built for another MLX: not used, and the
    status names the reason; attention then runs MLX's operations."""
    env = {**os.environ, kernels.ENV: "0"}
    code = (
        "from mlx_kvq import kernels; s = kernels.native_status(); print(s.available, s.summary())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.startswith("False no native CPU kernels: MLX_KVQ_NATIVE=0")

    class OtherBuild:
        built_for_mlx = "0.0.1"

    def fake_import(name):
        if name.endswith("._native"):
            return OtherBuild
        raise AssertionError(name)

    monkeypatch.setattr(kernels, "_status", None)
    monkeypatch.setattr(kernels.importlib, "import_module", fake_import)
    status = kernels.native_status()
    assert not status.available
    assert "built for MLX 0.0.1" in status.reason and "pip install -e ." in status.reason
    assert not attention._native()

    class IncompatibleBuild:
        built_for_mlx = mx.__version__

        @staticmethod
        def packed_scores(*args):
            raise TypeError("packed_scores(): incompatible function arguments")

    monkeypatch.setattr(kernels, "_status", None)
    monkeypatch.setattr(kernels.importlib, "import_module", lambda name: IncompatibleBuild)
    status = kernels.native_status()
    assert not status.available and "TypeError" in status.reason

    def missing(name):
        raise ImportError("No module named 'mlx_kvq._native'")

    monkeypatch.setattr(kernels, "_status", None)
    monkeypatch.setattr(kernels.importlib, "import_module", missing)
    assert "not built" in kernels.native_status().reason


@linux
def test_log_softmax_rows_are_closer_to_float64_than_mlx():
    """The log-softmax every decode step takes over the vocabulary: rows of
    odd width (a vector tail), a row of equal logits, very negative ones;
    within float32 rounding of the float64 result, and no further from it
    than MLX's own `x - logsumexp(x)`."""
    rng = np.random.default_rng(11)
    x = (6 * rng.standard_normal((5, 49_157))).astype(np.float32)
    x[1] = 3.0
    x[2, ::2] = -1e4
    got = np.array(attention.log_softmax(mx.array(x)))
    mlx = np.array(mx.array(x) - mx.logsumexp(mx.array(x), axis=-1, keepdims=True))
    xd = x.astype(np.float64)
    top = xd.max(-1, keepdims=True)
    want = xd - (top + np.log(np.exp(xd - top).sum(-1, keepdims=True)))
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-6)
    assert np.abs(got - want).max() <= np.abs(mlx - want).max()
    np.testing.assert_allclose(got[1], -np.log(49_157), rtol=1e-6)


@linux
def test_decode_steps_normalize_through_the_native_log_softmax(monkeypatch):
    """The engine's batch (mlx-lm's BatchGenerator, its decoding batch ours)
    normalizes each step's logits with the native kernel on the CPU, and
    decodes what mlx-lm's own batch decodes."""
    from mlx_lm.generate import BatchGenerator

    from mlx_kvq import mlx_lm_internals
    from mlx_kvq.engine import runner

    model = tiny_model("llama")
    prompts = [[5, 9, 13, 2, 7], [3, 3, 8]]

    def decode(ours: bool) -> list[list[int]]:
        bg = BatchGenerator(model)
        if ours:
            mlx_lm_internals.decode_with(bg, runner.log_softmax)
        uids = bg.insert(prompts, max_tokens=[6, 6])
        out = {u: [] for u in uids}
        while any(len(v) < 6 for v in out.values()):
            for r in bg.next()[1]:
                out[r.uid].append(r.token)
        return [out[u] for u in uids]

    calls = []
    inner = kernels.log_softmax
    monkeypatch.setattr(
        attention, "native_log_softmax", lambda x: calls.append(x.shape) or inner(x)
    )
    assert decode(True) == decode(False)
    assert calls and all(shape[0] in (1, 2) for shape in calls)

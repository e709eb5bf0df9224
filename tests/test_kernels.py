"""The native CPU kernels: built by a plain install on Linux, equal to MLX's
dequantize-then-multiply, and a clean fallback when they are not there."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

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

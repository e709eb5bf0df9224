"""`quantized_attention` against `mx.fast.scaled_dot_product_attention` run on
the dequantized keys/values: every mask form mlx-lm models pass, grouped
queries, sinks, rotated stores, different key/value bits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kvq_testing.helpers import dequantize_f32

from mlx_kvq import attention
from mlx_kvq.config import QuantSpec
from mlx_kvq.quant import QuantizedKV, Store

D = 64


def _qkv(rng, b, n_q, n_kv, L, S, dv=D):
    q = rng.standard_normal((b, n_q, L, D)).astype(np.float32)
    k = rng.standard_normal((b, n_kv, S, D)).astype(np.float32)
    v = rng.standard_normal((b, n_kv, S, dv)).astype(np.float32)
    return mx.array(q), mx.array(k), mx.array(v)


def _pack(x, spec: QuantSpec):
    return Store.encode(x, spec).fetch()


def _plain(x):
    return dequantize_f32(x, unrotate=True) if isinstance(x, QuantizedKV) else x


def _reference(q, k, v, scale, mask, sinks=None):
    """mx.fast on float32 copies of exactly what the packed store holds."""
    return mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32), _plain(k), _plain(v), scale=scale, mask=mask,
        sinks=None if sinks is None else sinks.astype(mx.float32),
    )  # fmt: skip


def _masks(rng, b, L, S):
    offset = S - L
    causal = mx.arange(offset, S)[:, None] >= mx.arange(S)[None]
    window = causal & (mx.arange(offset, S)[:, None] < mx.arange(S)[None] + 5)
    additive = mx.where(window, 0.0, -1e9).astype(mx.float32) + mx.array(
        rng.standard_normal((L, S)).astype(np.float32) * 0.1
    )
    left = mx.array(rng.integers(0, max(1, S - 2), size=b))
    padded = causal[None, None] & (mx.arange(S)[None, None, None] >= left[:, None, None, None])
    return {
        "none": None,
        "causal": "causal",
        "bool": window,
        "additive": additive,
        "batched_left_padded": padded,
    }


CASES = [
    # b, n_q, n_kv, L, S
    (1, 4, 4, 1, 37),
    (2, 8, 2, 1, 70),
    (2, 8, 2, 6, 20),
    (1, 4, 1, 13, 13),
    (3, 6, 3, 4, 9),
]
MASKS = ["none", "causal", "bool", "additive", "batched_left_padded"]


@pytest.mark.parametrize("b,n_q,n_kv,L,S", CASES)
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("sinks", [False, True])
def test_masks_gqa_sinks(b, n_q, n_kv, L, S, mask_kind, sinks):
    rng = np.random.default_rng(b * 1000 + L * 10 + S)
    q, k, v = _qkv(rng, b, n_q, n_kv, L, S)
    kq, vq = _pack(k, QuantSpec(4)), _pack(v, QuantSpec(4))
    mask = _masks(rng, b, L, S)[mask_kind]
    s = mx.array(rng.standard_normal(n_q).astype(np.float32)) if sinks else None
    out = attention.quantized_attention(q, kq, vq, D**-0.5, mask, s)
    ref = _reference(q, kq, vq, D**-0.5, mask, s)
    assert out.shape == ref.shape == (b, n_q, L, D) and out.dtype == q.dtype
    assert mx.allclose(out, ref, atol=2e-5, rtol=1e-4).item()


def test_one_dimensional_window_mask():
    """The rolled (S,) mask a RotatingKVCache builds for one query."""
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 1, 8, 2, 1, 16)
    kq, vq = _pack(k, QuantSpec(8)), _pack(v, QuantSpec(8))
    mask = mx.roll(mx.arange(16) >= 16 - 6, shift=5)
    out = attention.quantized_attention(q, kq, vq, 0.125, mask)
    assert mx.allclose(out, _reference(q, kq, vq, 0.125, mask), atol=2e-5).item()
    # The window really applies: different from attending everything.
    assert not mx.allclose(out, _reference(q, kq, vq, 0.125, None), atol=1e-3).item()


def test_per_head_mask():
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 2, 8, 2, 3, 11)
    kq, vq = _pack(k, QuantSpec(4)), _pack(v, QuantSpec(4))
    mask = mx.array(rng.random((2, 8, 3, 11)) > 0.3) | (mx.arange(11) == 0)
    for m in (mask, mask[1], mask[:, :1], mx.where(mask, 0.0, -1e9)):  # (B|-, H|1, L, S)
        out = attention.quantized_attention(q, kq, vq, 0.125, m)
        assert mx.allclose(out, _reference(q, kq, vq, 0.125, m), atol=2e-5).item()


@pytest.mark.parametrize(
    "kspec,vspec",
    [
        (QuantSpec(8), QuantSpec(4)),
        (QuantSpec(2, 32), QuantSpec(6, 128)),
        (QuantSpec(None), QuantSpec(4)),
        (QuantSpec(4), QuantSpec(None)),
        (QuantSpec(4, 64, "hadamard"), QuantSpec(4, 64, "hadamard")),
        (QuantSpec(3, 64, "hadamard"), QuantSpec(8)),
        (QuantSpec(8), QuantSpec(5, 32, "hadamard")),
    ],
)
@pytest.mark.parametrize("mask_kind", ["causal", "batched_left_padded"])
def test_bits_and_rotation(kspec, vspec, mask_kind):
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 2, 8, 2, 5, 24, dv=128)
    kq, vq = _pack(k, kspec), _pack(v, vspec)
    mask = _masks(rng, 2, 5, 24)[mask_kind]
    s = mx.array(rng.standard_normal(8).astype(np.float32))
    out = attention.quantized_attention(q, kq, vq, 0.125, mask, s)
    ref = _reference(q, kq, vq, 0.125, mask, s)
    assert out.shape == (2, 8, 5, 128)
    assert mx.allclose(out, ref, atol=5e-5, rtol=1e-4).item()
    # And close to attention on the original K/V (quantization error only).
    exact = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask, sinks=s)
    bits = min(x.bits or 16 for x in (kspec, vspec))
    assert mx.max(mx.abs(out - exact)).item() < {2: 1.5, 3: 0.8}.get(bits, 0.4)


@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive", "batched_left_padded"])
def test_long_prefill_blocks(mask_kind):
    """More queries than one block (512): blocks see their own mask rows."""
    rng = np.random.default_rng(6)
    L = S = 600
    q, k, v = _qkv(rng, 2 if mask_kind == "batched_left_padded" else 1, 4, 2, L, S)
    kq, vq = _pack(k, QuantSpec(4)), _pack(v, QuantSpec(4))
    mask = _masks(rng, q.shape[0], L, S)[mask_kind]
    out = attention.quantized_attention(q, kq, vq, 0.125, mask)
    assert mx.allclose(out, _reference(q, kq, vq, 0.125, mask), atol=5e-5).item()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_queries(dtype):
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, 1, 8, 2, 3, 30)
    q = q.astype(dtype)
    kq, vq = _pack(k.astype(dtype), QuantSpec(4)), _pack(v.astype(dtype), QuantSpec(4))
    out = attention.quantized_attention(q, kq, vq, 0.125, "causal")
    assert out.dtype == dtype
    ref = _reference(q, kq, vq, 0.125, "causal")
    tol = 2e-2 if dtype == mx.bfloat16 else 3e-3
    assert mx.allclose(out.astype(mx.float32), ref, atol=tol).item()


def test_dispatch_and_mlx_lm_tuples():
    """The redirect sends our packed K/V to quantized attention, mlx-lm's
    QuantizedKVCache tuples to mlx-lm's own function (bit for bit) and arrays
    to mx.fast, and counts it."""
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, 1, 4, 2, 2, 10)
    kq, vq = _pack(k, QuantSpec(8)), _pack(v, QuantSpec(8))

    class MlxLmQuantized:  # what mlx-lm's QuantizedKVCache exposes
        bits, group_size = 8, 64

    tuples = (kq.data, kq.scales, kq.biases), (vq.data, vq.scales, vq.biases)
    with attention.count_attention() as counts:
        a = attention.scaled_dot_product_attention(q, kq, vq, None, 0.125, "causal")
        # mlx-lm's function scales its queries in place: it gets copies
        b = attention.scaled_dot_product_attention(
            mx.array(q), *tuples, MlxLmQuantized(), 0.125, "causal"
        )
        c = attention.scaled_dot_product_attention(q, k, v, object(), 0.125, "causal")
    assert counts["quantized"] == 2 and counts["full_precision"] == 1
    assert counts["no_cache"] == 1
    own = attention.MLX_LM_ATTENTION(
        mx.array(q), *tuples, MlxLmQuantized(), scale=0.125, mask="causal"
    )
    assert mx.array_equal(b, own).item()
    assert mx.allclose(a, b, atol=1e-4).item()
    assert mx.allclose(
        c, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    ).item()
    assert mx.allclose(a, _reference(q, kq, vq, 0.125, "causal"), atol=2e-5).item()


def test_bfloat16_beyond_float16_range():
    """bfloat16 K/V past float16's 65504 keep finite bfloat16 scales (float16
    ones would be inf and turn attention into NaN), at 16 bits per scale."""
    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, 1, 4, 2, 2, 40)
    k, v = (k * 3e5).astype(mx.bfloat16), (v * 3e5).astype(mx.bfloat16)
    kq, vq = _pack(k, QuantSpec(4)), _pack(v, QuantSpec(8))
    assert kq.scales.dtype == vq.biases.dtype == mx.bfloat16
    assert mx.all(mx.isfinite(kq.scales)).item() and mx.all(mx.isfinite(vq.biases)).item()
    store = Store.encode(v, QuantSpec(4))
    assert store.nbytes == v.size * (4 / 8 + 4 / 64)
    out = attention.quantized_attention(q.astype(mx.bfloat16), kq, vq, 1e-5, "causal")
    ref = _reference(q, kq, vq, 1e-5, "causal")
    assert mx.all(mx.isfinite(out)).item()
    # as close as bfloat16 attention itself gets on the same (dequantized) K/V
    plain = mx.fast.scaled_dot_product_attention(
        q.astype(mx.bfloat16), *(_plain(x).astype(mx.bfloat16) for x in (kq, vq)),
        scale=1e-5, mask="causal",
    )  # fmt: skip
    err = mx.max(mx.abs(out.astype(mx.float32) - ref)).item()
    plain_err = mx.max(mx.abs(plain.astype(mx.float32) - ref)).item()
    assert err <= 2 * plain_err + 1e-3 * mx.max(mx.abs(ref)).item()


def test_float32_dequantize_is_not_rounded_to_16_bits():
    rng = np.random.default_rng(12)
    x = mx.array(rng.standard_normal((1, 2, 8, D)).astype(np.float32)) * 1000 + 12345.678
    packed = _pack(x, QuantSpec(8))
    assert packed.scales.dtype == mx.float16
    exact = dequantize_f32(packed)
    assert mx.array_equal(packed.dequantize(mx.float32), exact).item()
    # the float16 path differs: its rounding is what float32 callers must not get
    assert not mx.array_equal(packed.dequantize(mx.float16).astype(mx.float32), exact).item()


GPU, CPU = mx.DeviceType.gpu, mx.DeviceType.cpu


@pytest.mark.parametrize(
    "device, metal, cuda, backend",
    [
        (CPU, False, False, attention.Backend.CPU),
        (CPU, True, False, attention.Backend.CPU),  # a Mac told to run on its CPU
        (CPU, False, True, attention.Backend.CPU),  # likewise with mlx[cuda]
        (GPU, True, False, attention.Backend.METAL),
        (GPU, False, True, attention.Backend.CUDA),  # mlx[cuda] on an NVIDIA GPU
        (GPU, False, False, attention.Backend.CPU),
    ],
)
def test_the_backend_follows_the_device_in_use(device, metal, cuda, backend):
    """The device decides, not whether Metal exists: CUDA gets the GPU path."""
    assert attention.backend_for(device, metal, cuda) is backend


def test_this_machine_runs_the_cpu_paths():
    assert mx.default_device().type == CPU
    assert attention.current_backend() is attention.Backend.CPU
    with mx.stream(mx.cpu):
        assert attention.current_backend() is attention.Backend.CPU


def test_a_gpu_backend_takes_mlx_quantized_kernels(monkeypatch):
    """With a GPU backend in use, attention keeps the model's dtype, uses
    `quantized_matmul` (no dense blocks, no native CPU kernels), and still
    computes attention (run here on the CPU device to check the numbers)."""
    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, 1, 4, 2, 20, 40)
    kq, vq = _pack(k, QuantSpec(4)), _pack(v, QuantSpec(4))
    cpu_out = attention.quantized_attention(q, kq, vq, 0.125, "causal")
    monkeypatch.setattr(attention, "current_backend", lambda: attention.Backend.CUDA)
    assert attention.compute_dtype(mx.bfloat16) == mx.bfloat16
    assert attention._dense_dtype(mx.float32) is None and not attention._native()
    gpu_out = attention.quantized_attention(q, kq, vq, 0.125, "causal")
    assert mx.allclose(gpu_out, cpu_out, atol=1e-4).item()
    assert mx.allclose(gpu_out, _reference(q, kq, vq, 0.125, "causal"), atol=5e-5).item()


def test_mlx_lms_own_quantized_cache_through_the_redirect():
    """mlx-lm's `test_quantized_sdpa` (tests/test_models.py of its 0.32.2
    sdist) with the redirect installed: its `QuantizedKVCache` hands out
    lists (`mx.quantize`'s return type), which fell through to `mx.fast`
    and raised TypeError. They go to mlx-lm's own function: bit for bit."""
    from mlx_lm.models.cache import KVCache

    attention.install()  # as planning a model does (this file may run first in its worker)
    from mlx_lm.models.base import scaled_dot_product_attention

    assert scaled_dot_product_attention is attention.scaled_dot_product_attention
    key = iter(mx.random.split(mx.random.key(3), 5))
    cache = KVCache()
    cache.update_and_fetch(*(0.1 * mx.random.normal((1, 1, 256, 32), key=next(key)),) * 2)
    quant_cache = cache.to_quantized(group_size=32, bits=8)
    k = 0.1 * mx.random.normal((1, 1, 1, 32), key=next(key))
    v = 0.1 * mx.random.normal((1, 1, 1, 32), key=next(key))
    k_up, v_up = cache.update_and_fetch(k, v)
    qk_up, qv_up = quant_cache.update_and_fetch(k, v)
    assert isinstance(qk_up, list | tuple)
    q = 0.1 * mx.random.normal((1, 4, 257, 32), key=next(key))
    out = scaled_dot_product_attention(q, k_up, v_up, cache=cache, mask="causal", scale=1.0)
    qout = scaled_dot_product_attention(
        mx.array(q), qk_up, qv_up, cache=quant_cache, mask="causal", scale=1.0
    )
    assert mx.allclose(out, qout, rtol=1e-2, atol=1e-2).item()
    own = attention.MLX_LM_ATTENTION(
        mx.array(q), qk_up, qv_up, cache=quant_cache, mask="causal", scale=1.0
    )
    assert mx.array_equal(qout, own).item()

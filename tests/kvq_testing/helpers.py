"""Shared helpers for the mlx-kvq test-suite: error bounds, mask comparison,
tiny random-weight models.

Imported by test modules as `kvq_testing.helpers` (pytest puts `tests/` on the path).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_kvq.quant import QuantizedKV, rotate

F16_HALF_ULP = 2.0**-11  # relative half-ulp of float16
HALF_ULP = {mx.float16: F16_HALF_ULP, mx.bfloat16: 2.0**-8, mx.float32: 2.0**-24}


# -- quantization error bound --------------------------------------------------
def dequantize_f32(q: QuantizedKV, unrotate: bool = False) -> mx.array:
    """Dequantize in float32 (scales/biases cast up first), optionally back to
    the original basis."""
    x = mx.dequantize(
        q.data,
        q.scales.astype(mx.float32),
        q.biases.astype(mx.float32),
        group_size=q.group_size,
        bits=q.bits,
    )
    return rotate(x) if (unrotate and q.rotated) else x


def error_bound(q: QuantizedKV, ref: mx.array) -> mx.array:
    """Per-element bound on |dequantize(q) - ref|, derived from the data.

    MLX's affine quantizer stores per group a scale `s` and bias `b` (cast to
    16-bit here: float16, or bfloat16 for bfloat16 inputs) and reconstructs `b + s * k`, `k` in `0 .. 2^bits - 1`.
    An element inside the grid's range is within `|s|/2` of a grid point; MLX
    moves the grid so that 0 is exactly representable, which can leave the
    group's far extreme up to about one step outside the range, so those
    elements are additionally allowed their distance to the range. 16-bit
    storage of `s` and `b` adds `(2^bits - 1) * ulp(s)/2 + ulp(b)/2` (twice
    for `s`: once for the grid point, once for the range edge).
    """
    n = 2**q.bits - 1
    g = q.group_size
    s = mx.abs(q.scales.astype(mx.float32))
    b = q.biases.astype(mx.float32)
    sb = q.scales.astype(mx.float32)
    lo = mx.minimum(b, b + n * sb)[..., None]
    hi = mx.maximum(b, b + n * sb)[..., None]
    shape = ref.shape
    x = ref.astype(mx.float32).reshape(*shape[:-1], shape[-1] // g, g)
    outside = mx.maximum(0.0, mx.maximum(lo - x, x - hi))
    u = HALF_ULP[q.scales.dtype]
    per_group = s * (0.5 + 2 * n * u) + mx.abs(b) * 2 * u + 1e-6
    bound = per_group[..., None] + outside + 1e-6 * mx.abs(x)
    return bound.reshape(shape)


def assert_close_quantized(got, ref: mx.array, what: str = "") -> None:
    """`got` (QuantizedKV or array) matches the raw reference `ref`.

    Quantized: every element within the data-derived bound (rotated stores
    are compared in the rotated basis, where the bound holds element-wise).
    Raw: exactly equal.
    """
    if isinstance(got, QuantizedKV):
        assert got.shape == tuple(ref.shape), (what, got.shape, ref.shape)
        if ref.size == 0:
            return
        target = rotate(ref.astype(mx.float32)) if got.rotated else ref
        deq = dequantize_f32(got)
        err = mx.abs(deq - target.astype(mx.float32))
        bound = error_bound(got, target)
        ok = mx.all(err <= bound).item()
        if not ok:
            worst = mx.max(err - bound).item()
            raise AssertionError(f"{what}: quantization error exceeds bound by {worst}")
    else:
        assert tuple(got.shape) == tuple(ref.shape), (what, got.shape, ref.shape)
        assert mx.array_equal(got.astype(mx.float32), ref.astype(mx.float32)).item(), what


def assert_close_dequantized(got: mx.array, packed, ref: mx.array, what: str = "") -> None:
    """A dequantized hand-out `got` (model dtype, original basis) matches `ref`.

    `packed` is the stored form it came from; its data-derived bound applies
    element-wise, or per token vector in L2 when the store is rotated (the
    rotation is orthonormal). Dequantizing in the model's dtype adds one
    rounding to that dtype.
    """
    assert got.dtype == ref.dtype and tuple(got.shape) == tuple(ref.shape), what
    if not isinstance(packed, QuantizedKV):
        assert mx.array_equal(got, ref).item(), what
        return
    target = rotate(ref.astype(mx.float32)) if packed.rotated else ref.astype(mx.float32)
    bound = error_bound(packed, target) + mx.abs(target) * 2 * HALF_ULP[got.dtype] + 1e-4
    err = got.astype(mx.float32) - ref.astype(mx.float32)
    if packed.rotated:
        ok = mx.all(mx.sqrt((err**2).sum(-1)) <= mx.sqrt((bound**2).sum(-1)) * 1.01).item()
    else:
        ok = mx.all(mx.abs(err) <= bound).item()
    assert ok, f"{what}: dequantized hand-out outside the quantization bound"


# -- masks -----------------------------------------------------------------------
def mask_equal(a, b) -> bool:
    """Identical masks: same kind (None, "causal", array) and equal arrays."""
    if a is None or b is None or isinstance(a, str) or isinstance(b, str):
        return a == b if (isinstance(a, str) or isinstance(b, str)) else (a is None and b is None)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return mx.array_equal(a, b).item()


def positional_mask(positions: mx.array, query_pos: int, window_size: int | None) -> np.ndarray:
    """Ground truth for one query: a slot is visible iff its token position is
    causal and inside the window."""
    pos = np.array(positions)
    ok = pos <= query_pos
    if window_size is not None:
        ok &= pos > query_pos - window_size
    return ok


def as_bool(mask, n_keys: int) -> np.ndarray:
    """A one-query mask (None, bool vector, or (1, S)) as a bool vector."""
    if mask is None:
        return np.ones(n_keys, dtype=bool)
    return np.array(mask).reshape(-1)[-n_keys:].astype(bool)


# -- tiny random-weight models ------------------------------------------------------
VOCAB = 256
_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
SW = ["sliding_attention", "full_attention"]

# Sliding windows of 8 tokens with both sliding and full layers, so windows
# wrap inside a 40-token prompt.
TINY = {
    "gemma3_text": dict(
        _BASE, num_hidden_layers=4, sliding_window=8, sliding_window_pattern=2,
        query_pre_attn_scalar=64,
    ),
    "gemma4_text": dict(
        _BASE, num_hidden_layers=6, num_kv_shared_layers=2, global_head_dim=128,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16, sliding_window=8,
        sliding_window_pattern=2, use_double_wide_mlp=True,
    ),
    "gpt_oss": dict(
        _BASE, num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=64, sliding_window=8, layer_types=SW * 2,
    ),
    "cohere2": dict(
        _BASE, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=4,
        sliding_window=8, sliding_window_pattern=2, layer_norm_eps=1e-5,
    ),
    "llama": dict(_BASE, num_hidden_layers=2),
}  # fmt: skip


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """A float32 random-weight model of `model_type` (weights materialised)."""
    import importlib

    import mlx_kvq  # noqa: F401  (installs the attention redirect first)

    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = dict(TINY[model_type], model_type=model_type, **overrides)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    if model_type == "gpt_oss":
        # Zero-initialised sinks would make the sink path a no-op.
        for layer in model.model.layers:
            layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape)
    # Trained Gemma models attend at a moderate temperature; random init does
    # not: gemma3's (1 + w) q/k norms start at w = 1 (RMS 2, scores 4x too
    # hot) and gemma4 attends with scale 1.0 on unit-RMS q/k (8x too hot).
    # Such peaked attention turns any perturbation into a different token.
    if model_type == "gemma3_text":
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight = mx.zeros_like(layer.self_attn.q_norm.weight)
            layer.self_attn.k_norm.weight = mx.zeros_like(layer.self_attn.k_norm.weight)
    if model_type == "gemma4_text":
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_norm.weight = attn.q_norm.weight * attn.head_dim**-0.5
    mx.eval(model.parameters())
    return model


def prompt_tokens(n: int = 40, seed: int = 0) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(0, VOCAB, size=n).astype(np.int32))


def started(engine, wait_s: float):
    """`engine` started, and ready (its warm-up passed) within `wait_s`."""
    engine.start()
    assert engine.readiness.ready_event.wait(wait_s)
    assert engine.readiness.ready, engine.readiness.get()
    return engine

"""Generation on tiny random-weight models with sliding windows that wrap.

gemma3_text, gemma4_text (KV-shared layers), gpt_oss (attention sinks) and
cohere2, all float32: every KV layer quantized (cache report), every
attention call on the quantized path (counted, not assumed), and at 8 bits
the greedy tokens equal the unquantized run's.
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import pytest
from kvq_testing.helpers import prompt_tokens, tiny_model
from mlx_lm.models import cache as mlx_cache

import mlx_kvq
from mlx_kvq import attention
from mlx_kvq.caches import KVQFullCache, KVQWindowCache, cache_report

mlx_generate = importlib.import_module("mlx_lm.generate")

# Weight seeds. Random-weight models have near-tied logits at some steps
# (top-2 margins down to 1e-4) and MoE routing is discontinuous, so a greedy
# comparison is meaningful only on a path without near-ties. For these seeds
# the unquantized 16-token greedy path has a smallest top-2 log-prob margin
# of about 0.03 (cohere2: 20x its 8-bit log-prob error), measured when the
# seeds were chosen; seeds with near-ties (margin < 0.005) diverge at the tie.
SEEDS = {"gemma3_text": 0, "gemma4_text": 3, "gpt_oss": 1, "cohere2": 5}
MODELS = list(SEEDS)
N_TOKENS = 16
PREFILL_STEP = 16  # a 40-token prompt in 3 chunks; each chunk wraps the 8-token windows


@pytest.fixture(scope="module")
def models():
    return {name: tiny_model(name, seed=seed) for name, seed in SEEDS.items()}


def _greedy(gen) -> list[int]:
    return [int(t) for t, _ in gen]


def _reference_tokens(model) -> list[int]:
    return _greedy(
        mlx_generate.generate_step(
            prompt_tokens(), model, max_tokens=N_TOKENS, prefill_step_size=PREFILL_STEP
        )
    )


def _layers(model) -> int:
    return len(model.layers)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("bits", [4, 8])
def test_generate_every_layer_quantized(models, name, bits):
    model = models[name]
    cache = mlx_kvq.make_prompt_cache(model, kv_bits=bits)
    slots = len(mlx_cache.make_prompt_cache(model))
    assert len(cache) == slots
    with attention.count_attention() as counts:
        tokens = _greedy(
            mlx_kvq.generate_step(
                prompt_tokens(), model, prompt_cache=cache, kv_bits=bits,
                max_tokens=N_TOKENS, prefill_step_size=PREFILL_STEP,
            )
        )  # fmt: skip
    assert len(tokens) == N_TOKENS

    report = cache_report(cache)
    assert len(report) == slots
    for entry, c in zip(report, cache, strict=True):
        assert entry["kind"] in ("full", "sliding"), entry
        assert entry["quantized"] is True, entry
        assert isinstance(c, (KVQFullCache, KVQWindowCache))
        assert c.keys.quantized and c.values.quantized
        assert c.keys.spec.bits == c.values.spec.bits == bits
    kinds = {e["kind"] for e in report}
    assert kinds == {"full", "sliding"}
    # The windows wrapped: sliding slots hold the window, not the context.
    for entry, c in zip(report, cache, strict=True):
        if entry["kind"] == "sliding":
            assert c.offset > c.max_size and entry["tokens"] == c.max_size

    # Every attention call of every layer took the quantized path.
    layers = _layers(model)
    assert counts["full_precision"] == 0
    assert counts["quantized"] > 0 and counts["quantized"] % layers == 0
    forwards = counts["quantized"] // layers
    assert forwards >= N_TOKENS
    shared = layers - slots
    assert counts["no_cache"] == shared * forwards
    if name == "gemma4_text":
        assert shared == 2  # KV-shared layers call attention with cache=None
    if name == "gpt_oss":
        assert counts["sinks"] == layers * forwards


@pytest.mark.parametrize("name", MODELS)
def test_8bit_tokens_match_unquantized(models, name):
    model = models[name]
    want = _reference_tokens(model)
    got = _greedy(
        mlx_kvq.generate_step(
            prompt_tokens(), model, kv_bits=8, max_tokens=N_TOKENS,
            prefill_step_size=PREFILL_STEP,
        )
    )  # fmt: skip
    assert got == want


@pytest.mark.parametrize("name", MODELS)
def test_8bit_closer_than_4bit(models, name):
    """Teacher-forced over the prompt: 8-bit log-probs are closer to the
    unquantized ones than 4-bit log-probs, and close in absolute terms."""
    model = models[name]
    prompt = prompt_tokens()[None]

    def logprobs(cache):
        out = model(prompt, cache=cache)
        return out - mx.logsumexp(out, axis=-1, keepdims=True)

    ref = logprobs(mlx_cache.make_prompt_cache(model))
    err = {}
    for bits in (4, 8):
        diff = mx.abs(logprobs(mlx_kvq.make_prompt_cache(model, kv_bits=bits)) - ref).max(-1)
        err[bits] = mx.sort(diff[0])[diff.shape[1] // 2].item()  # median over positions
    assert err[8] < err[4]
    assert err[8] < 0.05


def test_generate_without_bits_is_mlx_lm(models):
    model = models["gemma3_text"]
    cache = mlx_kvq.make_prompt_cache(model)
    assert [type(c) for c in cache] == [type(c) for c in mlx_cache.make_prompt_cache(model)]
    got = _greedy(
        mlx_kvq.generate_step(
            prompt_tokens(), model, prompt_cache=cache, max_tokens=N_TOKENS,
            prefill_step_size=PREFILL_STEP,
        )
    )  # fmt: skip
    assert got == _reference_tokens(model)


@pytest.mark.parametrize("name", MODELS)
def test_attention_redirect_is_installed(name):
    module = f"mlx_lm.models.{name}"
    assert attention.uses_our_attention(module)
    assert importlib.import_module(module).scaled_dot_product_attention is (
        attention.scaled_dot_product_attention
    )


# -- gpt-oss: sinks with quantized K/V ---------------------------------------------------
def _gpt_oss_module():
    return importlib.import_module("mlx_lm.models.gpt_oss")


def test_mlx_lm_attention_fails_on_sinks_with_quantized_cache(models, monkeypatch):
    """mlx-lm alone cannot run gpt-oss quantized: its quantized attention
    refuses sinks, and its sliding caches cannot be quantized at all."""
    model = models["gpt_oss"]
    prompt = prompt_tokens()[None, :12]
    monkeypatch.setattr(
        _gpt_oss_module(), "scaled_dot_product_attention", attention.MLX_LM_ATTENTION
    )
    cache = [mlx_cache.QuantizedKVCache(group_size=64, bits=8) for _ in model.layers]
    with pytest.raises(ValueError, match="sinks"):
        model(prompt, cache=cache)
    with pytest.raises(NotImplementedError):
        list(mlx_generate.generate_step(prompt[0], model, kv_bits=8, quantized_kv_start=0,
                                        max_tokens=2))  # fmt: skip
    # Our caches through mlx-lm's own attention: packed K/V reach mx.fast.
    with pytest.raises((TypeError, ValueError)):
        mx.eval(model(prompt, cache=mlx_kvq.make_prompt_cache(model, kv_bits=8)))


def test_our_attention_runs_sinks_with_quantized_cache(models):
    model = models["gpt_oss"]
    prompt = prompt_tokens()[None, :12]
    ref = model(prompt, cache=mlx_cache.make_prompt_cache(model))
    # mlx-lm's own quantized cache (packed tuples), through our attention.
    cache = [mlx_cache.QuantizedKVCache(group_size=64, bits=8) for _ in model.layers]
    with attention.count_attention() as counts:
        out = model(prompt, cache=cache)
    assert counts["quantized"] == counts["sinks"] == len(model.layers)
    assert mx.allclose(out, ref, atol=0.1).item()
    # And our caches.
    with attention.count_attention() as counts:
        out = model(prompt, cache=mlx_kvq.make_prompt_cache(model, kv_bits=8))
    assert counts["quantized"] == counts["sinks"] == len(model.layers)
    assert counts["full_precision"] == 0
    assert mx.allclose(out, ref, atol=0.1).item()
    assert mx.argmax(out[0, -1]).item() == mx.argmax(ref[0, -1]).item()


# -- mlx-lm's other entry points ---------------------------------------------------------
def test_stream_generate_and_generate_quantize(models):
    """The mirrors of stream_generate/generate pass KV keywords through."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    model = models["cohere2"]
    tokenizer = TokenizerWrapper(_word_tokenizer())
    prompt = prompt_tokens().tolist()
    with attention.count_attention() as counts:
        responses = list(
            mlx_kvq.stream_generate(model, tokenizer, prompt, max_tokens=8, kv_bits=4,
                                    prefill_step_size=PREFILL_STEP)
        )  # fmt: skip
    assert responses and responses[-1].generation_tokens == 8
    assert counts["full_precision"] == 0 and counts["quantized"] > 0
    text = mlx_kvq.generate(model, tokenizer, prompt, max_tokens=8, kv_bits=8)
    assert isinstance(text, str)


def _word_tokenizer():
    """A 256-word tokenizer ("t0" .. "t255") in transformers' fast wrapper."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t255")


# -- quantized_kv_start, max_kv_size, filled mlx-lm caches ----------------------------------
def test_quantized_kv_start(models):
    model = models["gemma3_text"]
    # Never reached: raw storage throughout, exactly mlx-lm's tokens.
    cache = mlx_kvq.make_prompt_cache(model, kv_bits=4, quantized_kv_start=1000)
    with attention.count_attention() as counts:
        got = _greedy(
            mlx_kvq.generate_step(
                prompt_tokens(), model, prompt_cache=cache, kv_bits=4, quantized_kv_start=1000,
                max_tokens=N_TOKENS, prefill_step_size=PREFILL_STEP,
            )
        )  # fmt: skip
    assert got == _reference_tokens(model)
    assert counts["quantized"] == 0
    assert not any(e["quantized"] for e in cache_report(cache))
    # Reached during the prompt: every layer converts and attends quantized after.
    cache = mlx_kvq.make_prompt_cache(model, kv_bits=4, quantized_kv_start=20)
    counts = _generate_from_20(model, cache)
    assert all(e["quantized"] for e in cache_report(cache))
    assert counts["quantized"] + counts["full_precision"] > 0


def _generate_from_20(model, cache) -> dict:
    """Four greedy tokens with quantization starting at token 20; attention counts."""
    with attention.count_attention() as counts:
        _greedy(
            mlx_kvq.generate_step(
                prompt_tokens(), model, prompt_cache=cache, kv_bits=4, quantized_kv_start=20,
                max_tokens=4, prefill_step_size=PREFILL_STEP,
            )
        )  # fmt: skip
    return counts


def test_quantized_kv_start_attends_packed_after_start(models):
    model = models["gemma3_text"]
    cache = mlx_kvq.make_prompt_cache(model, kv_bits=4, quantized_kv_start=20)
    assert all(c.hand_out == "packed" for c in cache)
    counts = _generate_from_20(model, cache)
    # Only the two prompt chunks that start below token 20 attend in full precision.
    assert counts["full_precision"] == 2 * len(model.layers)


def test_max_kv_size_matches_mlx_lm_rotating():
    """--max-kv-size turns full-attention layers into windows with 4 sink
    tokens (mlx-lm's RotatingKVCache(keep=4)); at 8 bits the greedy tokens
    match mlx-lm's unquantized run with the same bound."""
    from kvq_testing.helpers import tiny_model

    model = tiny_model("llama", seed=5)  # greedy path without near-ties (margin >= 0.015)
    cache = mlx_kvq.make_prompt_cache(model, kv_bits=8, max_kv_size=12)
    assert all(isinstance(c, KVQWindowCache) and (c.max_size, c.keep) == (12, 4) for c in cache)
    got = _greedy(
        mlx_kvq.generate_step(prompt_tokens(), model, prompt_cache=cache, kv_bits=8,
                              max_tokens=N_TOKENS, prefill_step_size=PREFILL_STEP)
    )  # fmt: skip
    # llama defines make_cache, so mlx-lm itself ignores max_kv_size: give it
    # the RotatingKVCache(12, keep=4) it would build for a model without one.
    ref = [mlx_cache.RotatingKVCache(12, keep=4) for _ in model.layers]
    want = _greedy(
        mlx_generate.generate_step(prompt_tokens(), model, prompt_cache=ref, max_tokens=N_TOKENS,
                                   prefill_step_size=PREFILL_STEP)
    )  # fmt: skip
    assert got == want
    assert [(c.offset, c._idx) for c in cache] == [(r.offset, r._idx) for r in ref]
    assert all(c.offset > 40 and c.size() == 12 for c in cache)


def test_filled_mlx_lm_cache_is_converted_in_place(models):
    model = models["gpt_oss"]
    cache = mlx_cache.make_prompt_cache(model)
    model(prompt_tokens()[None, :30], cache=cache)
    before = [(c.offset, getattr(c, "_idx", None)) for c in cache]
    gen = mlx_kvq.generate_step(prompt_tokens()[30:], model, prompt_cache=cache, kv_bits=4,
                                max_tokens=1)  # fmt: skip
    with attention.count_attention() as counts:
        next(gen)
    assert all(isinstance(c, (KVQFullCache, KVQWindowCache)) and c.quantized for c in cache)
    assert counts["full_precision"] == 0 and counts["quantized"] > 0
    # Positions carried over: 30 + the 10 new prompt tokens (+1 when mlx-lm
    # has already run its one-step lookahead).
    assert {o for o, _ in before} == {30}
    assert len({c.offset for c in cache}) == 1 and cache[0].offset in (40, 41)

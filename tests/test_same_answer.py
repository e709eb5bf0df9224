"""Same input, same output: a prompt's logits do not depend on where its
chunks end, under the split layout too (each query reads what a
token-by-token decode would have read at its position: `quant.Reread`)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from mlx_kvq.blas import use_linked_blas
from mlx_kvq.caches import Pages, exact_trim_limit, page_caches
from mlx_kvq.config import KVConfig
from mlx_kvq.engine.prompt_cache import PromptCache
from mlx_kvq.generate import get_plan

TOKENS = mx.random.randint(0, 128, (1, 200), key=mx.random.key(4))
CHUNKINGS = [[37, 100, 63], [16] * 12 + [8], [150, 50], [9, 191]]


def _tiny():
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=128,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def _logits(model, plan, chunks: list[int], paged: bool) -> mx.array:
    cache = plan.make_cache()
    if paged:
        cache = [type(c).merge([c]) for c in page_caches(cache, Pages(32))]
    out, at = [], 0
    for n in chunks:
        out.append(model(TOKENS[:, at : at + n], cache=cache))
        at += n
    return mx.concatenate(out, axis=1)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sinks", [0, 4])
def test_split_logits_do_not_depend_on_the_chunks(paged, sinks):
    """Per-channel keys in groups of 32, 8 exact: every chunking of 200
    tokens gives the same logits, bit for bit, and those of a decode token by
    token to float rounding (another product path). Before, a chunk's
    queries read the blocks it quantized: 0.28 apart from the decode.

    On the reference BLAS: OpenBLAS multiplies this model's small matrices
    with kernels chosen by their row count, so its K/V differ in the last
    bits between a 16-row and a 200-row chunk, and a quantization level can
    flip (real models' products take one kernel; the engine test below)."""
    with use_linked_blas():
        _check_chunkings(paged, sinks)


def _check_chunkings(paged: bool, sinks: int) -> None:
    model = _tiny()
    kv = KVConfig(
        bits=4, group_size=32, key_scales="channel", key_group_size=32, residual=8,
        sinks=sinks, rotation="hadamard",
    )  # fmt: skip
    plan = get_plan(model, kv)
    whole = _logits(model, plan, [200], paged)
    for chunks in CHUNKINGS:
        assert mx.array_equal(_logits(model, plan, chunks, paged), whole).item(), chunks
    decoded = _logits(model, plan, [1] * 200, paged)
    assert mx.abs(decoded - whole).max().item() < 1e-3
    assert mx.array_equal(decoded.argmax(-1), whole.argmax(-1)).item()


def test_a_prompt_cache_copy_is_cut_back_only_where_it_holds_what_a_decode_would():
    """A split layer's body cannot give its tokens back exact: the prompt
    cache serves a prefix of an entry only where the cut stays in the exact
    tail past the last `residual`, and keeps a shorter entry the longer one
    cannot serve exactly."""
    model = _tiny()
    kv = KVConfig(
        bits=4, group_size=32, key_scales="channel", key_group_size=32, residual=8,
        sinks=4, rotation="hadamard",
    )  # fmt: skip
    plan = get_plan(model, kv)
    tokens = TOKENS[0].tolist()
    cache = plan.make_cache()
    model(TOKENS[:, :150], cache=cache)
    # 4 sinks, body [4, 132) in groups of 32, 18 exact: 10 past the residual
    assert exact_trim_limit(cache) == 10
    entries = PromptCache(max_entries=4)
    assert entries.insert(tokens[:150], cache)
    # a prompt sharing 145 tokens: 5 cut from the tail, exactly
    _, covered = entries.fetch(tokens[:145] + [0, 0])
    assert covered == 145
    # sharing 120: the cut reaches into the body; no reuse
    assert entries.fetch(tokens[:120] + [0, 0]) == (None, 0)
    # a shorter entry the longer one cannot serve exactly stays beside it
    short = plan.make_cache()
    model(TOKENS[:, :100], cache=short)
    entries = PromptCache(max_entries=4)
    assert entries.insert(tokens[:100], short)
    assert entries.insert(tokens[:150], cache)
    assert len(entries) == 2
    _, covered = entries.fetch(tokens[:100] + [0])
    assert covered == 100

"""The paged layout across architectures: one of each kind of cache layout.

For one tiny model of every layout family of the architecture sweep (full,
sliding, chunked, KV-shared, sinks, recurrent state beside attention, latent
attention, sparse indexers, unused slots), mlx-lm's `BatchGenerator` decodes
three prompts of different lengths (windows wrap) twice: with the planned
caches in left-padded rows, and with the same caches paged in 4-token blocks
where the registry pages their kind. The greedy tokens must match and the
log-probabilities agree to float rounding; an architecture whose kinds do not
page must say so in its layout, and then runs padded. The same again at the
default setting of each model's layout, in its own block size.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kvq_testing import archs
from mlx_lm.generate import BatchGenerator

from mlx_kvq.caches import Pages, page_caches
from mlx_kvq.config import KVConfig, UnsupportedKVConfig
from mlx_kvq.defaults import default_kv_config
from mlx_kvq.engine import EngineOptions, check_batch_path
from mlx_kvq.engine.runner import choose_layout
from mlx_kvq.plan import has_bounded_layers, plan_kv

NAMES = [
    "llama", "qwen3", "gemma3_text", "gpt_oss", "llama4", "gemma3n", "gemma4_text",
    "cohere2", "falcon_h1", "recurrent_gemma", "deepseek_v3", "deepseek_v32",
    "deepseek_v41", "gear",
]  # fmt: skip
LENGTHS = (5, 23, 40)
STEPS = 6


def _decode(model, make_cache, prompts):
    bg = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    uids = bg.insert(
        prompts, max_tokens=[STEPS] * len(prompts), caches=[make_cache() for _ in prompts]
    )
    tokens = {u: [] for u in uids}
    logprobs = {u: [] for u in uids}
    while any(len(t) < STEPS for t in tokens.values()):
        _, responses = bg.next()
        for r in responses:
            tokens[r.uid].append(r.token)
            logprobs[r.uid].append(np.array(r.logprobs.astype(mx.float32)))
    bg.close()
    return [tokens[u] for u in uids], [np.stack(logprobs[u]) for u in uids]


def _check_paged_matches_padded(name: str, kv: KVConfig, block_size, lengths, atol: float):
    """Decode `lengths`-token prompts of `name` at `kv` padded, then paged in
    the layout `block_size` gives (or check that it says why it does not page)."""
    model = archs.build_model(name)
    plan = plan_kv(model, kv, batch=True)
    if plan.max_batch is not None:
        pytest.skip(f"{name} serves one sequence at a time")
    try:
        check_batch_path(plan.make_cache, kv)
    except UnsupportedKVConfig as e:  # the server refuses it at startup
        pytest.skip(str(e))
    layout = choose_layout(plan, block_size)
    if layout.block_size is None:
        assert layout.description.startswith("padded rows: ")
        return
    rng = np.random.default_rng(len(name))
    prompts = [rng.integers(1, archs.V, size=n).tolist() for n in lengths]
    pages = Pages(layout.block_size)
    want_tokens, want_lp = _decode(model, plan.make_cache, prompts)
    got_tokens, got_lp = _decode(model, lambda: page_caches(plan.make_cache(), pages), prompts)
    assert pages.pools, f"{name}: {layout.description}, but nothing was paged"
    assert got_tokens == want_tokens
    for g, w in zip(got_lp, want_lp, strict=True):
        np.testing.assert_allclose(g, w, atol=atol)


@pytest.mark.parametrize("name", NAMES)
def test_paged_decode_matches_padded(name):
    assert name in archs.TINY_CONFIGS
    _check_paged_matches_padded(name, KVConfig(bits=4), 4, LENGTHS, atol=2e-3)


@pytest.mark.parametrize("name", NAMES)
def test_the_defaults_paged_decode_matches_padded(name):
    """The default setting of the model's layout (the split layout on its
    full-attention layers, in blocks of whole key groups), with prompts past
    its exact tail. Without sinks, paged blocks and padded rows quantize the
    same groups (with sinks the paged body starts its groups at position 0:
    `caches/paged/split.py`), so the logits agree as in the test above."""
    kv = default_kv_config(has_bounded_layers(archs.build_model(name))).with_(sinks=0)
    _check_paged_matches_padded(name, kv, EngineOptions().block_size, (5, 150, 300), atol=5e-3)

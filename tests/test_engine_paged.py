"""The engine with the paged layout against the padded one (tiny sliding + full model).

Greedy text must not change between layouts; sequences that share a prompt
prefix map its blocks by reference; every block goes back to the pool once
nothing refers to it.
"""

from __future__ import annotations

import pytest
from kvq_testing.events import WAIT_S, Collector
from kvq_testing.helpers import started
from kvq_testing.tiny import save_tiny_model
from mlx_lm import load
from prometheus_client import generate_latest

from mlx_kvq.attention import count_attention
from mlx_kvq.config import KVConfig
from mlx_kvq.engine import (
    Checkpoint,
    Engine,
    EngineOptions,
    GenerationRequest,
    SamplingParams,
    Segment,
)
from mlx_kvq.plan import plan_kv
from mlx_kvq.server.prometheus import make_registry
from mlx_kvq.server.web import blocks_status


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("paged") / "m", "llama:sliding")
    model, tokenizer = load(str(path))
    kv = KVConfig(bits=4, group_size=64)
    return model, tokenizer, plan_kv(model, kv, batch=True), kv


def _engine(loaded, block_size, **options):
    model, tokenizer, plan, kv = loaded
    eng = Engine(
        model, tokenizer, plan, kv,
        EngineOptions(block_size=block_size, max_context=plan.max_context, **options),
    )  # fmt: skip
    return started(eng, WAIT_S)


def _run(eng, prompts, max_tokens=12):
    collectors = []
    for p in prompts:
        c = Collector()
        req = GenerationRequest(list(p), SamplingParams(max_tokens=max_tokens))
        c.request_id = req.id
        eng.submit(req, c)
        collectors.append(c)
    return [c.wait().tokens for c in collectors]


# Mixed lengths: some shorter than the 8-token window, some several windows
# long; two share a 37-token prefix (several 4-token blocks and a partial one).
PREFIX = [(7 * i) % 200 + 3 for i in range(37)]
PROMPTS = [
    [5, 9, 11],
    [(3 * i) % 190 + 2 for i in range(61)],
    PREFIX + [17, 18, 19],
    [(11 * i) % 180 + 4 for i in range(9)],
    PREFIX + [21, 22, 23, 24, 25],
]


def test_greedy_text_is_the_same_in_both_layouts(loaded):
    padded = _engine(loaded, None)
    try:
        want = _run(padded, PROMPTS)
    finally:
        padded.stop()
    paged = _engine(loaded, 4)
    try:
        with count_attention() as calls:
            got = _run(paged, PROMPTS)
        assert calls["paged"] > 0
        assert got == want
        stats = paged.runner.pages_stats()
        # every block not held by the prompt cache went back to the pool
        held = sum(
            len(t.ids) for e in paged.prompt_cache._entries.values() for c in e.cache
            for t in getattr(c, "tables", [])
        )  # fmt: skip
        assert stats.used <= held
    finally:
        paged.stop()


def _turns(eng, prompts, max_tokens=12):
    """Two turns of each chat, all chats at once: the second prompt is the
    first, its answer and a new message, so the second turn continues from
    the prompt cache with a chunk after decodes that wrapped the window."""
    first = _run(eng, prompts, max_tokens)
    follow = [
        p + out + [30 + i, 31, 32 + i]
        for i, (p, out) in enumerate(zip(prompts, first, strict=True))
    ]
    collectors = []
    for p in follow:
        c = Collector()
        eng.submit(GenerationRequest(list(p), SamplingParams(max_tokens=max_tokens)), c)
        collectors.append(c)
    second = [c.wait() for c in collectors]
    cached = [c.end.usage.cached_tokens for c in second]
    return first, [c.tokens for c in second], cached


def test_greedy_text_is_the_same_in_both_layouts_over_turns(loaded):
    padded = _engine(loaded, None, prompt_cache_size=40)
    try:
        want = _turns(padded, PROMPTS)
    finally:
        padded.stop()
    paged = _engine(loaded, 4, prompt_cache_size=40)
    try:
        got = _turns(paged, PROMPTS)
    finally:
        paged.stop()
    assert got[0] == want[0] and got[1] == want[1]
    # the second turns did continue from the first turns' caches
    assert all(n > 0 for n in got[2]) and got[2] == want[2]


def test_a_shared_prefix_is_mapped_by_reference(loaded):
    eng = _engine(loaded, 4, prompt_cache_size=40)
    try:
        _run(eng, [PREFIX + [40]], max_tokens=2)  # leaves the prefix in the prompt cache
        before = eng.runner.pages_stats()
        # sixteen sequences starting with the prefix, decoding together
        prompts = [PREFIX + [50 + i, 60 + i] for i in range(16)]
        got = _run(eng, prompts, max_tokens=6)
        assert all(len(t) == 6 for t in got)
        reused = eng.metrics.snapshot().prefix_blocks_reused
        # 37 prefix tokens: 9 full 4-token blocks and a partial one in each of
        # the 2 full-attention layers, for each of 16 sequences
        assert reused >= 16 * 2 * 10
        assert before.shared > 0
        # what /status and /metrics show
        status = blocks_status(eng.metrics.snapshot())
        assert status["prefix_blocks_reused"] == reused and status["block_size"] == 4
        assert status["used"] + status["free"] == status["capacity"] > 0
        text = generate_latest(make_registry(eng)).decode()
        assert f"mlx_kvq_kv_prefix_blocks_reused_total {float(reused)}" in text
        assert "mlx_kvq_kv_blocks_shared " in text
    finally:
        eng.stop()


def test_sessions_sent_together_wait_for_the_system_prompt_being_prefilled(loaded):
    """Six chats with one system prompt (a checkpoint at its end), sent at once:
    the first computes the system prompt, the others wait for its copy and map
    it; the prompt tokens computed are the system prompt once and every
    chat's own, and the text is what each says alone."""
    system = [(5 * i) % 190 + 3 for i in range(45)]
    prompts = [system + [60 + i, 70 + i, 80 + i] for i in range(6)]
    checkpoints = (Checkpoint(len(system), Segment.SYSTEM),)
    alone = _engine(loaded, None, prompt_cache_size=0)
    try:
        want = [_run(alone, [p], max_tokens=5)[0] for p in prompts]
    finally:
        alone.stop()
    eng = _engine(loaded, 4, prompt_cache_size=40)
    try:
        before = eng.metrics.snapshot().prompt_tokens
        collectors = []
        for p in prompts:
            c = Collector()
            eng.submit(
                GenerationRequest(p, SamplingParams(max_tokens=5), checkpoints=checkpoints), c
            )
            collectors.append(c)
        got = [c.wait() for c in collectors]
        computed = eng.metrics.snapshot().prompt_tokens - before
    finally:
        eng.stop()
    assert [c.tokens for c in got] == want
    assert [c.end.usage.cached_tokens for c in got] == [0] + [len(system)] * 5
    # every prompt token but the last (the first decode step reads it), the system prompt once
    assert computed == sum(len(p) - 1 for p in prompts) - 5 * len(system)

"""Same input, same output: a prompt's logits do not depend on where its
chunks end, under the split layout too (each query reads what a
token-by-token decode would have read at its position: `quant.Reread`)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest
from kvq_testing import real_models
from kvq_testing.helpers import tiny_model
from kvq_testing.server import ServerProcess

from mlx_kvq.blas import use_linked_blas
from mlx_kvq.caches import Pages, exact_trim_limit, page_caches
from mlx_kvq.config import KVConfig
from mlx_kvq.engine.prompt_cache import PromptCache
from mlx_kvq.generate import get_plan

TOKENS = mx.random.randint(0, 128, (1, 200), key=mx.random.key(4))
CHUNKINGS = [[37, 100, 63], [16] * 12 + [8], [150, 50], [9, 191]]


def _split(sinks: int) -> KVConfig:
    """Per-channel keys in groups of 32, the last 8 exact, rotated."""
    return KVConfig(
        bits=4, group_size=32, key_scales="channel", key_group_size=32, residual=8,
        sinks=sinks, rotation="hadamard",
    )  # fmt: skip


def _logits(model, plan, chunks: list[int], paged: bool) -> mx.array:
    cache = plan.make_cache()
    if paged:
        cache = [type(c).merge([c]) for c in page_caches(cache, Pages(32))]
    out, at = [], 0
    for n in chunks:
        out.append(model(TOKENS[:, at : at + n], cache=cache))
        at += n
    return mx.concatenate(out, axis=1)


@pytest.mark.parametrize(
    "model_type,kv,paged",
    [
        ("llama", _split(0), False),
        ("llama", _split(4), False),
        ("llama", _split(0), True),
        ("llama", _split(4), True),
        ("gemma3_text", KVConfig(bits=4), True),  # windows of 8 in blocks of 32
    ],
)
def test_logits_do_not_depend_on_the_chunks(model_type, kv, paged):
    """Every chunking of 200 tokens gives the same logits, bit for bit, and
    those of a decode token by token to float rounding (another product
    path). Before, a split layer's chunk read the blocks it had quantized
    (0.28 apart from the decode), and a window's sums started at the first
    key it held.

    On the reference BLAS: OpenBLAS multiplies this model's small matrices
    with kernels chosen by their row count, so its K/V differ in the last
    bits between a 16-row and a 200-row chunk, and a quantization level can
    flip (real models' products take one kernel; the server test below)."""
    with use_linked_blas():
        model = tiny_model(model_type)
        plan = get_plan(model, kv)
        whole = _logits(model, plan, [200], paged)
        for chunks in CHUNKINGS:
            assert mx.array_equal(_logits(model, plan, chunks, paged), whole).item(), chunks
        decoded = _logits(model, plan, [1] * 200, paged)
        assert mx.abs(decoded - whole).max().item() < 1e-2
        assert mx.array_equal(decoded.argmax(-1), whole.argmax(-1)).item()


def test_a_prompt_cache_copy_is_cut_back_only_where_it_holds_what_a_decode_would():
    """A split layer's body cannot give its tokens back exact: the prompt
    cache serves a prefix of an entry only where the cut stays in the exact
    tail past the last `residual`, and keeps a shorter entry the longer one
    cannot serve exactly."""
    model = tiny_model("llama")
    plan = get_plan(model, _split(4))
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


def _questions() -> list[tuple[list[dict], dict]]:
    """Four chat prompts of 300-500 tokens (slices of a standard-library
    module's source, each past the split layout's first flush), two greedy
    and two seeded."""
    source = Path(json.__file__).read_text().split()
    spans = ((0, 260), (300, 330), (700, 300), (1000, 360))
    sampling = ({"temperature": 0}, {"temperature": 0.8, "seed": 7})
    return [
        ([{"role": "user", "content": "Explain: " + " ".join(source[s : s + n])}], sampling[i % 2])
        for i, (s, n) in enumerate(spans)
    ]


def _answer(client, question: tuple[list[dict], dict]) -> tuple[str, list[float]]:
    messages, sampling = question
    r = client.chat.completions.create(
        model="default_model", messages=messages, max_tokens=16, logprobs=True, **sampling
    )
    choice = r.choices[0]
    return choice.message.content, [t.logprob for t in choice.logprobs.content]


def test_a_real_model_answers_alike_alone_together_and_from_the_prompt_cache():
    """SmolLM2 at the default setting, through the HTTP server: each prompt
    alone on a fresh server, all at once on another, then each again alone
    there (its prompt cache then holds every prompt): the same text and the
    same log-probabilities, greedy and seeded. Before, prompts past 300
    tokens parted (the split layer's chunks, the product path by batch
    rows, prompt-cache copies cut into quantized blocks)."""
    real_models.converted("smollm")
    questions = _questions()
    with ServerProcess(real_models.smollm_gguf()) as s:
        s.wait_ready()
        alone = [_answer(s.client(), q) for q in questions]
    with ServerProcess(real_models.smollm_gguf()) as s:
        s.wait_ready()
        client = s.client()
        with ThreadPoolExecutor(len(questions)) as pool:
            together = list(pool.map(lambda q: _answer(client, q), questions))
        cached = [_answer(client, q) for q in questions]
        assert s.metrics().get("mlx_kvq_prompt_cache_hits_total", 0) >= len(questions)
    assert together == alone
    assert cached == alone

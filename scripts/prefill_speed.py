"""Prefill on MLX's CPU backend: where a long prompt's time goes, and what
mlx-kvq's attention changes, in one process on one real model and BLAS.

1. The softmax of one layer's scores for a `--chunk`-token chunk over
   `--tokens` keys (the model's head counts): MLX's `mx.softmax` against the
   native causal softmax (`mlx_kvq.kernels.causal_softmax`).
2. A `--tokens`-token prompt prefilled in `--chunk`-token chunks through
   mlx-lm's `KVCache`, first with mlx-lm's attention (`mx.fast`), then with
   mlx-kvq's installed (blocked products, the native softmax).
3. One row decoding at that context through mlx-lm's `BatchGenerator` over
   the plan's caches: raw paged, paged at the full-attention default (K6/V5 +
   rotation), raw padded rows.

    OPENBLAS_NUM_THREADS=1 MLX_KVQ_NATIVE_THREADS=1 python scripts/prefill_speed.py \\
        --model /work/models/smollm2-135m-f32 --tokens 4096 --chunk 2048
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from mlx_kvq import attention, kernels
from mlx_kvq.blas import use_fast_blas
from mlx_kvq.caches import Pages, page_caches
from mlx_kvq.config import KVConfig
from mlx_kvq.defaults import DEFAULT_FULL_KV_CONFIG
from mlx_kvq.plan import plan_kv

TEXT = Path("/usr/share/common-licenses/GPL-3")


def _ms(f, n: int = 3) -> float:
    f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1000


def softmax(model, tokens: int, chunk: int) -> None:
    args = model.args
    heads, kv = args.num_attention_heads, args.num_key_value_heads
    scores = mx.random.normal((1, kv, heads // kv * chunk, tokens), key=mx.random.key(0))
    mx.eval(scores)
    shift = (tokens - chunk,)
    mine = _ms(lambda: mx.eval(kernels.causal_softmax(scores, shift, 0, heads // kv, None)))
    theirs = _ms(lambda: mx.eval(mx.softmax(scores, axis=-1, precise=True)))
    print(f"softmax, {scores.size:,} scores: mx.softmax {theirs:.0f} ms, native {mine:.0f} ms")


def prefill(model, prompt: list[int], chunk: int) -> float:
    cache = make_prompt_cache(model)
    x = mx.array(prompt)[None]
    start = time.perf_counter()
    for i in range(0, len(prompt), chunk):
        model(x[:, i : i + chunk], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - start


def decode_step_ms(model, prompt: list[int], kv: KVConfig, paged: bool, steps: int = 24) -> float:
    cache = plan_kv(model, kv, batch=True).make_cache()
    if paged:
        cache = page_caches(cache, Pages(32))
    bg = BatchGenerator(model, completion_batch_size=1, prefill_batch_size=1)
    bg.insert([prompt], max_tokens=[steps + 4], caches=[cache])
    times = []
    while len(times) < steps + 4:
        start = time.perf_counter()
        _, out = bg.next()
        if out:
            times.append(time.perf_counter() - start)
    bg.close()
    return statistics.median(times[4:]) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=2048)
    a = ap.parse_args()
    print("BLAS:", use_fast_blas().summary())
    print(kernels.native_status().summary())
    model, tokenizer = load(a.model)
    ids = tokenizer.encode(TEXT.read_text())
    prompt = (ids * (a.tokens // len(ids) + 1))[: a.tokens]
    softmax(model, a.tokens, a.chunk)
    theirs = prefill(model, prompt, a.chunk)
    attention.install()
    mine = prefill(model, prompt, a.chunk)
    print(
        f"prefill of {a.tokens} tokens: mlx-lm's attention {theirs:.1f} s, mlx-kvq's {mine:.1f} s"
    )
    for label, kv, paged in (
        ("raw paged", KVConfig(), True),
        ("default paged", DEFAULT_FULL_KV_CONFIG, True),
        ("raw padded", KVConfig(), False),
    ):
        print(
            f"decode at {a.tokens} tokens, {label}: {decode_step_ms(model, prompt, kv, paged):.1f} ms"
        )


if __name__ == "__main__":
    main()

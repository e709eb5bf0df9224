"""Sessions at once under a KV budget, paged layout against padded rows.

Two agent-traffic scenarios on a synthetic long-context model (gemma3_text
shapes, random weights, no EOS: every session stops after `--answer`
tokens, as chats with `max_tokens: 32000` stop after a few hundred; the
engine reserves nothing for `max_tokens`):

- mixed: one 15k-token session and fifteen 1k-token ones, under a budget of
  1.25x the bytes the sixteen really hold at their end (their tokens at the
  plan's bytes per token, windows at their size);
- shared: sixteen sessions that share an 8k-token system prompt (a prompt
  cache checkpoint at its end, as chat requests get) and add their own
  tokens, under 1.5x what one session and the fifteen others' own tokens
  hold. The first session runs alone first, as the one that put the system
  prompt in the prompt cache.
- simultaneous: the same sixteen sessions under the same budget, all sent at
  once (parallel subagents, agents reconnecting after a restart): the others
  wait for the system prompt the first one is prefilling, then map it.

Reported: sessions decoding at once (the most), the budget, the most bytes
held, overruns, prompt tokens computed against one prefix plus every
session's own tokens, and a digest of the sixteen answers (the same in
`shared` and `simultaneous` when the text does not change). Run niced, one
layout at a time:

    nice -n 10 python scripts/paged_scenarios.py mixed --layout paged
    nice -n 10 python scripts/paged_scenarios.py mixed --layout padded
    nice -n 10 python scripts/paged_scenarios.py shared --layout paged
    nice -n 10 python scripts/paged_scenarios.py simultaneous --layout paged
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import threading
import time

import mlx.core as mx

from mlx_kvq.bench.model_bench import build_model
from mlx_kvq.bench.serving_bench import BenchTokenizer, Completions
from mlx_kvq.blas import use_fast_blas
from mlx_kvq.defaults import DEFAULT_KV_CONFIG
from mlx_kvq.engine import Engine, EngineOptions, GenerationRequest, SamplingParams, TokenEvent
from mlx_kvq.engine.requests import Checkpoint, Segment
from mlx_kvq.plan import plan_kv

MODEL = dict(
    model_type="gemma3_text", hidden_size=64, num_hidden_layers=3, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=1024,
    sliding_window=512, sliding_window_pattern=3, query_pre_attn_scalar=128,
    max_position_embeddings=65536,
)  # fmt: skip


def held(plan, tokens: int, own: int | None = None) -> int:
    """Bytes a session of `tokens` tokens really holds: every full-attention
    layer its tokens (or `own` of them, the rest shared), every window its size."""
    total = 0
    for p in plan.kv_layers:
        n = (tokens if own is None else own) if p.window is None else min(tokens, p.window)
        total += int(p.bytes_per_token() * n)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenario", choices=["mixed", "shared", "simultaneous"])
    ap.add_argument("--layout", choices=["paged", "padded"], default="paged")
    ap.add_argument("--answer", type=int, default=300, help="tokens each session generates")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--log", action="store_true", help="the engine's log on stderr")
    ap.add_argument("--answers", help="write the sixteen answers' tokens to this JSON file")
    args = ap.parse_args()
    use_fast_blas()  # as the server runs
    if args.log:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    model = build_model(MODEL, mx.float32, 0)
    plan = plan_kv(model, DEFAULT_KV_CONFIG, batch=True)
    vocab = MODEL["vocab_size"]
    rng = mx.random.key(0)
    a = args.answer
    if args.scenario == "mixed":
        lengths = [15_000] + [1_000] * 15
        prompts = [mx.random.randint(1, vocab, (n,), key=mx.random.split(rng, 16)[i]).tolist()
                   for i, n in enumerate(lengths)]  # fmt: skip
        really = sum(held(plan, n + a) for n in lengths)
        budget = int(1.25 * really)
        first, rest, checkpoints = [], prompts, ()
    else:
        system = mx.random.randint(1, vocab, (8_000,), key=rng).tolist()
        own = 200
        prompts = [
            system + mx.random.randint(1, vocab, (own,), key=mx.random.split(rng, 17)[i]).tolist()
            for i in range(16)
        ]
        really = held(plan, 8_000 + own + a) + 15 * held(plan, 8_000 + own + a, own + a)
        budget = int(1.5 * really)
        checkpoints = (Checkpoint(8_000, Segment.SYSTEM),)
        first, rest = (
            ([], prompts) if args.scenario == "simultaneous" else (prompts[:1], prompts[1:])
        )
        own_tokens = 16 * own

    options = EngineOptions(
        decode_concurrency=16, prompt_cache_size=64, kv_cache_memory=budget,
        block_size=args.block_size if args.layout == "paged" else None,
        max_context=plan.max_context,
    )  # fmt: skip
    engine = Engine(model, BenchTokenizer(vocab), plan, DEFAULT_KV_CONFIG, options)
    engine.start()
    engine.readiness.ready_event.wait(3600)
    assert engine.readiness.ready, engine.readiness.get()
    params = SamplingParams(max_tokens=a, temperature=0.0)
    answers: dict[int, list[int]] = {}
    lock = threading.Lock()

    def collect(i: int, ends: Completions):
        def sink(event) -> None:
            if isinstance(event, TokenEvent):
                with lock:
                    answers.setdefault(i, []).append(event.token)
            ends.end(event)

        return sink

    t0 = time.perf_counter()
    try:
        if first:  # the session that puts the system prompt in the prompt cache
            ends = Completions(1)
            engine.submit(GenerationRequest(first[0], params, checkpoints=checkpoints), ends.end)
            ends.wait("first session")
        engine.metrics.max_batch_size = 0
        computed = engine.metrics.snapshot().prompt_tokens
        ends = Completions(len(rest) + len(first))
        for i, p in enumerate(first + rest):
            request = GenerationRequest(p, params, checkpoints=checkpoints)
            engine.submit(request, collect(i, ends))
        ends.wait("sessions")
    finally:
        engine.stop()
    ledger = engine.budget
    s = engine.metrics.snapshot()
    extra = {}
    if args.answers:
        with open(args.answers, "w") as f:
            json.dump([answers.get(i) for i in range(len(first) + len(rest))], f)
    if args.scenario != "mixed":
        # prompt tokens computed for the sixteen (the last one's last token included),
        # against one prefix and every session's own tokens
        done = s.prompt_tokens - computed
        extra = {
            "prompt_tokens_computed": done,
            "over_one_prefix_and_own": round(done / (8_000 + own_tokens), 3),
            "answers_digest": hashlib.sha256(
                json.dumps([answers.get(i) for i in range(16)]).encode()
            ).hexdigest()[:16],
        }
    print(json.dumps({
        "scenario": args.scenario, "layout": engine.layout.description,
        "sessions": len(first) + len(rest), "at_once": s.max_batch_size,
        "really_held": really, "budget": budget, "budget_over_really": round(budget / really, 3),
        "peak_held": ledger.peak_held, "overruns": ledger.overruns,
        "bound_misses": ledger.bound_misses, "preemptions": s.preemptions,
        "prefix_blocks_reused": s.prefix_blocks_reused, **extra,
        "seconds": round(time.perf_counter() - t0, 1),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()

"""Decode speed of KV settings and layouts against mlx-lm's unquantized
cache, on a real model, in one process on one BLAS.

Every arm runs mlx-lm's `BatchGenerator` (as `paged_speed.py` does) over
the same random prompts: mlx-lm's own caches (unquantized, the model's
dtype: what `mlx_lm.server` decodes with), then mlx-kvq settings, paged
or in padded rows. All are prefilled first, then rounds of decode steps
are timed, arms alternating (load from other processes falls on all
alike); each arm's median tokens/s and its ratio to the first arm:

    OPENBLAS_NUM_THREADS=1 MLX_KVQ_NATIVE_THREADS=1 python scripts/decode_speed.py \\
      --model /work/models/smollm2-135m-f32 --context 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from paged_speed import decode_rate, prefilled

from mlx_kvq.blas import blas_info, use_fast_blas
from mlx_kvq.caches import Pages, page_caches
from mlx_kvq.config import AUTO_BLOCK_SIZE, KVConfig
from mlx_kvq.defaults import DEFAULT_FULL_KV_CONFIG, DEFAULT_KV_CONFIG
from mlx_kvq.engine.runner import choose_layout
from mlx_kvq.kernels import native_status
from mlx_kvq.plan import plan_kv

# The per-token full-attention default before the split layout: keys 6 bits,
# values 5 bits, rotation, nothing exact.
PER_TOKEN = KVConfig(bits=6, value_bits=5, group_size=64, rotation="hadamard")
# The split layout the rule picks on Gemma 3 (docs/quality.md): keys 6 bits
# per channel, values 5 bits, no rotation, 4 sinks, the last 64 tokens exact.
HYBRID_SPLIT = KVConfig(
    bits=6, value_bits=5, group_size=64, key_scales="channel", key_group_size=128, sinks=4,
    residual=64,
)  # fmt: skip
# name -> (setting, block size; 0: padded, AUTO_BLOCK_SIZE: the server's default)
ARMS: dict[str, tuple[KVConfig, int | str] | None] = {
    "mlx-lm": None,
    "raw paged": (KVConfig(bits=0), 32),
    "default paged": (DEFAULT_FULL_KV_CONFIG, AUTO_BLOCK_SIZE),
    "default padded": (DEFAULT_FULL_KV_CONFIG, 0),
    "4-bit paged": (KVConfig(bits=4), 32),
    "K6/V5 paged": (PER_TOKEN, AUTO_BLOCK_SIZE),
    "K6/V5 padded": (PER_TOKEN, 0),
    "hybrid default paged": (DEFAULT_KV_CONFIG, AUTO_BLOCK_SIZE),
    "hybrid split padded": (HYBRID_SPLIT, 0),
    "hybrid split paged": (HYBRID_SPLIT, 128),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens per stream")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per arm")
    ap.add_argument(
        "--arms", default="mlx-lm,raw paged,default paged,default padded,K6/V5 paged",
        help=f"comma-separated, the first is the baseline; of: {', '.join(ARMS)}",
    )  # fmt: skip
    args = ap.parse_args()
    names = args.arms.split(",")
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; known: {', '.join(ARMS)}")
    use_fast_blas()
    model, _ = load(args.model)
    vocab = model.args.vocab_size
    keys = mx.random.split(mx.random.key(0), args.streams)
    prompts = [mx.random.randint(1, vocab, (args.context,), key=k).tolist() for k in keys]
    print(blas_info().summary(), native_status().summary(), f"load {os.getloadavg()}", sep="\n")
    gens = {}
    for name in names:
        arm = ARMS[name]
        if arm is None:
            make = lambda: make_prompt_cache(model)  # noqa: E731
        else:
            cfg, block_size = arm
            plan = plan_kv(model, cfg, batch=True)
            make = plan.make_cache
            if block_size == AUTO_BLOCK_SIZE:
                block_size = choose_layout(plan, AUTO_BLOCK_SIZE).block_size
            if block_size:
                pages = Pages(block_size)
                make = lambda plan=plan, pages=pages: page_caches(plan.make_cache(), pages)  # noqa: E731
        gens[name] = prefilled(model, make, prompts, args.steps * args.rounds + 1)
        print("prefilled", name, flush=True)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            rates[n].append(decode_rate(gens[n], args.steps))
    for bg in gens.values():
        bg.close()
    median = {n: statistics.median(x) for n, x in rates.items()}
    out = {
        "context": args.context, "streams": args.streams,
        "median_tok_s": {n: round(m, 2) for n, m in median.items()},
        "vs_first": {n: round(m / median[names[0]], 2) for n, m in median.items()},
        "rounds_tok_s": {n: [round(v, 2) for v in x] for n, x in rates.items()},
        "load_after": os.getloadavg(),
    }  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

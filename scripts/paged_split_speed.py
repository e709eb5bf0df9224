"""Decode speed of the split layout in block pools, against paged plain 4-bit
and the padded split layout, on a real model, same process and BLAS.

Every arm runs mlx-lm's `BatchGenerator` (as `paged_speed.py` does) over
the same prompts: paged `--kv-bits 4`, the split setting paged, the split
setting in padded rows. All are prefilled first, then rounds of decode
steps are timed, arms alternating (load from other processes falls on all
alike), and each arm's median tokens/s reported:

    OPENBLAS_NUM_THREADS=1 python scripts/paged_split_speed.py \\
      --model /work/models/smollm2-135m-f32 --context 4096
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import mlx.core as mx
from mlx_lm import load
from paged_speed import decode_rate, prefilled

from mlx_kvq.blas import blas_info, use_fast_blas
from mlx_kvq.caches import Pages, page_caches
from mlx_kvq.config import KVConfig
from mlx_kvq.kernels import native_status
from mlx_kvq.plan import plan_kv

SPLIT = dict(key_scales="channel", key_group_size=128, sinks=4, residual=64, group_size=64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=4096, help="prompt tokens per stream")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed round")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per arm")
    ap.add_argument("--block-size", type=int, default=128)
    args = ap.parse_args()
    use_fast_blas()
    model, _ = load(args.model)
    arms = {
        "paged 4-bit": (KVConfig(bits=4), True),
        "paged split K4/V4": (KVConfig(bits=4, **SPLIT), True),
        "padded split K4/V4": (KVConfig(bits=4, **SPLIT), False),
    }
    vocab = model.args.vocab_size
    keys = mx.random.split(mx.random.key(0), args.streams)
    prompts = [mx.random.randint(1, vocab, (args.context,), key=k).tolist() for k in keys]
    print(blas_info().summary(), native_status().summary(), f"load {os.getloadavg()}", sep="\n")
    gens = {}
    for name, (cfg, paged) in arms.items():
        plan = plan_kv(model, cfg, batch=True)
        pages = Pages(args.block_size)
        make = plan.make_cache
        if paged:
            make = lambda plan=plan, pages=pages: page_caches(plan.make_cache(), pages)  # noqa: E731
        gens[name] = prefilled(model, make, prompts, args.steps * args.rounds + 1)
        print("prefilled", name, flush=True)
    rates: dict[str, list[float]] = {a: [] for a in arms}
    names = list(arms)
    for r in range(args.rounds):
        for a in names if r % 2 == 0 else names[::-1]:
            rates[a].append(decode_rate(gens[a], args.steps))
    for bg in gens.values():
        bg.close()
    out = {
        "context": args.context, "streams": args.streams, "block_size": args.block_size,
        "median_tok_s": {a: round(statistics.median(x), 1) for a, x in rates.items()},
        "rounds_tok_s": {a: [round(v, 1) for v in x] for a, x in rates.items()},
        "load_after": os.getloadavg(),
    }  # fmt: skip
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

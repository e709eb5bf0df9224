"""Decode speed, paged layout against mlx-lm's padded rows, same process and BLAS.

Both arms run mlx-lm's `BatchGenerator` over the same synthetic model
(`paged_scenarios.MODEL`, random weights, float32) with the default KV
setting; the padded arm uses the plan's caches (left-padded batch rows),
the paged arm the same caches in block pools. Whatever BLAS `mlx_kvq.blas`
loads (OpenBLAS on Linux by default) serves both. Both arms' prompts are
prefilled first, then rounds of decode steps are timed, arms alternating
(load from other processes falls on both alike), and the median tokens/s
of each arm reported with the paged/padded ratio, the BLAS and the load:

    nice -n 10 python scripts/paged_speed.py            # 1 stream, 16 equal, mixed
    nice -n 10 python scripts/paged_speed.py --quick    # shorter contexts
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from paged_scenarios import MODEL

from mlx_kvq.bench.model_bench import build_model
from mlx_kvq.blas import blas_info, use_fast_blas
from mlx_kvq.caches import Pages, page_caches
from mlx_kvq.defaults import DEFAULT_KV_CONFIG
from mlx_kvq.kernels import native_status
from mlx_kvq.plan import plan_kv


def prefilled(model, make_cache, prompts: list[list[int]], steps: int) -> BatchGenerator:
    """A generator over `prompts` with their prefill done, ready for `steps` decode steps."""
    bg = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=8)
    bg.insert(
        prompts, max_tokens=[steps + 4] * len(prompts), caches=[make_cache() for _ in prompts]
    )
    while len(bg._generation_batch) < len(prompts):  # prefill
        bg.next()
    bg.next()
    return bg


def decode_rate(bg: BatchGenerator, steps: int) -> float:
    """Decode tokens/s of the next `steps` steps of `bg`."""
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        _, responses = bg.next()
        tokens += len(responses)
    mx.eval([])
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed round")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per arm")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--cases", default="one,equal,mixed", help="of one, equal, mixed")
    args = ap.parse_args()
    use_fast_blas()  # both arms on OpenBLAS, as the server runs
    long, short = (2048, 256) if args.quick else (4096, 512)
    vocab = MODEL["vocab_size"]
    cases = {
        "one": ("1 stream", [long]),
        "equal": ("16 equal", [short * 2] * 16),
        "mixed": ("mixed (1 long + 15 short)", [long] + [short // 2] * 15),
    }
    model = build_model(MODEL, mx.float32, 0)
    plan = plan_kv(model, DEFAULT_KV_CONFIG, batch=True)
    out = {
        "blas": blas_info().summary(), "native": native_status().summary(),
        "load_before": os.getloadavg(), "cases": {},
    }  # fmt: skip
    print(out["blas"], out["native"], f"load {out['load_before']}", sep="\n", flush=True)
    for case in args.cases.split(","):
        name, lengths = cases[case]
        key = mx.random.key(len(lengths))
        prompts = [
            mx.random.randint(1, vocab, (n,), key=mx.random.split(key, len(lengths))[i]).tolist()
            for i, n in enumerate(lengths)
        ]
        pages = Pages(args.block_size)
        makers = {
            "padded": plan.make_cache,
            "paged": lambda pages=pages: page_caches(plan.make_cache(), pages),
        }
        # Both arms prefilled once, then timed in alternating rounds, so that
        # load from other processes falls on both alike.
        gens = {arm: prefilled(model, make, prompts, args.steps * args.rounds + 1)
                for arm, make in makers.items()}  # fmt: skip
        rates: dict[str, list[float]] = {"padded": [], "paged": []}
        for r in range(args.rounds):
            for arm in ("padded", "paged") if r % 2 == 0 else ("paged", "padded"):
                rates[arm].append(decode_rate(gens[arm], args.steps))
        for bg in gens.values():
            bg.close()
        padded, paged = (statistics.median(rates[a]) for a in ("padded", "paged"))
        out["cases"][name] = {
            "lengths": f"{len(lengths)} x {sorted(set(lengths))}",
            "padded_tok_s": round(padded, 1), "paged_tok_s": round(paged, 1),
            "paged_over_padded": round(paged / padded, 3),
            "rounds_tok_s": {a: [round(x, 1) for x in r] for a, r in rates.items()},
        }  # fmt: skip
        print(name, out["cases"][name], flush=True)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""What a model computes in on MLX's CPU backend, timed: float32 against
bfloat16 and float16 weights, and packed quantized weights with and without
`mlx_kvq.compute`'s batches through the BLAS, against dense float32.

    python scripts/cpu_compute.py --model DIR [--quantized DIR] [--prompt 256] [--rounds 3]

`--model` is a dense (float32 or half-precision) model; `--quantized` the
same model with packed weights (`mlx-kvq convert FILE.gguf DIR`). Every arm
is timed in the same process, in alternating rounds (the best of each), on
a prefill of `--prompt` tokens and on single-token decode steps after it.
OpenBLAS is bound first, as every mlx-kvq command does.
"""

from __future__ import annotations

import argparse
import os
import time

import mlx.core as mx


def _time(model, prompt: int, decode: int) -> tuple[float, float]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = mx.array([[11] * prompt])
    start = time.perf_counter()
    mx.eval(model(x, cache=cache))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(decode):
        mx.eval(model(mx.array([[7]]), cache=cache))
    return prefill, (time.perf_counter() - start) / decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantized", default=None)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from mlx_lm import load

    import mlx_kvq
    from mlx_kvq.compute import prepare

    print(mlx_kvq.use_fast_blas())
    arms = {}
    for dtype in ("float32", "bfloat16", "float16"):
        model = load(args.model)[0]
        model.set_dtype(getattr(mx, dtype))
        arms[f"dense {dtype}"] = model
    if args.quantized:
        arms["packed, MLX's quantized product"] = load(args.quantized)[0]
        fast = load(args.quantized)[0]
        prepare(fast)
        arms["packed, batches through the BLAS (compute.prepare)"] = fast
    best = {name: [float("inf"), float("inf")] for name in arms}
    for _ in range(args.rounds):
        for name, model in arms.items():
            p, d = _time(model, args.prompt, args.decode)
            best[name] = [min(best[name][0], p), min(best[name][1], d)]
    base = best["dense float32"]
    print(f"load average {os.getloadavg()[0]:.1f}; best of {args.rounds} alternating rounds")
    print(f"| weights | prefill {args.prompt} (s) | vs float32 | decode step (ms) | vs float32 |")
    print("|---|---:|---:|---:|---:|")
    for name, (p, d) in best.items():
        print(f"| {name} | {p:.3f} | {p / base[0]:.2f}x | {d * 1e3:.1f} | {d / base[1]:.2f}x |")


if __name__ == "__main__":
    main()

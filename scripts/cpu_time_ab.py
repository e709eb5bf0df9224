"""CPU-time A/B of the benchmark model: unquantized against 4-bit caches.

python scripts/cpu_time_ab.py --dtype float32 --contexts 4096,16384 [--what decode,prefill]
    [--rounds 5] [--reference-blas]

The bench (`mlx-kvq bench`) times wall clock, which on a shared machine moves
with everyone else's load. This script times the process's CPU seconds
(`time.process_time`, all threads), which the load barely moves when the
process runs single-threaded: run it with OPENBLAS_NUM_THREADS=1 and
MLX_KVQ_NATIVE_THREADS=1 (spinning BLAS threads would count). The two arms
alternate round by round (A B, then B A) and a ratio is the median of the
per-round ratios (unquantized CPU time over 4-bit CPU time; above 1 means
4-bit is cheaper). MLX_KVQ_NATIVE=0 measures quantized decode without the
native kernels (mx.quantized_matmul, as before them). Decode: two greedy steps per sample; prefill: one
128-token chunk on top of context - 128 cached tokens, as the bench does.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import mlx.core as mx

from mlx_kvq import blas
from mlx_kvq.bench.model_bench import (
    CacheMaker,
    Decoder,
    build_model,
    cache_arrays,
    fill,
    kv_shapes,
)
from mlx_kvq.bench.settings import MODELS
from mlx_kvq.kernels import native_status


def _ratio_line(label: str, samples: dict) -> str:
    unq, q4 = samples[None], samples[4]
    ratios = [u / q for u, q in zip(unq, q4, strict=True)]
    return (
        f"{label}: unquantized {statistics.median(unq) * 1e3:.1f} ms, 4-bit "
        f"{statistics.median(q4) * 1e3:.1f} ms, ratio {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} rounds)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--contexts", default="4096,16384")
    p.add_argument("--what", default="decode,prefill")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model-size", default="small", choices=sorted(MODELS))
    p.add_argument("--reference-blas", action="store_true", help="both arms on MLX's linked BLAS")
    args = p.parse_args()
    dtype = getattr(mx, args.dtype)
    blas.use_fast_blas()  # the bench's setup: both arms on OpenBLAS unless --reference-blas
    stack = contextlib.ExitStack()
    if args.reference_blas:
        stack.enter_context(blas.use_linked_blas())
    with stack:
        print(f"BLAS: {blas.blas_info().summary()}")
        print(native_status().summary())
        model = build_model(MODELS[args.model_size], dtype)
        shapes, make = kv_shapes(model), CacheMaker(model, 64)
        for ctx in (int(c) for c in args.contexts.split(",")):
            if "decode" in args.what:
                decoders = {b: Decoder(model, fill(make(b), ctx, shapes, dtype)) for b in (None, 4)}
                for d in decoders.values():
                    d.step()
                samples: dict = {None: [], 4: []}
                for r in range(args.rounds):
                    for b in (None, 4) if r % 2 == 0 else (4, None):
                        t = time.process_time()
                        decoders[b].step()
                        decoders[b].step()
                        samples[b].append((time.process_time() - t) / 2)
                print(_ratio_line(f"{args.dtype} {ctx} decode step", samples), flush=True)
                del decoders
            if "prefill" in args.what:
                tokens = mx.random.randint(0, 1000, (1, 128))
                samples = {None: [], 4: []}
                for r in range(args.rounds):
                    for b in (None, 4) if r % 2 == 0 else (4, None):
                        caches = fill(make(b), ctx - 128, shapes, dtype)
                        t = time.process_time()
                        logits = model(tokens, cache=caches)
                        mx.eval(logits[:, -1, :], cache_arrays(caches))
                        samples[b].append(time.process_time() - t)
                print(_ratio_line(f"{args.dtype} {ctx} prefill chunk", samples), flush=True)
            mx.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

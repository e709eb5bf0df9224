"""What `mlx-kvq eval` costs against the forward passes it needs.

    python scripts/eval_cost.py --model /work/models/smollm2-135m-f32 \
        --text /usr/share/common-licenses/GPL-3 --kv-bits 4 --rounds 2

An eval of one setting needs two chunked forward passes per window: the
unquantized reference and the setting. This times, in alternating rounds of
one process (load from other processes falls on every arm alike), those
passes alone (the caches filled chunk by chunk, the logits computed, nothing
scored) and `evaluate_many` on the same windows, and prints the ratios: the
whole eval against both passes, and each setting's share (its passes and its
scores) against its passes alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import mlx.core as mx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlx_kvq.blas import blas_info, use_fast_blas  # noqa: E402
from mlx_kvq.config import KVConfig  # noqa: E402
from mlx_kvq.evaluate import (  # noqa: E402
    _make_cache,
    _spans,
    cut_windows,
    evaluate_many,
    load_eval_inputs,
)


def passes(model, wins: list, cfg: KVConfig, chunk: int) -> float:
    """Seconds of the chunked forward passes of `cfg` over `wins`, logits evaluated."""
    t0 = time.perf_counter()
    for w in wins:
        cache = _make_cache(model, cfg)
        ids = mx.array(w)
        for s, e in _spans(len(w) - 1, chunk, 0):
            mx.eval(model(ids[None, s:e], cache=cache))
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--text", type=Path, required=True)
    p.add_argument("--kv-bits", type=int, default=4)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    use_fast_blas()
    print(f"{blas_info()}; load {os.getloadavg()[0]:.1f}", flush=True)
    model, _, texts = load_eval_inputs(args.model, [args.text])
    ((ids, bos),) = texts.values()
    wins = cut_windows(ids, args.context, args.windows, bos)
    cfg = KVConfig(bits=args.kv_bits)
    passes(model, wins[:1], cfg, args.chunk)  # warm-up: first-call costs fall on no arm
    for r in range(args.rounds):
        ref = passes(model, wins, KVConfig(), args.chunk)
        one = passes(model, wins, cfg, args.chunk)
        t0 = time.perf_counter()
        (res,) = evaluate_many(
            model, ids, [cfg], context=args.context, chunk=args.chunk, windows=args.windows,
            bos=bos, progress=False,
        )  # fmt: skip
        total = time.perf_counter() - t0
        print(
            f"round {r + 1}: passes: reference {ref:.1f} s, setting {one:.1f} s; eval "
            f"{total:.1f} s (reference {res['reference_seconds']:.1f} s, setting "
            f"{res['seconds']:.1f} s, bytes held {total - res['reference_seconds'] - res['seconds']:.1f} s); "
            f"eval / both passes {total / (ref + one):.2f}x, setting / its passes "
            f"{res['seconds'] / one:.2f}x; load {os.getloadavg()[0]:.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

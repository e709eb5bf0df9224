"""A decode step of mlx-lm's batch against the bare forward it runs.

    OPENBLAS_NUM_THREADS=1 python scripts/forward_cost.py --model /work/models/smollm2-135m-f32 --rows 16

In one process (OpenBLAS bound, as mlx-kvq's commands do), ROWS prompts of
80 token ids decode side by side in mlx-lm's `BatchGenerator`; the median of
its steps is printed beside the median of the bare forward at the same batch
and context (`model(x)` with its logits evaluated) and of the forward with
the log-softmax and argmax mlx-lm's step adds. What is left between them is
the batch's own work.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm import load  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlx_kvq.blas import use_fast_blas  # noqa: E402

PROMPT = 80


def median_ms(fn, n: int = 30) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=16)
    args = p.parse_args(argv)
    use_fast_blas()
    model, _ = load(args.model)
    prompts = [[(7 * i + 13 * j) % 4000 + 100 for j in range(PROMPT)] for i in range(args.rows)]
    bg = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=args.rows)
    bg.insert(prompts, max_tokens=[200] * args.rows)
    decoding = 0
    while decoding < 20:  # past the prompts, into decoding
        decoding += bool(bg.next()[1])
    step = median_ms(bg.next, 40)
    cache = make_prompt_cache(model)
    model(mx.array(prompts), cache=cache)
    mx.eval([c.state for c in cache])
    x = mx.array([[5]] * args.rows)

    def forward():
        mx.eval(model(x, cache=cache))

    def forward_and_sample():
        logits = model(x, cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(mx.argmax(logprobs, -1), logprobs)

    print(
        f"{args.rows} rows: BatchGenerator step {step:.1f} ms; bare forward {median_ms(forward):.1f} ms; "
        f"with log-softmax and argmax {median_ms(forward_and_sample):.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

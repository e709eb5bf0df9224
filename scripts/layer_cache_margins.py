"""Why 8-bit KV changes deepseek_v41's greedy tokens on tiny random weights.

python scripts/layer_cache_margins.py [--seeds 8]

For weight seeds 0..N-1 of the tiny catalogue model (tests/kvq_testing/archs.py),
with the model's own FP8 / FP4 rounding of its activations on (as shipped) and
off, and llama for comparison:

- greedy: tokens equal to the unquantized run's, of 9 (8-bit planned cache;
  the 40-token prompt in two chunks, then 8 decode steps fed back);
- teacher-forced on the unquantized run's tokens (10 positions per seed): top-1
  flips, the median and largest per-position max |logit change|, and whether
  every flip has a top-2 margin below that position's change (a tie);
- the same for the window's 8-bit error scaled by t (a sensitivity probe);
- whether the mlx-lm cache's fields survive a bfloat16 round trip exactly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # kvq_testing

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from kvq_testing import archs  # noqa: E402
from kvq_testing.layer_cache import FIELDS, RoundTripLayerCache, forced_logits  # noqa: E402
from mlx_lm.models import deepseek_v41  # noqa: E402

import mlx_kvq  # noqa: E402
from mlx_kvq.config import QuantSpec  # noqa: E402

DECODE = 8
Q8 = QuantSpec(8)


def _greedy(model, cache) -> list[int]:
    _, logits = archs.run_forward(model, cache=cache, decode_steps=DECODE, return_logits=True)
    return [int(mx.argmax(lg[0])) for lg in logits[len(archs.PREFILL_CHUNKS) - 1 :]]


def _row(label: str, name: str, seeds: int, scales: tuple[float, ...]) -> None:
    agree, flips, ties, deltas = [], 0, 0, {t: [] for t in scales}
    flips_t = dict.fromkeys(scales, 0)
    lossless = True
    for seed in range(seeds):
        model = archs.build_model(name, seed=seed)
        want = _greedy(model, None)
        agree.append(sum(a == b for a, b in zip(_greedy(model, mlx_kvq.make_prompt_cache(
            model, kv_bits=8)), want, strict=True)))  # fmt: skip
        tokens = mx.concatenate([archs.prompt_tokens(), mx.array(want[:-1], dtype=mx.int32)])
        ref = np.array(forced_logits(model, model.make_cache(), tokens, archs.PREFILL_CHUNKS))
        top2 = np.sort(ref, -1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]
        got = np.array(forced_logits(
            model, mlx_kvq.make_prompt_cache(model, kv_bits=8), tokens, archs.PREFILL_CHUNKS))  # fmt: skip
        d = np.abs(got - ref).max(-1)
        flipped = got.argmax(-1) != ref.argmax(-1)
        flips += int(flipped.sum())
        ties += int((flipped & (margin < d)).sum())
        if name == "deepseek_v41":
            for t in scales:
                cache = [RoundTripLayerCache(c.window_size, {"window": Q8}, t)
                         for c in model.make_cache()]  # fmt: skip
                x = np.array(forced_logits(model, cache, tokens, archs.PREFILL_CHUNKS))
                deltas[t].append(np.abs(x - ref).max(-1))
                flips_t[t] += int((x.argmax(-1) != ref.argmax(-1)).sum())
            cache = model.make_cache()
            archs.run_forward(model, cache=cache)
            for c in cache:
                for f in FIELDS:
                    a = getattr(c, f)
                    if a is not None:
                        lossless &= mx.array_equal(a.astype(mx.bfloat16).astype(a.dtype), a).item()
        deltas.setdefault("q8", []).append(d)
    q8 = np.concatenate(deltas["q8"])
    print(
        f"{label:28s} greedy agree {agree} | teacher-forced flips {flips}/{q8.size} "
        f"(ties {ties}), |dlogit| median {np.median(q8):.4f} max {q8.max():.3f}"
    )
    for t in scales:
        dt = np.concatenate(deltas[t])
        print(
            f"    window error x{t:<5} flips {flips_t[t]:2d}, |dlogit| median {np.median(dt):.4f}"
        )
    if name == "deepseek_v41":
        print(f"    fields exact in bfloat16: {lossless}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=8)
    args = parser.parse_args()
    mlx_kvq.use_fast_blas()
    scales = (0.01, 0.03, 0.1, 1.0)
    _row("deepseek_v41", "deepseek_v41", args.seeds, scales)
    fp8, fp4 = deepseek_v41._fake_quant_fp8, deepseek_v41._fake_quant_fp4
    deepseek_v41._fake_quant_fp8 = lambda x, block_size=32: x
    deepseek_v41._fake_quant_fp4 = lambda x, **_: x
    try:
        _row("deepseek_v41 (rounding off)", "deepseek_v41", args.seeds, scales)
    finally:
        deepseek_v41._fake_quant_fp8, deepseek_v41._fake_quant_fp4 = fp8, fp4
    _row("llama", "llama", args.seeds, ())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

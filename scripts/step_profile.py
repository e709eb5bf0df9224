"""Where a decode step's time goes: mlx-kvq's engine against mlx-lm's batch loop.

In one process on one model (OpenBLAS bound, as every mlx-kvq command
does), N requests of P prompt tokens generate T tokens each:

- `mlx-lm`: mlx-lm's `BatchGenerator` with mlx-lm's own caches and the
  per-token work `mlx_lm.server` does in its loop (the detokenizer, the
  token's log-probability read with `.item()`);
- each mlx-kvq arm: `mlx_kvq.engine.Engine` (as `mlx-kvq serve` builds it:
  the plan, the layout, the KV budget of the machine) driven in-process, no HTTP.

Arms alternate round by round. For every arm the script prints the median
wall time of a decode step once every request decodes (the steps of the
last tokens, when rows leave, are not counted), and with `--profile` the
functions that take the engine thread's time (cProfile, cumulative).

  python scripts/step_profile.py --model /work/models/smollm2-135m-f32 \\
      --streams 16 --arms "mlx-lm;default;--kv-bits 0;--kv-block-size 0" --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shlex
import statistics
import threading
import time

import mlx.core as mx


def _prompts(tokenizer, n: int, length: int, round_: int) -> list[list[int]]:
    from mlx_kvq.demo import DEMO_HELDOUT, DEMO_MODERN

    tokens = tokenizer.encode(DEMO_MODERN.read_text() + DEMO_HELDOUT.read_text())
    start = round_ * n * length
    return [tokens[start + i * length : start + (i + 1) * length] for i in range(n)]


def run_mlx_lm(model, tokenizer, prompts, tokens: int, prof: cProfile.Profile | None):
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    gen = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=8)
    gen.insert(
        prompts,
        max_tokens=[tokens] * len(prompts),
        caches=[make_prompt_cache(model) for _ in prompts],
    )
    detok = {}
    steps: list[tuple[float, int]] = []
    finished = 0
    while finished < len(prompts):
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        _, responses = gen.next()
        for r in responses:
            d = detok.setdefault(r.uid, tokenizer.detokenizer)
            d.add_token(r.token)
            _ = d.last_segment
            r.logprobs[r.token].item()
            finished += r.finish_reason is not None
        if prof:
            prof.disable()
        steps.append((time.perf_counter() - t0, len(responses)))
    gen.close()
    return steps


class EngineArm:
    def __init__(self, model, tokenizer, flags: list[str]):
        from mlx_kvq.commands.flags import add_serve_flags
        from mlx_kvq.commands.serve import engine_options, kv_cache_memory
        from mlx_kvq.commands.startup import ModelSource, kv_setting
        from mlx_kvq.engine import Engine
        from mlx_kvq.generate import get_plan

        p = argparse.ArgumentParser()
        add_serve_flags(p)
        args = p.parse_args(flags)
        kv = kv_setting(args, ModelSource("", ""), model)
        plan = get_plan(model, kv, batch=True)
        budget = kv_cache_memory(args, model, plan)
        options = engine_options(args, plan.max_context, None, plan.max_batch,
                                 kv_cache_memory=budget)  # fmt: skip
        self.engine = Engine(model, tokenizer, plan, kv, options)
        self.steps: list[tuple[float, int]] = []
        self.prof: cProfile.Profile | None = None
        step = self.engine.step

        def timed_step():
            t0 = time.perf_counter()
            if self.prof:
                self.prof.enable()
            out = step()
            if self.prof:
                self.prof.disable()
            self.steps.append((time.perf_counter() - t0, self.engine._output.batch_size))
            return out

        self.engine.step = timed_step
        self.engine.start()
        self.engine.readiness.ready_event.wait()

    def run(self, prompts, tokens: int, prof):
        from mlx_kvq.engine import FinishEvent, GenerationRequest, SamplingParams

        done = threading.Event()
        left = [len(prompts)]
        lock = threading.Lock()

        def sink(event):
            if isinstance(event, FinishEvent) or getattr(event, "status", None):
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        self.prof = prof
        self.steps = []
        params = SamplingParams(max_tokens=tokens, temperature=0.0)
        for p in prompts:
            self.engine.submit(GenerationRequest(list(p), params), sink)
        done.wait()
        self.prof = None
        return self.steps


def steady(steps: list[tuple[float, int]], n: int) -> list[float]:
    """Step times while all `n` rows decode."""
    return [t for t, rows in steps if rows == n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=80)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", default="mlx-lm;default;--kv-bits 0")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=45)
    a = ap.parse_args()

    from mlx_lm import load

    import mlx_kvq
    from mlx_kvq.compute import prepare

    print(mlx_kvq.use_fast_blas().summary())
    model, tokenizer = load(a.model)
    prepare(model, "auto")
    arms = [x.strip() for x in a.arms.split(";")]
    engines = {x: EngineArm(model, tokenizer, shlex.split("" if x == "default" else x))
               for x in arms if x != "mlx-lm"}  # fmt: skip
    times: dict[str, list[float]] = {x: [] for x in arms}
    profs = {x: cProfile.Profile() if a.profile else None for x in arms}
    for r in range(a.rounds):
        prompts = _prompts(tokenizer, a.streams, a.prompt, r)
        for x in arms if r % 2 == 0 else arms[::-1]:
            prof = profs[x] if r == a.rounds - 1 else None
            if x == "mlx-lm":
                steps = run_mlx_lm(model, tokenizer, prompts, a.tokens, prof)
            else:
                steps = engines[x].run(prompts, a.tokens, prof)
            s = steady(steps, a.streams)
            times[x].append(statistics.median(s) if s else float("nan"))
            print(f"round {r + 1} {x}: decode step {times[x][-1] * 1e3:.1f} ms ({len(s)} steps)")
    base = statistics.median(times[arms[0]])
    for x in arms:
        m = statistics.median(times[x])
        print(f"{x}: {m * 1e3:.1f} ms per step, {a.streams / m:.1f} tokens/s, "
              f"{base / m:.2f}x {arms[0]}")  # fmt: skip
    for x in arms:
        if profs[x] is not None:
            out = io.StringIO()
            pstats.Stats(profs[x], stream=out).sort_stats("cumulative").print_stats(a.top)
            print(f"\n==== profile {x} (last round)\n{out.getvalue()}")
    for e in engines.values():
        e.engine.stop()
    mx.synchronize()


if __name__ == "__main__":
    main()

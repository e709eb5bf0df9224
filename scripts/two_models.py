"""Two models from one `mlx-kvq serve`: answered together as alone, and a
budget that holds only one of them.

1. Alone: each model served by its own server; its greedy text for every
   prompt, and the server's time to ready.
2. Together: both from one server (`--model A --model B`); `--clients`
   openai-SDK requests at once, alternating between the models, streamed
   and not: every answer must come from its own model with its text alone.
   The second model loads on its first request (`load_seconds`).
3. One at a time: `--models-memory` that fits one model (its weights and
   `--kv-cache-memory`) and not both: requests alternate A, B, A, B, ...;
   each switch evicts the idle model and loads the other. The time of each
   switched request (its model's load and its answer), the loads, the
   evictions and the most bytes held against the budget.
4. With `--versus-mlx-lm`: the second model's time to a first answer from a
   fresh `mlx_lm.server` and a fresh `mlx-kvq serve` (started, then its first
   completion), one after the other, default BLAS threads.

Completions (`/v1/completions`), so that base models without a chat template
take part. Timings on a shared CPU are noisy: one run, compare ratios.

    python scripts/two_models.py --model A --model B [--clients 16] [--switches 4]
        [--max-tokens 16] [--kv-cache-memory 256MiB] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvq_testing.server import MlxLmServerProcess, ServerProcess  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The sea is"]


def complete(server: ServerProcess, model: str, prompt: str, max_tokens: int) -> str:
    r = httpx.post(server.url + "/v1/completions", timeout=600, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})  # fmt: skip
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def started(server: ServerProcess) -> float:
    """Start `server`; the seconds until its /health says ready."""
    t0 = time.monotonic()
    server.start()
    server.wait_ready(600)
    return time.monotonic() - t0


def alone(models: list[str], args) -> tuple[dict, dict]:
    texts, times = {}, {}
    for model in models:
        s = ServerProcess(model, "--kv-cache-memory", args.kv_cache_memory)
        try:
            times[model] = started(s)
            texts[model] = [complete(s, "default_model", p, args.max_tokens) for p in PROMPTS]
        finally:
            s.stop()
    return texts, times


def together(models: list[str], texts: dict, args) -> dict:
    extra = ["--model", models[1], "--kv-cache-memory", args.kv_cache_memory]
    s = ServerProcess(models[0], *extra)
    try:
        to_ready = started(s)
        client = s.client(timeout=600)
        results, errors = {}, []
        start = threading.Barrier(args.clients)

        def run(i: int) -> None:
            model, prompt, stream = models[i % 2], i // 2 % len(PROMPTS), i // 4 % 2 == 1
            kw = dict(model=model, prompt=PROMPTS[prompt], max_tokens=args.max_tokens,
                      temperature=0, stream=stream)  # fmt: skip
            try:
                start.wait(600)
                t0 = time.monotonic()
                if stream:
                    chunks = list(client.completions.create(**kw))
                    served = {c.model for c in chunks}
                    text = "".join(c.choices[0].text for c in chunks if c.choices)
                else:
                    r = client.completions.create(**kw)
                    served, text = {r.model}, r.choices[0].text
                results[i] = {
                    "model": model, "stream": stream, "seconds": time.monotonic() - t0,
                    "own_model": served == {model}, "same_text": text == texts[model][prompt],
                }  # fmt: skip
            except Exception as e:  # noqa: BLE001 - counted and shown
                errors.append(f"{i}: {e!r}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(args.clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        status = httpx.get(s.url + "/status", timeout=30).json()
    finally:
        s.stop()
    return {
        "seconds_to_ready": round(to_ready, 2),
        "clients": args.clients,
        "answered": len(results),
        "errors": errors,
        "all_own_model": all(r["own_model"] for r in results.values()),
        "all_same_text": all(r["same_text"] for r in results.values()),
        "wall_seconds": round(wall, 2),
        "models": {
            m["name"]: {
                k: m[k]
                for k in ("status", "loads", "load_seconds", "weights_bytes", "kv_budget_bytes")
            }
            for m in status["models"]
        },  # fmt: skip
        "models_memory": status["models_memory"],
    }


def one_at_a_time(models: list[str], texts: dict, args) -> dict:
    from mlx_kvq.commands.flags import parse_size
    from mlx_kvq.commands.startup import ModelSource, load_weights
    from mlx_kvq.engine.budget import weights_bytes

    kv = parse_size(args.kv_cache_memory)
    sizes = [weights_bytes(load_weights(ModelSource(m, m), argparse.Namespace(), lazy=True))
             for m in models]  # fmt: skip
    budget = max(sizes) + kv + (min(sizes) + kv) // 2  # one fits, never both
    extra = ["--model", models[1], "--kv-cache-memory", args.kv_cache_memory,
             "--models-memory", str(budget)]  # fmt: skip
    switches = []
    s = ServerProcess(models[0], *extra)
    try:
        started(s)
        for i in range(args.switches):
            model = models[(i + 1) % 2]
            t0 = time.monotonic()
            text = complete(s, model, PROMPTS[0], args.max_tokens)
            seconds = time.monotonic() - t0
            status = httpx.get(s.url + "/status", timeout=30).json()
            switches.append({
                "to": Path(model).name, "seconds": round(seconds, 2),
                "same_text": text == texts[model][0],
                "load_seconds": next(m["load_seconds"] for m in status["models"]
                                     if m["name"] == model),
                "mlx_active_bytes": status["memory"]["active"],
            })  # fmt: skip
        metrics = s.metrics()
    finally:
        s.stop()
    overruns = sum(v for k, v in metrics.items() if k.startswith("mlx_kvq_kv_budget_overruns"))
    return {
        "weights_bytes": dict(zip(models, sizes, strict=True)),
        "budget": budget,
        "switches": switches,
        "models": {
            m["name"]: {k: m[k] for k in ("status", "loads", "evictions", "load_seconds")}
            for m in status["models"]
        },  # fmt: skip
        "held_max": status["models_memory"]["held_max"],
        "held_max_within_budget": status["models_memory"]["held_max"] <= budget,
        "kv_budget_overruns": overruns,
    }


def first_answer(server: ServerProcess, args) -> dict:
    """Seconds from starting `server` to its /health 200 and to its first completion."""
    t0 = time.monotonic()
    server.start()
    try:
        server.wait_for("/health", 200, 600)
        ready = time.monotonic() - t0
        complete(server, "default_model", PROMPTS[0], args.max_tokens)
        return {"ready": round(ready, 2), "first_answer": round(time.monotonic() - t0, 2)}
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", required=True, help="two model directories")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--switches", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--json", default=None)
    p.add_argument("--versus-mlx-lm", action="store_true", help="section 4")
    args = p.parse_args()
    if len(args.model) != 2:
        p.error("give two --model")
    texts, times = alone(args.model, args)
    out = {"alone_seconds_to_ready": {Path(m).name: round(t, 2) for m, t in times.items()},
           "together": together(args.model, texts, args),
           "one_at_a_time": one_at_a_time(args.model, texts, args)}  # fmt: skip
    if args.versus_mlx_lm:
        second = args.model[1]
        out["versus_mlx_lm"] = {
            "model": Path(second).name,
            "mlx_lm.server": first_answer(MlxLmServerProcess(second), args),
            "mlx-kvq serve": first_answer(ServerProcess(second), args),
        }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

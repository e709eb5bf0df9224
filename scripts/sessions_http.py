"""Chat sessions sharing a system prompt, sent at once through the HTTP server
under a tight KV budget (tests/kvq_testing/sessions.py).

A scripted hybrid model (sliding windows of `--window` tokens and full
attention alternating over `--layers` layers, `--kv-heads` KV heads of 64
dimensions, float32) says a known answer of `--answer` tokens to any
prompt. `--sessions` streaming `/v1/chat/completions` requests with
`max_tokens` 32000 share a system message of `--system` tokens and add
`--own-words` words each; `--kv-cache-memory` is 1.5x what one whole
session holds plus what the others hold of their own: from the plan's
bytes per token (`--budget plan`, as the quantized rows alone count), or as
the KV budget prices a session (`--budget priced`: exact tails and
windows' blocks included). Prints the server's counters after them as JSON: served
with the whole answer, overruns, the most bytes held against the budget,
the most decoding at once, and the prompt tokens computed against one
prefix plus every session's own tokens. Run niced:

    nice -n 10 python scripts/sessions_http.py            # the full size (16 x 7,700)
    nice -n 10 python scripts/sessions_http.py --budget priced
    nice -n 10 python scripts/sessions_http.py --model GEMMA_DIR --system 3000 --answer 100

With `--model` the sessions are plain prompts sharing a text (a model
without a chat template), served when they end with "length" or "stop".
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # kvq_testing

from kvq_testing.server import ServerProcess  # noqa: E402
from kvq_testing.sessions import (  # noqa: E402
    Sessions,
    chat_bodies,
    send,
    shared_prefix,
    text_bodies,
)


def main() -> None:
    d = Sessions()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=d.sessions)
    ap.add_argument("--system", type=int, default=d.system_tokens, help="system message tokens")
    ap.add_argument("--own-words", type=int, default=d.own_words)
    ap.add_argument("--answer", type=int, default=d.answer, help="tokens of the answer")
    ap.add_argument("--window", type=int, default=d.window)
    ap.add_argument("--kv-heads", type=int, default=d.kv_heads)
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument(
        "--budget", choices=["plan", "priced"], default="plan",
        help="plan: from the plan's bytes per token (1.5x one whole session plus the others' "
        "own tokens); priced: the same as the KV budget prices sessions",
    )  # fmt: skip
    ap.add_argument(
        "--model", help="a real model instead (no chat template: `/v1/completions` with a "
        "shared text of --system tokens; each answers --answer tokens, greedy)",
    )  # fmt: skip
    ap.add_argument("--log", help="copy the server's log to this file")
    ap.add_argument("flags", nargs="*", help="more `mlx-kvq serve` flags (after --)")
    args = ap.parse_args()
    scenario = Sessions(
        args.sessions, args.system, args.own_words, args.answer, args.window, args.kv_heads,
        args.layers,
    )  # fmt: skip

    from mlx_lm import load

    import mlx_kvq
    from mlx_kvq.defaults import DEFAULT_KV_CONFIG
    from mlx_kvq.engine import EngineOptions
    from mlx_kvq.engine.budget import share_for
    from mlx_kvq.engine.runner import choose_layout
    from mlx_kvq.plan import plan_kv

    mlx_kvq.use_fast_blas()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server on `timeout`
    with tempfile.TemporaryDirectory(prefix="sessions-http-") as tmp:
        path = args.model or scenario.save_model(Path(tmp) / "model")
        model, tokenizer = load(str(path))
        plan = plan_kv(model, DEFAULT_KV_CONFIG, batch=True)
        if args.model:  # no chat template: plain prompts sharing a text
            texts = scenario.texts(tokenizer)
            prompts = [tokenizer.encode(t) for t in texts]
            bodies, answer = text_bodies(scenario, texts), None
        else:
            conversations = scenario.conversations()
            prompts = scenario.prompts(tokenizer, conversations)
            bodies, answer = chat_bodies(scenario, conversations), scenario.answer_text
        if args.budget == "plan":
            budget = scenario.plan_budget(plan, prompts)
        else:
            layout = choose_layout(plan, EngineOptions().block_size)  # as the server lays it out
            cost = share_for(
                plan, 1, prefill_step=EngineOptions().prefill_step_size,
                prompt_rows=EngineOptions().prompt_concurrency, paged=layout.paged,
                block_size=layout.block_size or 0,
            ).cost  # fmt: skip
            budget = scenario.priced_budget(cost, prompts)
        shared = shared_prefix(prompts)
        own = sum(len(p) - shared for p in prompts)
        server = ServerProcess(path, "--kv-cache-memory", str(budget), *args.flags).start()
        try:  # the counters are reported, overruns too (stop() would raise on them)
            server.wait_ready()
            t0 = time.monotonic()
            outcome = send(server, bodies, answer)
            seconds = time.monotonic() - t0
        finally:
            if args.log:
                Path(args.log).write_text(server.log())
            server.terminate()
        report = {
            "model": str(args.model or "scripted"), "scenario": scenario.__dict__, "flags": args.flags, "budget_from": args.budget,
            "prompt_tokens": len(prompts[0]),
            "shared_prefix": shared, "own_tokens": own, **outcome.to_dict(),
            "computed_vs_prefix_and_own": round(outcome.prompt_tokens / (shared + own), 3),
            "held_max_vs_budget": round(outcome.held_max / budget, 3), "seconds": round(seconds),
        }  # fmt: skip
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""Sixteen chats with max_tokens 32000 that stop after about 300 tokens, under a KV budget.

Builds a scripted hybrid model (tests/kvq_testing/scripted.py: gemma3_text,
sliding windows of 16 tokens in layers 0 and 2, full attention in layer 1,
a context of 32,768 tokens) whose answer to every chat is a fixed
300-token text and then EOS. Each chat is a distinct prompt of about 1,000
tokens sent with `max_tokens` 32000, all submitted at once to mlx-kvq's
engine in-process (no HTTP) with the default KV setting. Three runs:

1. a budget far above need: what the sixteen really hold (the most live KV
   bytes measured after any step, no prompt cache);
2. a budget of 1.25x what the sixteen hold: how many decode at once;
3. a budget of five sessions' share of that (5/16 of it): every chat served
   with its text, and the preemptions and resumptions it took.

For each budget it also says how many chats the worst-case rule (prompt +
max_tokens reserved at admission, the rule before the scheduler) would have
admitted at once.

    nice python scripts/scheduler_bench.py [--sessions 16] [--prompt-tokens 1000]
        [--answer-tokens 300] [--max-tokens 32000] [--json out.json]

Needs nothing but this checkout (the model is written to a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvq_testing.scripted import save_scripted_model  # noqa: E402
from mlx_lm import load  # noqa: E402

from mlx_kvq.defaults import DEFAULT_KV_CONFIG  # noqa: E402
from mlx_kvq.engine import (  # noqa: E402
    Engine,
    EngineOptions,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    Shape,
    TokenEvent,
)
from mlx_kvq.engine.budget import format_bytes  # noqa: E402
from mlx_kvq.engine.prompts import chat_tokens  # noqa: E402
from mlx_kvq.plan import plan_kv  # noqa: E402

WORDS = (
    "river mountain bridge window garden harbor lantern meadow orchard pebble "
    "candle feather compass ladder blanket kettle marble saddle thimble walnut "
).split()
TRIGGER = "Tell me the whole story."
WAIT_S = 3600


class Chat:
    """One chat's events: its text and how it ended."""

    def __init__(self):
        self.text = []
        self.end = None
        self.done = threading.Event()

    def __call__(self, event):
        if isinstance(event, TokenEvent):
            self.text.append(event.text)
        else:
            self.end = event
            self.done.set()


def prompts(tokenizer, n: int, tokens: int) -> list[list[int]]:
    out = []
    for i in range(n):
        words, k = [], i
        while len(" ".join(words)) < tokens - 40:  # one token per byte of plain text
            words.append(WORDS[k % len(WORDS)])
            k = k * 7 + 3
        content = f"Session {i}. " + " ".join(words) + ". " + TRIGGER
        out.append(chat_tokens(tokenizer, [{"role": "user", "content": content}]))
    return out


def serve(model, tokenizer, plan, chats, budget: int, max_tokens: int, cache_entries: int):
    engine = Engine(model, tokenizer, plan, DEFAULT_KV_CONFIG, EngineOptions(
        kv_cache_memory=budget, max_context=plan.max_context,
        prompt_cache_size=cache_entries))  # fmt: skip
    engine.start()
    assert engine.readiness.ready_event.wait(WAIT_S) and engine.readiness.ready
    sinks = [Chat() for _ in chats]
    t0 = time.perf_counter()
    try:
        for prompt, sink in zip(chats, sinks, strict=True):
            engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens)), sink)
        for sink in sinks:
            assert sink.done.wait(WAIT_S), "a chat was never answered"
    finally:
        engine.stop()
    wall = time.perf_counter() - t0
    m = engine.metrics.snapshot()
    ledger = engine.budget
    return {
        "budget": budget,
        "wall_s": round(wall, 1),
        "served": sum(isinstance(s.end, FinishEvent) for s in sinks),
        "texts": ["".join(s.text) for s in sinks],
        "reasons": [getattr(s.end, "reason", None) for s in sinks],
        "at_once": m.max_batch_size,
        "preemptions": m.preemptions,
        "resumptions": m.resumptions,
        "peak_held": ledger.peak_held,
        "overruns": ledger.overruns,
        "bound_misses": ledger.bound_misses,
        "generated": m.generation_tokens,
        "cost": ledger.share.cost,
    }


def worst_case_at_once(cost, budget: int, prompt: int, max_tokens: int, context: int) -> int:
    """Chats admitted at once when each reserves prompt + max_tokens (clamped
    to the context), the rule before the scheduler."""
    total = min(prompt + max_tokens, context)
    return cost.sequences(budget, Shape(prompt, total))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--answer-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=32000)
    ap.add_argument("--few", type=int, default=5, help="the small budget: this many chats' share")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    pieces = [f"p{i:03d} " for i in range(args.answer_tokens - 1)]  # and EOS
    answer = "".join(pieces)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_scripted_model(Path(tmp) / "m", {TRIGGER: pieces}, template="plain",
                                   arch="hybrid")  # fmt: skip
        model, tokenizer = load(str(path))
    plan = plan_kv(model, DEFAULT_KV_CONFIG, batch=True)
    chats = prompts(tokenizer, args.sessions, args.prompt_tokens)
    p = max(len(c) for c in chats)
    big = 1 << 40
    print(f"model: scripted gemma3_text hybrid, context {plan.max_context}, {len(chats)} chats of "
          f"{min(len(c) for c in chats)}-{p} prompt tokens, answers of {args.answer_tokens} "
          f"tokens (EOS included), max_tokens {args.max_tokens}", flush=True)  # fmt: skip

    runs = {}
    runs["no budget"] = serve(model, tokenizer, plan, chats, big, args.max_tokens, 0)
    hold = runs["no budget"]["peak_held"]  # what the sixteen really hold
    runs["1.25x what they hold"] = serve(
        model, tokenizer, plan, chats, int(1.25 * hold), args.max_tokens, 10
    )
    few = hold * args.few // len(chats)  # five sessions' share of what the sixteen hold
    runs[f"{args.few} sessions' share"] = serve(
        model, tokenizer, plan, chats, few, args.max_tokens, 10
    )

    rows = []
    for name, r in runs.items():
        ok = sum(t == answer for t in r["texts"])
        worst = worst_case_at_once(r["cost"], r["budget"], p, args.max_tokens, plan.max_context)
        worst = "-" if r["budget"] == big else worst
        rows.append({
            "run": name, "budget": r["budget"], "chats": len(r["texts"]), "served": r["served"],
            "answers_unchanged": ok, "at_once": r["at_once"], "worst_case_at_once": worst,
            "preemptions": r["preemptions"], "resumptions": r["resumptions"],
            "peak_held": r["peak_held"], "overruns": r["overruns"],
            "bound_misses": r["bound_misses"], "wall_s": r["wall_s"],
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)

    print()
    print(
        "| run | budget | chats served | answers unchanged | decoded at once | worst-case rule "
        "at once | preemptions | resumptions | most KV held | overruns | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        budget = "none (1 TiB)" if r["budget"] == big else format_bytes(r["budget"])
        print(f"| {r['run']} | {budget} | {r['served']}/{r['chats']} | {r['answers_unchanged']} | "
              f"{r['at_once']} | {r['worst_case_at_once']} | {r['preemptions']} | "
              f"{r['resumptions']} | {format_bytes(r['peak_held'])} | {r['overruns']} | "
              f"{r['wall_s']} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

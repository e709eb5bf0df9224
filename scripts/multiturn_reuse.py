"""Multi-turn prompt reuse: prefilled tokens per turn, mlx-kvq serve next to mlx_lm.server.

Builds a scripted hybrid model (tests/kvq_testing/scripted.py: gemma3_text,
sliding windows of 16 tokens in layers 0 and 2, full attention in layer 1)
once per chat template, runs a 5-turn chat with a system prompt and user
turns of at least 500 tokens against `mlx-kvq serve` and `python -m
mlx_lm.server` on the same model directory, sends each answer back as the
server returned it, and prints per turn the prompt tokens, the tokens reused
from the prompt cache (`usage.prompt_tokens_details.cached_tokens`) and the
tokens prefilled (the difference). A second chat then opens with the same
system prompt. Every answer has a reasoning block, so a template that drops
earlier reasoning re-renders history; the windows wrap on every turn.

    python scripts/multiturn_reuse.py [--templates qwen3 qwen3_keep_reasoning qwen3_open_think]
        [--turns 5] [--turn-tokens 520] [--json out.json] [-- extra mlx-kvq serve flags]

Needs nothing but this checkout (the model is written to a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvq_testing.scripted import save_scripted_model  # noqa: E402
from kvq_testing.server import MlxLmServerProcess, ServerProcess  # noqa: E402

SYSTEM = (
    "You are a careful assistant for a small library. Answer in one short sentence, "
    "cite the shelf when you know it, and say so when you do not know. "
)
WORDS = (
    "river mountain bridge window garden harbor lantern meadow orchard pebble "
    "candle feather compass ladder blanket kettle marble saddle thimble walnut "
).split()
MAX_TOKENS = 32


def script(turns: int) -> dict[str, list[str]]:
    """One trigger per turn (listed in turn order: the latest present wins),
    each answer with a reasoning block as Qwen3 writes it."""
    return {
        f"QQ{k}": ["<think>", f"\nShelf lookup {k}.\n", "</think>", f"\n\nShelf {k} has it."]
        for k in range(1, turns + 1)
    }


def user_turn(k: int, tokens: int, variant: int = 0) -> str:
    """About `tokens` byte-level tokens of filler that names turn `k`'s trigger
    (another `variant`, other words)."""
    words, n = [], 0
    i = k * 7 + variant
    while n < tokens:
        w = WORDS[i % len(WORDS)]
        words.append(w)
        n += len(w) + 1
        i += 3
    return f"Question QQ{k}: " + " ".join(words) + "?"


def chat(server: ServerProcess, turns: int, turn_tokens: int, variant: int = 0) -> list:
    """Run one chat, sending every answer back as the server returned it
    (with `reasoning` when the server separated it); per turn (prompt
    tokens, cached tokens)."""
    import httpx

    messages = [{"role": "system", "content": SYSTEM}]
    rows = []
    for k in range(1, turns + 1):
        messages.append({"role": "user", "content": user_turn(k, turn_tokens, variant)})
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"model": "default_model", "messages": messages, "max_tokens": MAX_TOKENS},
            timeout=600,
        )
        r.raise_for_status()
        body = r.json()
        usage = body["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        rows.append((usage["prompt_tokens"], cached))
        message = body["choices"][0]["message"]
        reply = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("reasoning"):
            reply["reasoning"] = message["reasoning"]
        messages.append(reply)
    return rows


SERVERS = ("mlx-kvq", "mlx_lm.server")


def run(template: str, args: argparse.Namespace, root: Path) -> dict:
    turns, turn_tokens = args.turns, args.turn_tokens
    model = save_scripted_model(root / template, script(turns), template=template, arch="hybrid")
    servers = {
        "mlx-kvq": lambda: ServerProcess(model, *args.serve_flags),
        "mlx_lm.server": lambda: MlxLmServerProcess(model),
    }
    out = {}
    for name in args.servers:
        server = servers[name]()
        with server:
            server.wait_ready()
            first = chat(server, turns, turn_tokens)
            second = chat(server, 1, turn_tokens, variant=1)
        out[name] = {"chat": first, "new_chat_same_system": second}
    return out


def table(template: str, result: dict) -> str:
    names = list(result)
    lines = [
        f"template `{template}`",
        "",
        "| turn | prompt tokens | " + " | ".join(f"{n} cached / prefilled" for n in names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    rows = list(zip(*(result[n]["chat"] for n in names), strict=True))
    rows.append(tuple(result[n]["new_chat_same_system"][0] for n in names))
    for i, row in enumerate(rows):
        label = str(i + 1) if i < len(rows) - 1 else "new chat, turn 1"
        cells = [f"{cached} / {prompt - cached}" for prompt, cached in row]
        lines.append(f"| {label} | {row[0][0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--templates", nargs="+", default=["qwen3", "qwen3_keep_reasoning", "qwen3_open_think"]
    )
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--turn-tokens", type=int, default=520)
    parser.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    parser.add_argument("--json", default=None, help="also write the numbers here")
    parser.add_argument("serve_flags", nargs="*", help="after --: extra mlx-kvq serve flags")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for template in args.templates:
            results[template] = run(template, args, Path(tmp))
            print(table(template, results[template]), flush=True)
            print(flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`mlx-kvq eval`: perplexity, KL and top-1 agreement of one KV setting against
unquantized caches on a held-out text (see `mlx_kvq/evaluate.py`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .flags import add_kv_flags, add_model_flag, kv_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..evaluate import DEFAULT_CHUNK, DEFAULT_CONTEXT, DEFAULT_WINDOWS

    p = sub.add_parser("eval", help="perplexity/KL/top-1 against unquantized caches")
    add_model_flag(p)
    p.add_argument(
        "--text",
        type=Path,
        default=None,
        help="held-out text file (default: the demo model's held-out text)",
    )
    add_kv_flags(p)
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens per window")
    p.add_argument(
        "--chunk",
        type=int,
        default=DEFAULT_CHUNK,
        help="tokens fed per forward pass (prefill chunk)",
    )
    p.add_argument(
        "--windows",
        type=int,
        default=DEFAULT_WINDOWS,
        help="windows of --context tokens spread over the text",
    )
    p.add_argument(
        "--decode",
        type=int,
        default=0,
        help="feed the last N positions of each window one token at a time",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Print a table (or JSON) for the KV setting the flags ask for.

    With no bits flag that is the default setting (as `serve` and `generate`
    use); `--kv-bits 0` evaluates unquantized caches (a null check: KL 0).
    """
    from ..evaluate import evaluate, format_table, load_eval_inputs

    cfg = kv_config(args)
    model, _, ids, bos = load_eval_inputs(args.model, args.text)
    result = evaluate(
        model, ids, cfg, context=args.context, chunk=args.chunk, windows=args.windows,
        bos=bos, progress=False if args.no_progress else None, decode=args.decode,
    )  # fmt: skip
    result["model"] = args.model or "demo"
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"model {result['model']}: {result['windows']} windows x {result['context']} tokens, "
        f"chunks of {result['chunk']}"
        + (f" then {result['decode']} one-token steps" if result["decode"] else "")
        + f", {result['tokens_scored']} tokens scored"
    )
    print(format_table([result]))
    return 0

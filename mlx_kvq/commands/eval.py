"""`mlx-kvq eval`: perplexity, KL and top-1 agreement of one KV setting against
unquantized caches on a held-out text (see `mlx_kvq/evaluate.py`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .flags import add_dtype_flag, add_kv_flags, add_model_flag, kv_config
from .startup import kv_setting, model_source


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..evaluate import DEFAULT_CHUNK, DEFAULT_CONTEXT, DEFAULT_WINDOWS, HELD_CONTEXT

    p = sub.add_parser("eval", help="perplexity/KL/top-1 against unquantized caches")
    add_model_flag(p)
    add_dtype_flag(p)
    p.add_argument(
        "--text",
        type=Path,
        action="append",
        default=None,
        help="text file to evaluate on; repeat for several (default with a demo model: "
        "its in-domain text, then its out-of-domain one: the held-out KJV and modern English)",
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
        help="windows of --context tokens spread over each text",
    )
    p.add_argument(
        "--decode",
        type=int,
        default=0,
        help="feed the last N positions of each window one token at a time",
    )
    p.add_argument(
        "--held-context",
        type=int,
        default=HELD_CONTEXT,
        help="context at which bits per element are measured from the bytes held "
        f"(default {HELD_CONTEXT})",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Print a table (or JSON) for the KV setting the flags ask for, one row per text.

    With no bits flag that is the default setting of the model's layout (as
    `serve` and `generate` use); `--kv-bits 0` evaluates unquantized caches (a null check: KL 0).
    """
    from ..evaluate import evaluate, format_text_table, load_eval_inputs

    kv_config(args)
    model, _, texts = load_eval_inputs(args.model, args.text, args.dtype)
    cfg = kv_setting(args, model_source(args), model)
    results = []
    for name, (ids, bos) in texts.items():
        r = evaluate(
            model, ids, cfg, context=args.context, chunk=args.chunk, windows=args.windows,
            bos=bos, progress=False if args.no_progress else None, decode=args.decode,
            held_context=args.held_context,
        )  # fmt: skip
        results.append({"text": name, **r})
    r0 = results[0]
    shared = ("setting", "kv_config", "bits_per_element", "held_context", "kv_bytes")
    report = {
        "model": args.model or "demo",
        **{k: r0[k] for k in shared if k in r0},
        "texts": [{k: v for k, v in r.items() if k not in shared} for r in results],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    held = r0.get("held_context", r0["context"])
    print(
        f"model {report['model']}, KV {r0['setting']}: {r0['bits_per_element']:.2f} bits per "
        f"element held at {held} tokens"
    )
    print(
        f"{r0['windows']} windows x {r0['context']} tokens per text, chunks of {r0['chunk']}"
        + (f" then {r0['decode']} one-token steps" if r0["decode"] else "")
        + "; ± is the standard error across windows"
    )
    print(format_text_table(results))
    return 0

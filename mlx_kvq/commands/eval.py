"""`mlx-kvq eval`: perplexity, KL and top-1 agreement of one KV setting against
unquantized caches on a held-out text (see `mlx_kvq/evaluate.py`)."""

from __future__ import annotations

import argparse
import json

from .flags import add_eval_flags, kv_config
from .startup import kv_setting, model_source


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="perplexity/KL/top-1 against unquantized caches")
    add_eval_flags(p)
    p.set_defaults(run=run)


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

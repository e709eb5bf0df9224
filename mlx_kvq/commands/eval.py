"""`mlx-kvq eval`: perplexity, KL and top-1 agreement of KV settings against
unquantized caches on held-out texts (see `mlx_kvq/evaluate.py`).

Several settings (`--setting`, repeated) are scored in one run against one
unquantized reference per window, computed once: each setting costs its own
forward passes, and the time of each is printed."""

from __future__ import annotations

import argparse
import json
import time

from ..config import AUTO_BLOCK_SIZE
from .flags import add_eval_flags, setting_namespaces
from .startup import kv_setting, model_source


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="perplexity/KL/top-1 against unquantized caches")
    add_eval_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Print a table (or JSON) per KV setting, one row per text, and the time each took.

    With no bits flag a setting is the default of the model's layout (as
    `serve` and `generate` use); `--kv-bits 0` evaluates unquantized caches
    (a null check: KL 0).
    """
    from ..evaluate import evaluate_many, format_text_table, load_eval_inputs

    started = time.perf_counter()
    spaces = setting_namespaces(args.setting, args)
    if args.kv_block_size is not None and args.kv_block_size < 0:
        raise ValueError("--kv-block-size must be >= 0 (0: each cache's own layout)")
    block_size = AUTO_BLOCK_SIZE if args.kv_block_size is None else args.kv_block_size or None
    model, _, texts = load_eval_inputs(args.model, args.text, args.dtype)
    source = model_source(args)
    cfgs = [kv_setting(ns, source, model) for ns in spaces]
    per_text = []
    for name, (ids, bos) in texts.items():
        rs = evaluate_many(
            model, ids, cfgs, context=args.context, chunk=args.chunk, windows=args.windows,
            bos=bos, progress=False if args.no_progress else None, decode=args.decode,
            held_context=args.held_context, block_size=block_size,
        )  # fmt: skip
        per_text.append([{"text": name, **r} for r in rs])
    shared = (
        "setting", "kv_config", "bits_per_element", "held_context", "kv_bytes", "paged_layers",
    )  # fmt: skip
    settings = []
    for i in range(len(cfgs)):
        results = [rs[i] for rs in per_text]
        r0 = results[0]
        settings.append({
            **{k: r0[k] for k in shared if k in r0},
            "seconds": sum(r["seconds"] for r in results),
            "texts": [
                {k: v for k, v in r.items() if k not in (*shared, "reference_seconds")}
                for r in results
            ],
        })  # fmt: skip
    report = {
        "model": args.model or "demo",
        "reference_seconds": sum(rs[0]["reference_seconds"] for rs in per_text),
        "seconds": time.perf_counter() - started,
        "settings": settings,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    r0 = per_text[0][0]
    print(
        f"model {report['model']}: {r0['windows']} windows x {r0['context']} tokens per text, "
        f"chunks of {r0['chunk']}"
        + (f" then {r0['decode']} one-token steps" if r0["decode"] else "")
        + "; ± is the standard error across windows"
    )
    print(
        f"unquantized reference: {report['reference_seconds']:.1f} s "
        "(computed once, shared by every setting)"
    )
    for s, rows in zip(settings, zip(*per_text, strict=True), strict=True):
        held = s.get("held_context", r0["context"])
        paged = f"; {s['paged_layers']} KV layers paged" if s.get("paged_layers") else ""
        print(
            f"\nKV {s['setting']}: {s['bits_per_element']:.2f} bits per element held at "
            f"{held} tokens{paged}; {s['seconds']:.1f} s"
        )
        print(format_text_table(rows))
    print(f"\n{report['seconds']:.1f} s in all")
    return 0

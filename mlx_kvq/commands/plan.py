"""`mlx-kvq plan`: the per-layer KV plan and a memory estimate, from config.json alone."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .flags import add_plan_flags, kv_config
from .startup import ModelSource, kv_setting, model_source, setting_origin


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="per-layer KV plan and memory estimate from config.json")
    add_plan_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..from_gguf import is_gguf
    from ..plan import plan_kv

    kv_config(args)
    if is_gguf(args.model):  # planned from the file's metadata: no weights converted
        given = gguf_config(args.model)
        source = ModelSource(str(given.parent), args.model)
    else:
        source = model_source(args)
        given = Path(source.location)
    if source.local_config is None and not given.is_file():
        raise FileNotFoundError(f"no config.json at {source.location}")
    cfg = kv_setting(args, source, given)
    origin = setting_origin(args, source, given)
    plan = plan_kv(given, cfg)
    estimate = plan.estimate(args.context, args.batch)
    if args.json:
        report = {**plan.to_dict(), "setting_origin": origin, "estimate": estimate}
        print(json.dumps(report, indent=2, default=str))
        return 0
    print(plan.table())
    print(f"\nKV setting: {cfg.describe()}, {origin}")
    print()
    print(f"estimate at {args.context} tokens x batch {args.batch}:")
    for kind, e in estimate["by_kind"].items():
        print(
            f"  {kind:<8} {e['layers']:>3} slots  {mib(e['bytes']):>10}  (fp16 {mib(e['fp16_bytes'])})"
        )
    print(
        f"  total          {mib(estimate['bytes']):>10}  (fp16 {mib(estimate['fp16_bytes'])}, "
        f"ratio {estimate['ratio']:.3f})"
    )
    return 0


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def gguf_config(path: str) -> Path:
    """A GGUF file's mlx-lm config.json, from its metadata alone (no weights
    converted), in a temporary directory."""
    import tempfile

    from ..from_gguf import check

    directory = Path(tempfile.mkdtemp(prefix="mlx-kvq-plan-"))
    (directory / "config.json").write_text(json.dumps(check(path)))
    return directory / "config.json"

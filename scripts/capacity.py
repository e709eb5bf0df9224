"""Sequences a KV budget holds at several lengths, as the engine prices them.

    python scripts/capacity.py --model /work/models/smollm2-135m-f32 --budget 256 \
      --context 60 --context 200 --context 600 --context 1000 --context 4000 \
      --setting '' --setting '--kv-bits 0'

Each setting is planned as `mlx-kvq serve` plans it (`--setting ''`: the
default of the model's layout; `--kv-bits 0`: unquantized), laid out as the
engine lays it out by default (the paged layout where the plan pages), and
priced by the engine's budget (`CostModel.sequences`) for sequences of
`--context` tokens, the last `--generated` of them generated. Nothing is run
through the model: the weights only give the shapes and the dtype.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_kvq.commands.flags import add_kv_flags, setting_namespaces  # noqa: E402
from mlx_kvq.commands.startup import kv_setting, load_weights, model_source  # noqa: E402
from mlx_kvq.config import KVConfig  # noqa: E402
from mlx_kvq.engine import EngineOptions, Shape  # noqa: E402
from mlx_kvq.engine.budget import share_for  # noqa: E402
from mlx_kvq.engine.runner import choose_layout  # noqa: E402
from mlx_kvq.plan import plan_kv  # noqa: E402


def sequences(model, cfg: KVConfig, budget: int, contexts: list[int], generated: int) -> list[int]:
    """How many sequences of each length in `contexts` the budget holds under `cfg`."""
    o = EngineOptions()
    plan = plan_kv(model, cfg, batch=True)
    layout = choose_layout(plan, o.block_size)
    share = share_for(
        plan, budget, prefill_step=o.prefill_step_size, prompt_rows=o.prompt_concurrency,
        paged=layout.paged, block_size=layout.block_size or 0,
    )  # fmt: skip
    return [share.cost.sequences(budget, Shape(max(1, c - generated), c)) for c in contexts]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--budget", type=float, required=True, help="MiB")
    p.add_argument("--context", type=int, action="append", required=True, help="tokens (repeat)")
    p.add_argument("--generated", type=int, default=24, help="of each context (default 24)")
    p.add_argument("--setting", action="append", required=True, help="KV flags (repeat)")
    add_kv_flags(p)
    args = p.parse_args(argv)
    spaces = setting_namespaces(args.setting, args)
    source = model_source(args)
    model = load_weights(source, args)
    budget = int(args.budget * 2**20)
    print("| setting | " + " | ".join(f"{c:,} tokens" for c in args.context) + " |")
    print("|---|" + "---:|" * len(args.context))
    for ns in spaces:
        cfg = kv_setting(ns, source, model)
        fits = sequences(model, cfg, budget, args.context, args.generated)
        print(f"| `{cfg.describe()}` | " + " | ".join(map(str, fits)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

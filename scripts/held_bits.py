"""Bits per element KV settings hold at several context lengths, measured from the bytes.

    python scripts/held_bits.py --model /work/models/gemma3-270m-f32 \
      --context 8192 --context 32768 --setting '--kv-bits 4' --setting ''
    python scripts/held_bits.py --model /work/models/smollm2-135m-f32 \
      --context 8192 --context 32768 --report docs/quality_real/smollm2_*.json

The frontier of docs/quality.md is reported at 8,192 tokens; the sinks, the
exact tail and the sliding windows weigh less as the context grows, so the
same settings are priced here at other lengths too. Each setting's caches
are filled as `mlx-kvq eval --held-context` fills them (`evaluate.held_storage`)
and their bytes summed; nothing is run through the model, so a setting costs
seconds. `--setting ''` is the default of the model's layout. With
`--report` (`mlx-kvq eval --json` outputs) the settings are those measured
there on two windows or more, chunked, and each row also shows the worse of
its texts' top-1 agreement and mean KL.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_kvq.commands.flags import add_kv_flags, setting_namespaces  # noqa: E402
from mlx_kvq.commands.startup import kv_setting, load_weights, model_source  # noqa: E402
from mlx_kvq.config import KVConfig  # noqa: E402
from mlx_kvq.evaluate import held_storage  # noqa: E402


def measured_settings(paths: list[Path]) -> dict:
    """KVConfig -> (worst top-1, worst mean KL) over the texts of each setting
    the eval reports measured chunked on two windows or more."""
    out = {}
    for path in paths:
        for s in json.loads(path.read_text())["settings"]:
            texts = [x for x in s["texts"] if x["windows"] >= 2 and not x.get("decode")]
            if len(texts) >= 2:
                d = s["kv_config"]
                cfg = KVConfig(**{**d, "skip_layers": tuple(d["skip_layers"])})
                out[cfg] = (min(x["top1"] for x in texts), max(x["kl_mean"] for x in texts))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--context", type=int, action="append", required=True)
    p.add_argument("--setting", action="append", default=[], help="KV flags (repeat)")
    p.add_argument("--report", type=Path, nargs="*", default=[], help="mlx-kvq eval --json files")
    add_kv_flags(p)
    args = p.parse_args(argv)
    measured = measured_settings(args.report)
    if not (args.setting or measured):
        p.error("give --setting or --report")
    spaces = setting_namespaces(args.setting, args) if args.setting else []
    source = model_source(args)
    model = load_weights(source, args)
    cfgs = [kv_setting(ns, source, model) for ns in spaces]
    cfgs += [c for c in measured if c not in cfgs]
    heads = " | ".join(f"bits/elem at {c:,}" for c in args.context)
    extra = " worst top-1 | worst KL |" if measured else ""
    print(f"| setting | {heads} |{extra}")
    print("|---|" + "---:|" * (len(args.context) + (2 if measured else 0)))
    priced = [(cfg, [held_storage(model, cfg, c)["bits_per_element"] for c in args.context])
              for cfg in cfgs]  # fmt: skip
    for cfg, bits in sorted(priced, key=lambda r: r[1]):
        cells = [f"{b:.2f}" for b in bits]
        if measured:
            top1, kl = measured.get(cfg, (None, None))
            cells += ["-", "-"] if top1 is None else [f"{100 * top1:.2f}%", f"{kl:.1e}"]
        print(f"| `{cfg.describe()}` | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

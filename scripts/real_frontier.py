"""The real-model frontier table of docs/quality.md, from `mlx-kvq eval --json` outputs.

    python scripts/real_frontier.py docs/quality_real/*.json
    python scripts/real_frontier.py --choose docs/quality_real/smollm2_*.json

`--choose` applies the rule that picks the defaults (`choose_default` in
quality_tables.py, the goal of 98% / 1.5e-3 here within 4.5 bits at 8,192
tokens) to the settings measured on both texts, chunked, over two windows or
more, and prints the setting it picks.

Each file is one eval run (one model, one context, several `--setting`s, the
GPL-3 and the Python stdlib code text). One row per setting and text: bits
per element held at `--held-context` tokens (8,192: every overhead counted),
top-1 agreement and mean KL against the unquantized cache, each with its
standard error across windows, and whether it meets the real-model goals of docs/quality.md
(first: top-1 >= 97% and KL <= 5e-3; goal: 98% and 1.5e-3; both within 4.5
bits per element).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from quality_tables import choose_default

BUDGET = 4.5
FIRST = (0.97, 5e-3)
GOAL = (0.98, 1.5e-3)


def verdict(bits: float, top1: float, kl: float) -> str:
    if bits > BUDGET:
        return "over budget"
    if top1 >= GOAL[0] and kl <= GOAL[1]:
        return "goal"
    if top1 >= FIRST[0] and kl <= FIRST[1]:
        return "first goal"
    return "no"


def rows(report: dict, model: str) -> list[str]:
    out = []
    for s in report["settings"]:
        for t in s["texts"]:
            top1, kl = t["top1"], t["kl_mean"]
            # `--decode N`: the last N positions fed one token at a time
            shape = f", last {t['decode']} decoded" if t.get("decode") else ""
            out.append(
                f"| {model} | {Path(t['text']).name} | {t['windows']}x{t['context']}{shape} | "
                f"`{s['setting']}` | {s['bits_per_element']:.2f} | "
                f"{100 * top1:.2f} ± {100 * t['top1_se']:.2f} | "
                f"{kl:.1e} ± {t['kl_mean_se']:.0e} | {verdict(s['bits_per_element'], top1, kl)} |"
            )
    return out


TEXTS = ("GPL-3", "stdlib-code")


def rule_rows(reports: list[dict]) -> list[dict]:
    """The settings of `reports` measured chunked on both texts over two
    windows or more, laid out as `choose_default` reads them (one row per
    setting, its bits at the held context, its result per text)."""
    out = []
    for report in reports:
        for s in report["settings"]:
            texts = {
                Path(t["text"]).name: t
                for t in s["texts"]
                if t["windows"] >= 2 and not t.get("decode")
            }
            if set(texts) != set(TEXTS):
                continue
            out.append({"label": s["setting"], "bits": s["bits_per_element"],
                        "texts": texts, "kv_config": s["kv_config"]})  # fmt: skip
    return out


def choose(reports: list[dict]) -> dict:
    """The row the rule picks from the measured settings of one model."""
    return choose_default(rule_rows(reports))


def main(paths: list[str]) -> int:
    if paths[:1] == ["--choose"]:
        row = choose([json.loads(Path(p).read_text()) for p in paths[1:]])
        print(f"`{row['label']}`, {row['bits']:.2f} bits per element: {row['kv_config']}")
        return 0
    print(
        "| model | text | windows x tokens | setting | bits/elem at 8k | top-1 % | mean KL | meets |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for p in paths:
        report = json.loads(Path(p).read_text())
        print("\n".join(rows(report, Path(report["model"]).name)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Regenerate the tables and the plot of docs/quality.md.

    python scripts/quality_tables.py                   # every section
    python scripts/quality_tables.py --only frontier   # the demo model on both texts
    python scripts/quality_tables.py --only outlier    # the outlier-key model only
    python scripts/quality_tables.py --render          # tables, plot, default from docs/quality.json

Each table is written between `<!-- BEGIN name -->` / `<!-- END name -->`
markers in docs/quality.md (the prose around them is left alone), and the raw
numbers (per-window values included) go to docs/quality.json. Sections:

- frontier: the embedded demo model (gemma3_text, 4 sliding-window layers of
  128 tokens and 2 full-attention layers, head_dim 64) on its two texts, the
  held-out KJV books (in domain) and modern technical English (out of
  domain), through `mlx_kvq.evaluate.evaluate_many`: every setting against
  one shared unquantized run per text, chunked prefill through the real
  caches. Bits per element are measured from the bytes the caches hold at
  2,048 tokens. Also the plot docs/img/quality_frontier.png and the default
  chosen from these numbers by `choose_default` (the rule is in its
  docstring).
- outlier: a random-weight llama whose keys carry a few large channels
  (k_proj rows of two RoPE pairs per KV head scaled by 8x and 16x, the
  matching q_proj rows divided by the same factor, so the unquantized model
  computes exactly the same function as the control without outliers).
  Attention-output error per layer call (keys and values quantized
  separately) and end-to-end KL, with and without Hadamard rotation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import mlx.core as mx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlx_kvq import attention  # noqa: E402
from mlx_kvq.blas import use_fast_blas  # noqa: E402
from mlx_kvq.compute import DTYPES  # noqa: E402
from mlx_kvq.config import KVConfig, QuantSpec  # noqa: E402
from mlx_kvq.evaluate import evaluate_many, load_eval_inputs  # noqa: E402
from mlx_kvq.quant import Store  # noqa: E402

DOC = REPO / "docs" / "quality.md"
RAW = REPO / "docs" / "quality.json"
PLOT = REPO / "docs" / "img" / "quality_frontier.png"


# -- demo model: the frontier on both texts --------------------------------------------
# the goal: mlx-lm's `--kv-bits 4` bytes at most, with near-lossless top-1 and KL
GOAL_BITS, GOAL_TOP1, GOAL_KL = 4.5, 0.98, 0.0015


def frontier_settings() -> list[tuple[str, KVConfig]]:
    """(label, setting): mlx-lm-style uniform widths, then bounded layers
    (the sliding windows) wider than the rest."""
    rot = "hadamard"
    out = [(f"{b}-bit", KVConfig(bits=b)) for b in (8, 5, 4)]
    out += [
        ("4-bit + rot", KVConfig(bits=4, rotation=rot)),
        ("K4/V3 + rot", KVConfig(bits=4, value_bits=3, rotation=rot)),
        ("3-bit + rot", KVConfig(bits=3, rotation=rot)),
    ]
    for w, b, vb, r in (
        (8, 4, None, "none"), (8, 4, 3, "none"), (8, 4, 3, rot), (8, 3, None, "none"),
        (8, 3, None, rot), (8, 3, 2, rot), (8, 2, None, rot), (6, 4, 3, rot), (6, 3, None, rot),
    ):  # fmt: skip
        label = f"windows {w}-bit, " + (f"K{b}/V{vb}" if vb else f"{b}-bit")
        label += " + rot" if r != "none" else ""
        out.append((label, KVConfig(bits=b, value_bits=vb, rotation=r, window_bits=w)))
    # Wider keys: where the model has no bounded layer to widen, the same
    # budget (4.5 bits per element) spent on the keys.
    out += [
        ("K5/V3 + rot", KVConfig(bits=5, value_bits=3, rotation=rot)),
        ("windows 8-bit, K5/V3 + rot", KVConfig(bits=5, value_bits=3, rotation=rot, window_bits=8)),
    ]
    # Past the budget: what a model needs where nothing within it meets the goal.
    for b, vb in ((4, 5), (5, 4), (5, None), (4, 6), (6, 5), (5, 6), (6, None)):
        label = (f"K{b}/V{vb}" if vb else f"{b}-bit") + " + rot"
        out.append((label, KVConfig(bits=b, value_bits=vb, rotation=rot)))
    return out


def section_key(model: str | None, context: int) -> str:
    """The docs/quality.json key and docs/quality.md block of one frontier run:
    `frontier` for the gemma demo model at 512 tokens (the first one
    recorded), `frontier_<demo name>_<context>` otherwise."""
    from mlx_kvq.demo import demo_name

    name = demo_name(model) or Path(model).name
    return "frontier" if (name, context) == ("gemma", 512) else f"frontier_{name}_{context}"


def plan_signature(model, cfg: KVConfig) -> tuple:
    """What every layer of `model` gets under `cfg`: two settings with the same
    signature store the same bytes and compute the same logits (on a model
    with no bounded layer, `window_bits` changes nothing)."""
    from mlx_kvq.generate import get_plan

    plan = get_plan(model, cfg)
    return tuple((p.kind, p.key_spec, p.value_spec, p.skipped) for p in plan.layers)


def run_frontier(args, settings=None, data: dict | None = None) -> dict:
    """Measure `settings` (default: every frontier setting; with `data`, a
    recorded run of the same windows, only those it lacks, added to it) on
    the model's texts. Settings that plan the same layers on this model are
    measured once and recorded under each label."""
    settings = settings or frontier_settings()
    model, _, texts = load_eval_inputs(args.model, args.text, args.dtype)
    if data is None:
        data = {"args": {k: str(v) for k, v in vars(args).items()}, "labels": [], "texts": {}}
    settings = [(label, c) for label, c in settings if label not in data["labels"]]
    unique: dict[tuple, KVConfig] = {}
    for _, c in settings:
        unique.setdefault(plan_signature(model, c), c)
    keys = list(unique)
    for name, (ids, bos) in texts.items():
        t0 = time.perf_counter()
        measured = evaluate_many(
            model, ids, list(unique.values()), context=args.context, chunk=args.chunk,
            windows=args.windows, bos=bos, progress=True,
        )  # fmt: skip
        by_key = dict(zip(keys, measured, strict=True))
        out = data["texts"].setdefault(name, [])
        for _, c in settings:
            r = by_key[plan_signature(model, c)]
            out.append({**r, "setting": c.describe(), "kv_config": asdict(c)})
        took = time.perf_counter() - t0
        print(f"frontier: {name}: {len(unique)} settings in {took:.0f} s", file=sys.stderr)
    data["labels"] += [label for label, _ in settings]
    return data


def rows(data: dict) -> list[dict]:
    """One row per setting: its label, bits, and each text's result."""
    names = list(data["texts"])
    out = []
    for i, label in enumerate(data["labels"]):
        per_text = {n: data["texts"][n][i] for n in names}
        first = per_text[names[0]]
        out.append({"label": label, "bits": first["bits_per_element"], "texts": per_text,
                    "kv_config": first["kv_config"]})  # fmt: skip
    return out


def worst(row: dict) -> tuple[float, float]:
    """(highest mean KL, lowest top-1) over the texts."""
    kl = max(r["kl_mean"] for r in row["texts"].values())
    top1 = min(r["top1"] for r in row["texts"].values())
    return kl, top1


def meets_goal(row: dict, budget: float = GOAL_BITS) -> bool:
    kl, top1 = worst(row)
    return row["bits"] <= budget + 1e-9 and kl <= GOAL_KL and top1 >= GOAL_TOP1


def clears(row: dict) -> bool:
    """Every text's top-1 agreement at least one standard error above the goal's."""
    return all(t["top1"] - t["top1_se"] >= GOAL_TOP1 for t in row["texts"].values())


def on_frontier(row: dict, all_rows: list[dict]) -> bool:
    """No other setting costs no more bits and has a lower worst-text mean KL."""
    kl = worst(row)[0]
    return not any(
        o is not row and o["bits"] <= row["bits"] + 1e-9 and worst(o)[0] < kl for o in all_rows
    )


def choose_default(all_rows: list[dict]) -> dict:
    """The default: among the settings at or under the goal's budget (4.5
    bits per element held at 2,048 tokens: the bytes of mlx-lm's
    `--kv-bits 4`) that meet the goal on both texts, the one with the lowest
    worst-text mean KL; a cheaper one whose KL is within one standard error
    of it (the larger of the two texts' errors) wins the tie. When none within
    the budget meets the goal, quality comes first: bytes are spent until it is
    met beyond its noise, so the cheapest setting past the budget that meets it
    with every text's top-1 agreement a standard error clear of the bar (the
    lower worst-text KL between equals)."""
    ok = [r for r in all_rows if meets_goal(r)]
    if not ok:
        wider = [r for r in all_rows if meets_goal(r, budget=math.inf) and clears(r)]
        if not wider:
            raise ValueError("no setting meets the goal: no default can be chosen by this rule")
        return min(wider, key=lambda r: (r["bits"], worst(r)[0]))
    best = min(ok, key=lambda r: worst(r)[0])
    se = max(t["kl_mean_se"] for t in best["texts"].values())
    near = [r for r in ok if worst(r)[0] <= worst(best)[0] + se]
    return min(near, key=lambda r: (r["bits"], worst(r)[0]))


def _pm(value: float, se: float, fmt: str, scale: float = 1.0) -> str:
    return f"{scale * value:{fmt}} ± {scale * se:{fmt}}"


def frontier_table(all_rows: list[dict], default: dict) -> str:
    names = list(all_rows[0]["texts"])
    head = "| setting | bits/elem | " + " | ".join(
        f"mean KL, {n} | KL p99, {n} | top-1, {n}" for n in names
    )
    lines = [head + " | goal |", "|---|---:|" + "---:|---:|---:|" * len(names) + "---|"]
    for r in all_rows:
        cells = []
        for n in names:
            t = r["texts"][n]
            cells += [
                _pm(t["kl_mean"], t["kl_mean_se"], ".2e"),
                _pm(t["kl_p99"], t["kl_p99_se"], ".1e"),
                _pm(t["top1"], t["top1_se"], ".2f", 100) + "%",
            ]
        marks = ("meets" if meets_goal(r) else "") + (
            " · frontier" if on_frontier(r, all_rows) else ""
        )
        label = f"**{r['label']}** (default)" if r["label"] == default["label"] else r["label"]
        lines.append(f"| {label} | {r['bits']:.2f} | " + " | ".join(cells) + f" | {marks} |")
    return "\n".join(lines)


def ppl_table(all_rows: list[dict]) -> str:
    names = list(all_rows[0]["texts"])
    lines = [
        "| setting | bits/elem | " + " | ".join(f"rel. ppl change, {n}" for n in names) + " |",
        "|---|---:|" + "---:|" * len(names),
    ]
    for r in all_rows:
        cells = [
            f"{100 * r['texts'][n]['rel_ppl_change']:+.3f}% ± "
            f"{100 * r['texts'][n]['rel_ppl_change_se']:.3f}"
            for n in names
        ]
        lines.append(f"| {r['label']} | {r['bits']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


MODEL_TITLES = {
    "gemma": "Demo model (`demo:gemma`: hybrid, 4 sliding-window layers and 2 full-attention)",
    "full": "Full-attention model (`demo:full`: qwen3, 4 full-attention layers, q/k norm)",
}


def model_name(key: str) -> str:
    """Which demo model a frontier run is of, from its key (see `section_key`)."""
    return "gemma" if key == "frontier" else key.split("_")[1]


def model_title(key: str) -> str:
    name = model_name(key)
    return MODEL_TITLES.get(name, name)


def bounded(model: str) -> bool:
    """Whether a demo model has a bounded layer (a sliding window)."""
    from mlx_kvq.demo import resolve_model
    from mlx_kvq.plan import has_bounded_layers

    return has_bounded_layers(Path(resolve_model(f"demo:{model}")[0]))


def package_default(model: str = "gemma") -> KVConfig:
    """The package's default setting on a demo model: it depends on whether the
    model has a bounded layer (`mlx_kvq.defaults.default_kv_config`)."""
    from mlx_kvq.defaults import default_kv_config

    return default_kv_config(bounded(model))


def default_row(all_rows: list[dict], model: str = "gemma") -> dict:
    """The row of the package's default setting on `model`, or a row of no
    setting where it was not measured (the full-attention default is chosen
    on a real model: scripts/real_frontier.py)."""
    default = package_default(model)
    return next((r for r in all_rows if config_of(r) == default), {"label": None})


def demo_row(data: dict) -> dict:
    """The setting the rule picks on a demo model's run: the demo blocks'
    fast regression check (the package's defaults are chosen on the real
    models: scripts/real_frontier.py)."""
    return choose_default(rows(data))


def choice_line(all_rows: list[dict]) -> str:
    try:
        chosen = choose_default(all_rows)
    except ValueError:
        return "No setting of this run meets the goal."
    past = (
        ""
        if chosen["bits"] <= GOAL_BITS + 1e-9
        else (f", past the {GOAL_BITS}-bit budget: no setting within it meets the goal")
    )
    return (f"Chosen by `choose_default` on this run: **{chosen['label']}** "
            f"({chosen['bits']:.2f} bits/elem{past}).")  # fmt: skip


def frontier_section(data: dict, key: str = "frontier") -> str:
    all_rows = rows(data)
    default = default_row(all_rows, model_name(key))
    first = next(iter(data["texts"].values()))[0]
    ppl = ", ".join(f"{n} {rs[0]['ppl_base']:.2f}" for n, rs in data["texts"].items())
    head = (
        f"{model_title(key)}, per text {first['windows']} windows x {first['context']} "
        "tokens, prefill "
        f"chunks of {first['chunk']}, {first['tokens_scored']} tokens scored; unquantized "
        f"perplexity {ppl}. Bits per element from the bytes held at "
        f"{first['held_context']} tokens. ± is the standard error across windows. "
        f'"meets": at most {GOAL_BITS} bits, top-1 at least {100 * GOAL_TOP1:.0f}% and mean '
        f'KL at most {GOAL_KL} on both texts; "frontier": no setting with as few bits has a '
        "lower worst-text mean KL.\n\n"
    )
    tail = (
        "\n\nPerplexity change (secondary):\n\n" + ppl_table(all_rows) + "\n\n"
        f"{choice_line(all_rows)}\n\n![{key}](img/quality_{key}.png)"
    )
    return head + frontier_table(all_rows, default) + tail


def config_of(row: dict) -> KVConfig:
    """The recorded setting of a row as a KVConfig (JSON keeps tuples as lists)."""
    c = row["kv_config"]
    return KVConfig(**{**c, "skip_layers": tuple(c["skip_layers"])})


def eval_command(row: dict, first: dict, model: str | None = None, dtype: str = "auto") -> str:
    """The `mlx-kvq eval` command that measures `row` on the frontier's windows
    (of `model`, a demo model's name; the gemma demo needs no flag; `dtype`,
    what the run computed in): no bits flag when it is the package's default
    setting."""
    cmd = "mlx-kvq eval " + (f"--model demo:{model} " if model not in (None, "gemma") else "")
    cmd += f"--context {first['context']} --chunk {first['chunk']} --windows {first['windows']}"
    if dtype != "auto":
        cmd += f" --dtype {dtype}"
    if config_of(row) == package_default(model or "gemma"):
        return cmd
    c = row["kv_config"]
    flags = [f"--kv-bits {c['bits']}"]
    if c["value_bits"] is not None:
        flags.append(f"--kv-value-bits {c['value_bits']}")
    if c["rotation"] != "none":
        flags.append(f"--kv-rotation {c['rotation']}")
    if c["window_bits"] is not None:
        flags.append(f"--kv-window-bits {c['window_bits']}")
    return cmd + " " + " ".join(flags)


# The runs the rule reads: each demo model at 512 tokens, 8 windows per text.
RULE_RUNS = {"gemma": "frontier", "full": "frontier_full_512"}


def combined_rows(raw: dict) -> list[dict]:
    """One row per setting measured in every run of RULE_RUNS: its texts are
    every model's texts (named `model/text`), its bits the most any model
    holds, so `meets_goal` asks for the goal on every model and text and
    `choose_default` applies the rule over all models at once."""
    per = {m: {r["label"]: r for r in rows(raw[k]["data"])} for m, k in RULE_RUNS.items()}
    first = next(iter(per.values()))
    out = []
    for label, row in first.items():
        if not all(label in p for p in per.values()):
            continue
        texts = {f"{m}/{t}": v for m, p in per.items() for t, v in p[label]["texts"].items()}
        bits = max(p[label]["bits"] for p in per.values())
        out.append({"label": label, "bits": bits, "texts": texts, "kv_config": row["kv_config"],
                    "models": {m: p[label] for m, p in per.items()}})  # fmt: skip
    return out


def run_dtype(data: dict) -> str:
    """What a recorded run computed in (`--dtype`; runs recorded before the CPU
    backend computed half-precision weights in float32 say float16)."""
    return data["args"].get("dtype", "auto")


def default_section(data: dict, model: str = "gemma") -> str:
    """The figures of the rule's pick on one demo model (`demo_row`) exactly as
    the command beside them prints them."""
    from mlx_kvq.evaluate import format_text_table

    default = demo_row(data)
    first = next(iter(data["texts"].values()))[0]
    results = [{"text": n, **default["texts"][n]} for n in data["texts"]]
    return (
        f"`{eval_command(default, first, model, run_dtype(data))}` prints (`demo:{model}`, both texts, in-domain "
        f"first; {default['bits']:.2f} bits per element held at {first['held_context']} "
        "tokens):\n\n" + format_text_table(results)
    )


def frontier_plot(data: dict, path: Path, key: str = "frontier") -> str | None:
    """Bits per element against mean KL and top-1 agreement, both texts."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'mlx-kvq[plot]'): plot skipped"
    all_rows = rows(data)
    default = default_row(all_rows, model_name(key))
    fig, (ax_kl, ax_top) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, color in zip(data["texts"], ("tab:blue", "tab:orange"), strict=False):
        for windowed, marker in ((False, "o"), (True, "s")):
            pts = [r for r in all_rows if (r["kv_config"]["window_bits"] is not None) == windowed]
            xs = [r["bits"] for r in pts]
            label = f"{name}, " + ("bounded layers wider" if windowed else "uniform width")
            ax_kl.scatter(xs, [r["texts"][name]["kl_mean"] for r in pts], c=color,
                          marker=marker, label=label, alpha=0.8)  # fmt: skip
            ax_top.scatter(xs, [100 * r["texts"][name]["top1"] for r in pts], c=color,
                           marker=marker, label=label, alpha=0.8)  # fmt: skip
        front = sorted((r for r in all_rows if on_frontier(r, all_rows)), key=lambda r: r["bits"])
        ax_kl.plot([r["bits"] for r in front], [r["texts"][name]["kl_mean"] for r in front],
                   c=color, lw=1, alpha=0.6)  # fmt: skip
    for ax, field, scale in ((ax_kl, "kl_mean", 1), (ax_top, "top1", 100)):
        if default["label"] is not None:
            vals = [scale * t[field] for t in default["texts"].values()]
            ax.scatter([default["bits"]] * len(vals), vals, s=180, facecolors="none",
                       edgecolors="black", label="default")  # fmt: skip
        ax.axvline(GOAL_BITS, color="grey", ls=":", lw=1)
        ax.set_xlabel("bits per element held at 2,048 tokens")
        ax.grid(alpha=0.3)
    ax_kl.axhline(GOAL_KL, color="grey", ls="--", lw=1)
    ax_top.axhline(100 * GOAL_TOP1, color="grey", ls="--", lw=1)
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("mean KL(unquantized || quantized), nats")
    ax_top.set_ylabel("top-1 agreement, %")
    ax_kl.set_title("KL divergence (lower is better)")
    ax_top.set_title("top-1 agreement (higher is better)")
    ax_top.legend(fontsize=8, loc="lower right")
    first = next(iter(data["texts"].values()))[0]
    fig.suptitle(
        f"{model_title(key).split(' (')[0]}, {first['context']} tokens: bits against fidelity "
        f"on {' and '.join(data['texts'])}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return None


# -- outlier-key model ---------------------------------------------------------------------
OUTLIER_PAIRS = {5: 8.0, 30: 16.0}  # RoPE pair index (i, i + head_dim/2) -> key scale


def outlier_model(outliers: bool, seed: int = 0):
    """A random float32 llama (4 layers, 4 query / 2 KV heads, head_dim 64).

    q_proj and k_proj are scaled up so attention is selective (scores with a
    standard deviation of a few units, as in trained models). With
    `outliers`, two RoPE pairs of every KV head get large key channels: the
    k_proj rows are multiplied by the factors of OUTLIER_PAIRS and the q_proj
    rows of the query heads reading that KV head divided by them. RoPE
    rotates each pair as a plane, which commutes with scaling the plane, so
    q.k is unchanged: the unquantized model is the same function as the
    control, only the stored keys differ.
    """
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=512, rope_theta=10000.0, tie_word_embeddings=True,
    )  # fmt: skip
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    D, n_kv, rep = 64, 2, 2
    for layer in model.model.layers:
        a = layer.self_attn
        q_scale = mx.ones((4 * D,)) * 3.0
        k_scale = mx.ones((n_kv * D,)) * 3.0
        if outliers:
            q_scale, k_scale = q_scale.tolist(), k_scale.tolist()
            for h in range(n_kv):
                for i, s in OUTLIER_PAIRS.items():
                    for c in (i, i + D // 2):
                        k_scale[h * D + c] *= s
                        for r in range(rep):
                            q_scale[(h * rep + r) * D + c] /= s
            q_scale, k_scale = mx.array(q_scale), mx.array(k_scale)
        a.q_proj.weight = a.q_proj.weight * q_scale[:, None]
        a.k_proj.weight = a.k_proj.weight * k_scale[:, None]
    mx.eval(model.parameters())
    attention.install()
    return model


class _Recorder:
    """Records every attention call's (queries, keys, values, mask, scale)."""

    def __init__(self):
        self.calls = []

    def __call__(self, queries, keys, values, cache, scale, mask, sinks=None):
        self.calls.append((queries, keys, values, mask, scale))
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def record_attention(model, tokens: list[int], chunk: int) -> list:
    """Run `tokens` through unquantized caches chunk by chunk, recording attention inputs."""
    from mlx_lm.models import cache as mlx_cache
    from mlx_lm.models import llama

    rec = _Recorder()
    saved = llama.scaled_dot_product_attention
    llama.scaled_dot_product_attention = rec
    try:
        cache = mlx_cache.make_prompt_cache(model)
        ids = mx.array(tokens)[None]
        for s in range(0, len(tokens), chunk):
            mx.eval(model(ids[:, s : s + chunk], cache=cache))
            mx.eval([c[:3] for c in rec.calls])
    finally:
        llama.scaled_dot_product_attention = saved
    return rec.calls


def attention_error(calls: list, key_spec: QuantSpec, value_spec: QuantSpec) -> float:
    """Relative Frobenius error of attention outputs over all recorded calls."""
    num = den = 0.0
    for q, k, v, mask, scale in calls:
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        kq = Store.encode(k, key_spec).fetch()
        vq = Store.encode(v, value_spec).fetch()
        out = attention.quantized_attention(q, kq, vq, scale, mask)
        num += mx.sum((out - ref) ** 2).item()
        den += mx.sum(ref**2).item()
    return math.sqrt(num / den)


def key_outlier_ratio(calls: list) -> float:
    """Largest per-channel RMS of the keys over the median channel RMS."""
    ratios = []
    for _, k, _, _, _ in calls[-4:]:
        rms = mx.sqrt(mx.mean(k.astype(mx.float32) ** 2, axis=(0, 2)))  # (heads, dim)
        ratios.append((rms.max(axis=-1) / mx.median(rms, axis=-1)).max().item())
    return max(ratios)


def outlier_settings() -> list[tuple[str, str, KVConfig]]:
    out = []
    for bits in (4, 3):
        for which in ("keys", "values", "both"):
            for rot in ("none", "hadamard"):
                kb = bits if which in ("keys", "both") else None
                vb = bits if which in ("values", "both") else None
                out.append((which, rot, KVConfig(key_bits=kb, value_bits=vb, rotation=rot)))
    return out


def run_outlier(args) -> dict:
    mx.random.seed(1)
    tokens = mx.random.randint(0, 512, (args.outlier_tokens,)).tolist()
    settings = outlier_settings()
    sections = {}
    for name, outliers in (("outlier", True), ("control", False)):
        model = outlier_model(outliers)
        calls = record_attention(model, tokens[: args.context], args.chunk)
        ratio = key_outlier_ratio(calls)
        errs = [attention_error(calls, c.key_spec, c.value_spec) for _, _, c in settings]
        evals = evaluate_many(
            model, tokens, [c for _, _, c in settings], context=args.context, chunk=args.chunk,
            windows=args.windows, progress=True,
        )  # fmt: skip
        rows = []
        for (which, rot, c), err, r in zip(settings, errs, evals, strict=True):
            rows.append({"quantized": which, "rotation": rot, "bits": c.key_bits or c.value_bits,
                         "attn_rel_err": err, **r})  # fmt: skip
        sections[name] = {"key_outlier_ratio": ratio, "rows": rows}
        print(f"{name}: key channel RMS max/median {ratio:.1f}", file=sys.stderr)
    return sections


def outlier_table(sections: dict) -> str:
    """Rows: model, bits, which tensor is quantized; columns: without / with rotation."""
    lines = [
        "| model | bits | quantized | attn. output rel. error, no rotation | with rotation "
        "| mean KL (nats), no rotation | with rotation |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for name, sec in sections.items():
        label = f"{name} (key channel RMS max/median {sec['key_outlier_ratio']:.1f}x)"
        rows = {(r["bits"], r["quantized"], r["rotation"]): r for r in sec["rows"]}
        for bits, which, _ in rows:
            if _ != "none":
                continue
            plain, rot = rows[(bits, which, "none")], rows[(bits, which, "hadamard")]
            lines.append(
                f"| {label} | {bits} | {which} | {plain['attn_rel_err']:.3f} | "
                f"{rot['attn_rel_err']:.3f} | {plain['kl_mean']:.3f} | {rot['kl_mean']:.3f} |"
            )
    return "\n".join(lines)


# -- writing ----------------------------------------------------------------------------------
def write_section(name: str, body: str, command: str) -> None:
    text = DOC.read_text() if DOC.exists() else "# Output quality under KV quantization\n"
    block = f"<!-- BEGIN {name} -->\nRegenerate with `{command}`.\n\n{body}\n<!-- END {name} -->"
    pattern = re.compile(rf"<!-- BEGIN {name} -->.*?<!-- END {name} -->", re.S)
    text = (
        pattern.sub(lambda _: block, text)
        if pattern.search(text)
        else text.rstrip() + "\n\n" + block + "\n"
    )
    DOC.write_text(text)


def save_raw(key: str, value) -> None:
    """Set one key of docs/quality.json (locked: runs of other models may write
    theirs at the same time)."""
    import fcntl

    with open(RAW.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        raw = json.loads(RAW.read_text()) if RAW.exists() else {}
        raw[key] = value
        RAW.write_text(json.dumps(raw, indent=1) + "\n")


def frontier_keys(raw: dict) -> list[str]:
    return [k for k in raw if k == "frontier" or k.startswith("frontier_")]


def render_frontier(key: str, section: dict) -> None:
    """The block (table, plot) of one frontier run, and the default's block
    of a run the rule reads."""
    data, cmd = section["data"], section["command"]
    write_section(key, frontier_section(data, key), cmd)
    msg = frontier_plot(data, REPO / "docs" / "img" / f"quality_{key}.png", key)
    if msg:
        print(msg, file=sys.stderr)
    model = next((m for m, k in RULE_RUNS.items() if k == key), None)
    if model is not None:
        block = "default" if model == "gemma" else f"default_{model}"
        write_section(block, default_section(data, model), cmd)


def render_rule(raw: dict) -> None:
    """The growth table, and the rule's choice on every model of RULE_RUNS
    if all are recorded."""
    growth = growth_section(raw)
    if growth:
        write_section("growth", growth, "python scripts/quality_tables.py --render")
    if not all(k in raw for k in RULE_RUNS.values()):
        return
    write_section("rule", rule_section(raw), "python scripts/quality_tables.py --render")
    for model, key in RULE_RUNS.items():
        try:
            chosen = choose_default(rows(raw[key]["data"]))
        except ValueError as e:
            print(f"rule on {model}: {e}", file=sys.stderr)
            continue
        print(f"the rule on demo:{model}: {chosen['label']}", file=sys.stderr)


def growth_section(raw: dict) -> str | None:
    """Each setting measured at 512 tokens and at a model's full context: mean KL
    and top-1 side by side, per model and text (does the error grow with the
    number of keys in a softmax?)."""
    lines = [
        "| model | setting | text | mean KL, 512 | mean KL, full context | ratio "
        "| top-1, 512 | top-1, full context |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    found = False
    for model, short in RULE_RUNS.items():
        if short not in raw:
            continue
        base = {r["label"]: r for r in rows(raw[short]["data"])}
        for key in frontier_keys(raw):
            if key == short or model_title(key) != model_title(short):
                continue
            ctx = next(iter(raw[key]["data"]["texts"].values()))[0]["context"]
            for r in rows(raw[key]["data"]):
                if r["label"] not in base:
                    continue
                for text, t in r["texts"].items():
                    b = base[r["label"]]["texts"][text]
                    found = True
                    lines.append(
                        f"| {model} ({ctx} tokens) | {r['label']} | {text} | "
                        f"{_pm(b['kl_mean'], b['kl_mean_se'], '.2e')} | "
                        f"{_pm(t['kl_mean'], t['kl_mean_se'], '.2e')} | "
                        f"{t['kl_mean'] / b['kl_mean']:.2f} | "
                        f"{_pm(b['top1'], b['top1_se'], '.2f', 100)}% | "
                        f"{_pm(t['top1'], t['top1_se'], '.2f', 100)}% |"
                    )
    return "\n".join(lines) if found else None


def rule_section(raw: dict) -> str:
    """The rule on each model's run of RULE_RUNS beside the package's default
    for that model's layout, then the settings measured on every model, worst
    first, and whether one of them meets the goal on all of them."""
    lines = [
        "| model | bounded layers | chosen by the rule | bits/elem | worst mean KL | worst top-1 "
        "| the package's default |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for model, key in RULE_RUNS.items():
        has = "yes" if bounded(model) else "no"
        try:
            chosen = choose_default(rows(raw[key]["data"]))
        except ValueError:
            lines.append(f"| {model} | {has} | none meets the goal | | | | |")
            continue
        kl, top1 = worst(chosen)
        same = "yes" if config_of(chosen) == package_default(model) else "**no**"
        lines.append(f"| {model} | {has} | {chosen['label']} | "
                     f"{chosen['bits']:.2f} | {kl:.2e} | {100 * top1:.2f}% | {same} |")  # fmt: skip
    both = combined_rows(raw)
    lines += [
        "",
        "One setting for every model (the settings measured on all of them; bits per element "
        "of each model; worst of all their texts):",
        "",
        "| setting | bits/elem, " + ", ".join(RULE_RUNS) + " | worst mean KL | worst top-1 "
        "| meets on every model |",
        "|---|---:|---:|---:|---|",
    ]
    for r in sorted(both, key=lambda r: worst(r)[0]):
        bits = " / ".join(f"{m['bits']:.2f}" for m in r["models"].values())
        kl, top1 = worst(r)
        lines.append(f"| {r['label']} | {bits} | {kl:.2e} | {100 * top1:.2f}% | "
                     f"{'yes' if meets_goal(r) else ''} |")  # fmt: skip
    inside = sorted((r for r in both if meets_goal(r)), key=lambda r: worst(r)[0])
    tail = (
        f"Within the {GOAL_BITS}-bit budget, **{inside[0]['label']}** meets the goal on every "
        "model (the lowest worst KL of those that do)."
        if inside
        else f"No single setting meets the goal on every model within the {GOAL_BITS}-bit budget."
    )
    return "\n".join(lines) + "\n\n" + tail


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("frontier", "outlier"), default=None)
    p.add_argument("--model", default=None, help="default: the embedded demo model (demo:gemma)")
    p.add_argument("--text", type=Path, action="append", default=None,
                   help="default: the demo model's two texts")  # fmt: skip
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--setting", action="append", default=None,
                   help="frontier: only this setting (its label; repeat for several)")  # fmt: skip
    p.add_argument("--add", action="store_true",
                   help="frontier: add the settings the recorded run of the same windows lacks")  # fmt: skip
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="what the model computes in, as `mlx-kvq eval --dtype`")  # fmt: skip
    p.add_argument("--outlier-tokens", type=int, default=4096)
    p.add_argument(
        "--render", action="store_true", help="rewrite tables and plot from docs/quality.json only"
    )
    args = p.parse_args(argv)
    use_fast_blas()  # as `mlx-kvq eval` measures (the recorded numbers were made so)
    raw = json.loads(RAW.read_text()) if RAW.exists() else {}
    if args.render:
        for key in frontier_keys(raw) if args.only in (None, "frontier") else []:
            render_frontier(key, raw[key])
        if args.only in (None, "frontier"):
            render_rule(raw)
        if args.only in (None, "outlier") and "outlier" in raw:
            write_section("outlier", outlier_table(raw["outlier"]["data"]),
                          raw["outlier"]["command"])  # fmt: skip
        return 0
    if args.only in (None, "frontier"):
        key = section_key(args.model, args.context)
        cmd = (
            "python scripts/quality_tables.py --only frontier "
            + (f"--model {args.model} " if args.model else "")
            + f"--context {args.context} --chunk {args.chunk} --windows {args.windows}"
            + (f" --dtype {args.dtype}" if args.dtype != "auto" else "")
        )
        labels = dict(frontier_settings())
        unknown = [s for s in args.setting or [] if s not in labels]
        if unknown:
            p.error(f"unknown --setting {unknown}; known: {list(labels)}")
        settings = [(s, labels[s]) for s in args.setting] if args.setting else None
        if settings:
            cmd += "".join(f" --setting {shlex.quote(s)}" for s, _ in settings)
        old = raw.get(key) if args.add else None
        if old is not None:
            cmd = old["command"]
        data = run_frontier(args, settings, old["data"] if old else None)
        save_raw(key, {"command": cmd, "data": data})
        render_frontier(key, {"command": cmd, "data": data})
        render_rule(json.loads(RAW.read_text()))
    if args.only in (None, "outlier"):
        cmd = (
            f"python scripts/quality_tables.py --only outlier --context {args.context} "
            f"--chunk {args.chunk} --windows {args.windows}"
        )
        data = run_outlier(args)
        save_raw("outlier", {"command": cmd, "data": data})
        write_section("outlier", outlier_table(data), cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())

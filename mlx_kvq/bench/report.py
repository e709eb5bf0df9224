"""JSON, markdown and PNG output of a benchmark run."""

from __future__ import annotations

import json
from pathlib import Path

from .timing import format_spread

# decode 4-bit / unquantized, by dtype and context (float32, whose unquantized
# products run on a fast BLAS: 0.9x at 4k and 1.0x at 16k)
GOAL_DECODE = {
    ("float16", 4096): 1.0, ("float16", 16384): 1.0,
    ("bfloat16", 4096): 1.0, ("bfloat16", 16384): 1.0,
    ("float32", 4096): 0.9, ("float32", 16384): 1.0,
}  # fmt: skip
GOAL_PREFILL = 0.9
GOAL_ATTENTION_SPEEDUP = 5.0
GOAL_ATTENTION_CONTEXT = 16384
GOAL_BYTES_DEVIATION = 0.02
GOAL_BITS = "4-bit"
GOAL_SERVING_SCALING = 4.0
GOAL_SERVING_RATIO = 0.9


def write_json(result: dict, path: Path) -> None:
    path.write_text(json.dumps(result, indent=1, default=_jsonable) + "\n")


def _jsonable(x):
    if isinstance(x, tuple):
        return list(x)
    return str(x)


# -- goals -------------------------------------------------------------------
def goals(result: dict) -> list[dict]:
    """Each stated goal with its measured value and whether it was met."""
    out: list[dict] = []
    model = result.get("model")
    if model:
        for row in model["rows"]:
            if row.get("reference_blas"):  # shown for comparison, not a goal
                continue
            ratio = (row["decode_ratio"].get(GOAL_BITS) or {}).get("median")
            want = GOAL_DECODE.get((row["dtype"], row["context"]))
            if want is not None and ratio is not None:
                out.append(
                    _goal(
                        f"decode {GOAL_BITS} vs unquantized, {row['dtype']}, {row['context']} tokens",
                        ratio,
                        want,
                    )
                )
            ratio = (row["prefill_ratio"].get(GOAL_BITS) or {}).get("median")
            if ratio is not None:
                out.append(
                    _goal(
                        f"prefill {GOAL_BITS} vs unquantized, {row['dtype']}, {row['context']} tokens",
                        ratio,
                        GOAL_PREFILL,
                    )
                )
    for row in result.get("attention") or []:
        if row["dtype"] == "float16" and row["context"] == GOAL_ATTENTION_CONTEXT:
            name = f"attention float16 ours vs mlx-lm, {row['context']} cached, {row['queries']} queries"
            est = row.get("speedup_vs_mlx_lm_predicted")
            if row["speedup_vs_mlx_lm"] is None and est is not None:
                out.append(
                    {
                        **_goal(name, est, GOAL_ATTENTION_SPEEDUP),
                        "note": "estimate: mlx-lm not run, "
                        + row["seconds"]["mlx_lm"].get("skipped", ""),
                    }
                )
            elif row["speedup_vs_mlx_lm"] is None:
                out.append(
                    {
                        "goal": name,
                        "value": None,
                        "target": GOAL_ATTENTION_SPEEDUP,
                        "met": None,
                        "note": row["seconds"]["mlx_lm"].get("skipped"),
                    }
                )
            else:
                out.append(_goal(name, row["speedup_vs_mlx_lm"], GOAL_ATTENTION_SPEEDUP))
    memory = result.get("memory")
    if memory:
        devs = [
            e["max_quantized_deviation"]
            for e in memory["contexts"]
            if e["max_quantized_deviation"] is not None
        ]
        if devs:
            worst = max(devs)
            out.append(
                {
                    "goal": "KV bytes per held slot vs theory, every quantized layer (max deviation)",
                    "value": worst,
                    "target": GOAL_BYTES_DEVIATION,
                    "met": worst <= GOAL_BYTES_DEVIATION,
                }
            )
        base = next((p for p in memory["peak"] if p["bits"] is None), None)
        for p in memory["peak"]:
            if p["bits"] is not None and base is not None:
                out.append(
                    {
                        "goal": f"peak memory during {p['context']}-token decode, {p['config']} below unquantized",
                        "value": p["peak_ratio"],
                        "target": 1.0,
                        "met": p["peak"] < base["peak"],
                    }
                )
    srv = result.get("serving")
    if srv and len(srv["rows"]) > 1:
        first, last = srv["rows"][0], srv["rows"][-1]
        for name, st in last["scaling"].items():
            if st.get("median") is not None:
                out.append(
                    {
                        **_goal(
                            f"serving {name}: {last['streams']} streams vs {first['streams']}, "
                            "aggregate generation tokens/s",
                            st["median"],
                            GOAL_SERVING_SCALING,
                        ),
                        "note": "bare model forward at the same batch sizes: "
                        f"{last['model_forward_scaling'][name]['median']:.2f}x",
                    }
                )
        for name, st in last["generation_ratio"].items():
            if st.get("median") is not None:
                out.append(
                    _goal(
                        f"serving {name} vs unquantized at {last['streams']} streams",
                        st["median"],
                        GOAL_SERVING_RATIO,
                    )
                )
    if result.get("servers"):
        from .servers_bench import goals as servers_goals

        out += servers_goals(result["servers"])
    if result.get("agents"):
        from .agents_bench import goals as agents_goals

        out += agents_goals(result["agents"])
    return out  # fmt: skip


def _goal(name: str, value: float, target: float) -> dict:
    return {"goal": name, "value": value, "target": target, "met": value >= target}


# -- markdown ------------------------------------------------------------------
def _spread(d: dict, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return format_spread(d, fmt, scale, mark_single=True)


def _loads(x) -> str:
    return "/".join(f"{v:.1f}" for v in x) if x else "-"


def _x(r) -> str:
    """A ratio: a number, or a Stat dict (median and min-max over rounds)."""
    if isinstance(r, dict):
        if r.get("median") is None:
            return "-"
        if r.get("n", 1) > 1:
            return f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"
        return f"{r['median']:.2f}x"
    return "-" if r is None else f"{r:.2f}x"


def markdown(result: dict) -> str:
    env, s = result["environment"], result["settings"]
    lines = ["# mlx-kvq benchmark", ""]
    lines += [
        f"- command: `{result['command']}`",
        f"- backend: {env['device']} (Metal available: {env['metal_available']}); "
        f"mlx {env['mlx']}, mlx-lm {env['mlx_lm']}, {env['platform']}, {env['cpus']} CPUs",
        f"- BLAS (both arms): {env.get('blas_summary', 'not recorded')}; "
        f"{env.get('native_kernels', 'native kernels not recorded')} "
        f"(threads per call: {env.get('native_threads', '-')})",
        f"- started {env['started']}, took {result['duration_s']:.0f} s; load average "
        f"(1/5/15 min) {_loads(env.get('load_average'))} at the start, "
        f"{_loads(result.get('load_average_end'))} at the end",
        "- figures are medians of repeated runs, min-max in parentheses; the candidates of "
        "a comparison run in the same rounds (A B C, then C B A), and a ratio is the median "
        "of the per-round ratios (min-max over rounds in parentheses; above 1 means the "
        "quantized cache is faster)",
        "",
    ]
    g = result.get("goals") or []
    if g:
        lines += ["## Goals", "", "| goal | measured | target | met |", "|---|---|---|---|"]
        for x in g:
            val = (
                "-"
                if x["value"] is None
                else (f"{x['value']:.2%}" if "deviation" in x["goal"] else f"{x['value']:.2f}")
            )
            tgt = f"{x['target']:.0%}" if "deviation" in x["goal"] else f"{x['target']:.2f}"
            tgt = f"at most {tgt}" if x.get("at_most") else tgt
            met = {True: "yes", False: "**no**", None: "n/a"}[x["met"]]
            note = f" ({x['note']})" if x.get("note") else ""
            lines.append(f"| {x['goal']} | {val}{note} | {tgt} | {met} |")
        lines.append("")
    att = result.get("attention")
    if att:
        n_q, n_kv = s["attn_heads"]
        lines += [
            "## Attention alone",
            "",
            f"{n_q} query heads, {n_kv} KV heads, head dim {s['attn_head_dim']}, "
            f"{s['attn_bits']}-bit K/V, group {s['group_size']}; milliseconds per call. "
            "`ours` is `mlx_kvq.attention.quantized_attention`, `mlx-lm` is "
            "`mlx_lm.models.base.quantized_scaled_dot_product_attention`, `unquantized` is "
            "`mx.fast.scaled_dot_product_attention` on the float K/V. Errors: max abs "
            "difference from float32 attention on the unquantized K/V.",
            "",
            "| dtype | cached | queries | ours ms | mlx-lm ms | unquantized ms | ours vs mlx-lm | ours vs unquantized | err ours | err mlx-lm | ours - mlx-lm |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for r in att:
            sec, err = r["seconds"], r["max_abs_error"]
            lines.append(
                f"| {r['dtype']} | {r['context']} | {r['queries']} | {_spread(sec['ours'], 1e3)} | "
                f"{_spread(sec['mlx_lm'], 1e3)} | {_spread(sec['unquantized'], 1e3)} | "
                f"{_vs_mlx_lm(r)} | {_x(r['speedup_vs_unquantized'])} | "
                f"{err['ours']:.3g} | {_e(err.get('mlx_lm'))} | {_e(err.get('ours_vs_mlx_lm'))} |"
            )
        lines.append("")
    model = result.get("model")
    if model:
        cfg = model["config"]
        names = list(model["rows"][0]["decode_tps"]) if model["rows"] else []
        lines += [
            "## Model",
            "",
            f"{cfg['model_type']}, {model['params'] / 1e6:.1f}M parameters, random weights: "
            f"{cfg['num_hidden_layers']} layers ({_layout(cfg)}), hidden "
            f"{cfg['hidden_size']}, {cfg['num_attention_heads']} query / "
            f"{cfg.get('num_key_value_heads', cfg['num_attention_heads'])} KV heads of dim "
            f"{cfg.get('head_dim', cfg['hidden_size'] // cfg['num_attention_heads'])}, vocabulary "
            f"{cfg['vocab_size']}. Caches filled to the context with random K/V; decode: "
            f"{s['decode_tokens']} greedy steps per sample; prefill: one "
            f"{s['prefill_chunk']}-token chunk on top of context - chunk cached tokens.",
            "",
        ]
        for skip in model.get("skipped", []):
            lines += [f"Not run in {skip['dtype']}: this backend cannot: {skip['reason']}", ""]
        for what in ("decode", "prefill"):
            lines += [
                f"### {what.capitalize()} tokens/s",
                "",
                "| dtype | context | BLAS | "
                + " | ".join(names)
                + " | "
                + " | ".join(f"{n} / unquantized" for n in names[1:])
                + " |",
                "|---|---|---|" + "---|" * (2 * len(names) - 1),
            ]
            for r in model["rows"]:
                tps, ratio = r[f"{what}_tps"], r[f"{what}_ratio"]
                blas = r.get("blas", "-")
                blas = (
                    f"**{blas} (both arms, for comparison)**" if r.get("reference_blas") else blas
                )
                lines.append(
                    f"| {r['dtype']} | {r['context']} | {blas} | "
                    + " | ".join(_spread(tps[n]) for n in names)
                    + " | "
                    + " | ".join(_x(ratio[n]) for n in names[1:])
                    + " |"
                )
            lines.append("")
    mem = result.get("memory")
    if mem:
        lines += [
            "## Memory",
            "",
            f"Model dtype {mem['dtype']}, group size {mem['group_size']}. Theory: "
            "bits/8 + 4/group_size bytes per element (16-bit scale and bias per group), the "
            "dtype's size unquantized. `per slot` divides the bytes held by the allocated "
            "token slots (caches grow in 256-token steps); `per token` by the tokens held.",
            "",
            "| context | cache | KV MiB | kind | layers | bytes/token/layer | bytes per slot element | theory | max deviation |",
            "|---|---|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for e in mem["contexts"]:
            for kind, k in e["by_kind"].items():
                layer = next(x for x in e["layers"] if x["kind"] == kind)
                lines.append(
                    f"| {e['context']} | {e['config']} | {e['kv_bytes'] / 2**20:.2f} | {kind} | "
                    f"{k['layers']} | {k['bytes_per_token_per_layer']:.0f} | "
                    f"{layer['bytes_per_slot_element']:.4f} | {layer['theory_bytes_per_element']:.4f} | "
                    f"{k['max_deviation']:.2%} |"
                )
        lines += [
            "",
            f"Peak memory (`mx.get_peak_memory`) over {s['memory_decode_tokens']} decode steps at "
            f"{s['memory_context']} tokens, after one step that may grow the buffers. "
            "`transient` is the peak above what was held before the steps (weights and caches): "
            "a dequantized copy of one full-attention layer would add at least the last column.",
            "",
            "| cache | peak MiB | vs unquantized | held before MiB | KV MiB | transient MiB | one full layer unquantized K/V MiB |",
            "|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for p in mem["peak"]:
            lines.append(
                f"| {p['config']} | {p['peak'] / 2**20:.1f} | {_x(p['peak_ratio'])} | "
                f"{p['active_before'] / 2**20:.1f} | {p['kv_bytes'] / 2**20:.2f} | "
                f"{p['transient'] / 2**20:.2f} | {p['full_layer_unquantized_kv_bytes'] / 2**20:.2f} |"
            )
        lines.append("")
    srv = result.get("serving")
    if srv:
        names = list(srv["rows"][0]["generation_tps"]) if srv["rows"] else []
        lines += [
            "## Serving",
            "",
            f"{srv['engine']} in-process (no HTTP), model dtype {srv['dtype']}; each stream: "
            f"{s['serving_prompt']}-token prompt, {s['serving_tokens']} generated tokens. "
            "Generation tokens/s: wall clock, the tokens generated after every stream has "
            "its first token over the time from then to the last token (decode only); "
            "end-to-end: all generated tokens over the wall time from submission to the "
            "last finish.",
            "",
            "| streams | "
            + " | ".join(f"{n} gen tok/s" for n in names)
            + " | "
            + " | ".join(f"{n} / unquantized" for n in names[1:])
            + " | "
            + " | ".join(f"{n} vs {srv['rows'][0]['streams']} stream" for n in names)
            + " | "
            + " | ".join(f"{n} end-to-end tok/s" for n in names)
            + " |",
            "|---|" + "---|" * (4 * len(names) - 1),
        ]
        for r in srv["rows"]:
            lines.append(
                f"| {r['streams']} | "
                + " | ".join(_spread(r["generation_tps"][n]) for n in names)
                + " | "
                + " | ".join(_x(r["generation_ratio"][n]) for n in names[1:])
                + " | "
                + " | ".join(_x(r["scaling"][n]) for n in names)
                + " | "
                + " | ".join(_spread(r["end_to_end_tps"][n]) for n in names)
                + " |"
            )
        lines += [
            "",
            "The ceiling: the same model's bare forward pass at the same batch sizes "
            "(no engine; greedy tokens fed back, the same caches), measured in the same "
            "rounds. Batching cannot scale the engine past what it does for the model itself.",
            "",
            "| streams | "
            + " | ".join(f"{n} bare forward tok/s" for n in names)
            + " | "
            + " | ".join(f"{n} bare vs {srv['rows'][0]['streams']} stream" for n in names)
            + " | "
            + " | ".join(f"{n} engine / bare" for n in names)
            + " |",
            "|---|" + "---|" * (3 * len(names)),
        ]
        for r in srv["rows"]:
            lines.append(
                f"| {r['streams']} | "
                + " | ".join(_spread(r["model_forward_tps"][n]) for n in names)
                + " | "
                + " | ".join(_x(r["model_forward_scaling"][n]) for n in names)
                + " | "
                + " | ".join(_x(r["engine_efficiency"][n]) for n in names)
                + " |"
            )
        lines.append("")
    if result.get("budget"):
        from .budget_bench import markdown as budget_markdown

        lines += budget_markdown(result["budget"])
    if result.get("servers"):
        from .servers_bench import markdown as servers_markdown

        lines += servers_markdown(result["servers"])
    if result.get("agents"):
        from .agents_bench import markdown as agents_markdown

        lines += agents_markdown(result["agents"])
    if result.get("plots"):
        lines += (
            ["## Plots", ""]
            + [f"![{Path(p).stem}]({Path(p).name})" for p in result["plots"]]
            + [""]
        )
    if result.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in result["notes"]] + [""]
    return "\n".join(lines)


def _layout(cfg: dict) -> str:
    """The attention schedule of a model config, in words."""
    if cfg.get("layer_types"):
        counts: dict[str, int] = {}
        for t in cfg["layer_types"]:
            counts[t] = counts.get(t, 0) + 1
        kinds = ", ".join(f"{n} {t}" for t, n in counts.items())
        window = cfg.get("sliding_window")
        return kinds + (f"; sliding window {window}" if window else "")
    if cfg.get("sliding_window") and cfg.get("sliding_window_pattern"):
        return (
            f"sliding window {cfg['sliding_window']}, one full-attention layer in "
            f"{cfg['sliding_window_pattern']}"
        )
    if cfg.get("sliding_window"):
        return f"sliding window {cfg['sliding_window']}"
    return "full attention"


def _vs_mlx_lm(r: dict) -> str:
    est = r.get("speedup_vs_mlx_lm_predicted")
    if r["speedup_vs_mlx_lm"] is None and est is not None:
        return f"~{est:.0f}x (estimate)"
    return _x(r["speedup_vs_mlx_lm"])


def _e(x) -> str:
    return "-" if x is None else f"{x:.3g}"


# -- plots -----------------------------------------------------------------------
def plots(result: dict, out_dir: Path) -> tuple[list[str], str | None]:
    """PNG plots; returns (paths, message when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed (pip install 'mlx-kvq[plot]'): plots skipped"
    paths = []
    model = result.get("model")
    if model and model["rows"]:
        dtypes = list(dict.fromkeys(r["dtype"] for r in model["rows"]))
        fig, axes = plt.subplots(2, len(dtypes), figsize=(4 * len(dtypes), 6), squeeze=False)
        for j, dt in enumerate(dtypes):
            rows = [r for r in model["rows"] if r["dtype"] == dt and not r.get("reference_blas")]
            for i, what in enumerate(("decode", "prefill")):
                ax = axes[i][j]
                for name in rows[0][f"{what}_tps"]:
                    _line(
                        ax,
                        [r["context"] for r in rows],
                        [r[f"{what}_tps"][name] for r in rows],
                        name,
                    )
                _style(ax, f"{what}, {dt}", "context (tokens)", "tokens/s")
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "bench_model_speed.png", plt))
    mem = result.get("memory")
    if mem and mem["contexts"]:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for name in dict.fromkeys(e["config"] for e in mem["contexts"]):
            pts = [
                (e["context"], e["kv_bytes"] / 2**20)
                for e in mem["contexts"]
                if e["config"] == name
            ]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        _style(ax, f"KV memory, {mem['dtype']} model", "context (tokens)", "KV cache held (MiB)")
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "bench_kv_memory.png", plt))
    att = result.get("attention")
    if att:
        dtypes = list(dict.fromkeys(r["dtype"] for r in att))
        queries = list(dict.fromkeys(r["queries"] for r in att))
        fig, axes = plt.subplots(
            len(queries), len(dtypes), figsize=(4 * len(dtypes), 3 * len(queries)), squeeze=False
        )
        for i, L in enumerate(queries):
            for j, dt in enumerate(dtypes):
                ax = axes[i][j]
                rows = [r for r in att if r["dtype"] == dt and r["queries"] == L]
                for name in ("ours", "mlx_lm", "unquantized"):
                    pts = [
                        (r["context"], r["seconds"][name])
                        for r in rows
                        if r["seconds"][name].get("median") is not None
                    ]
                    if pts:
                        _line(
                            ax,
                            [p[0] for p in pts],
                            [
                                {
                                    k: (v * 1e3 if isinstance(v, float) else v)
                                    for k, v in p[1].items()
                                }
                                for p in pts
                            ],
                            name,
                        )
                ax.set_yscale("log")
                title = f"{dt}, {L} {'query' if L == 1 else 'queries'}"
                _style(ax, title, "cached tokens", "ms per call")
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "bench_attention.png", plt))
    srv = result.get("serving")
    if srv and srv["rows"]:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        xs = [r["streams"] for r in srv["rows"]]
        for name in srv["rows"][0]["generation_tps"]:
            _line(ax, xs, [r["generation_tps"][name] for r in srv["rows"]], f"engine, {name}")
            if all(r["model_forward_tps"][name].get("median") for r in srv["rows"]):
                _line(
                    ax, xs, [r["model_forward_tps"][name] for r in srv["rows"]],
                    f"bare forward, {name}",
                )  # fmt: skip
        _style(
            ax, f"serving, {srv['dtype']} model", "concurrent streams",
            "generation tokens/s (all streams)",
        )  # fmt: skip
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "bench_serving.png", plt))
    return paths, None


def _style(ax, title: str, xlabel: str, ylabel: str) -> None:
    """Log-2 x axis, small labels, a legend."""
    ax.set_xscale("log", base=2)
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)


def _line(ax, xs, stats, name):
    med = [s["median"] for s in stats]
    lo = [s["median"] - s["min"] for s in stats]
    hi = [s["max"] - s["median"] for s in stats]
    ax.errorbar(xs, med, yerr=[lo, hi], marker="o", markersize=3, capsize=2, label=name)


def _save(fig, path: Path, plt) -> str:
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return str(path)

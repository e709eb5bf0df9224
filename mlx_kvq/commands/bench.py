"""`mlx-kvq bench`: attention, model, memory and serving benchmarks, quantized
against unquantized (see `mlx_kvq/bench/`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from .flags import add_setting_flag, kv_config, parse_size, setting_namespaces


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..bench.settings import MODELS, SECTIONS, BenchSettings

    d = BenchSettings()
    p = sub.add_parser("bench", help="speed and memory benchmark")
    p.add_argument(
        "--quick", action="store_true", help="tiny setting (seconds), every section: for tests"
    )
    p.add_argument("--out", default="bench-results", help="output folder (JSON, markdown, PNG)")
    p.add_argument(
        "--sections",
        type=_names,
        default=None,
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: all)",
    )
    p.add_argument("--dtypes", type=_names, default=None, help=f"default {','.join(d.dtypes)}")
    p.add_argument(
        "--bits", type=_ints, default=None, help="quantized settings to compare (default 8,4)"
    )
    p.add_argument("--kv-group-size", type=int, default=None, help="group size (default 64)")
    p.add_argument(
        "--model-size",
        choices=sorted(MODELS),
        default=None,
        help="benchmark model (default small: about 21M parameters)",
    )
    p.add_argument(
        "--model-config",
        default=None,
        help="config.json (or a JSON string) of an mlx-lm model to build with random weights",
    )
    p.add_argument(
        "--contexts", type=_ints, default=None, help="model contexts (default 1024,4096,16384)"
    )
    p.add_argument(
        "--attn-contexts",
        type=_ints,
        default=None,
        help="cached tokens for attention alone (default 1024,4096,16384,32768)",
    )
    p.add_argument(
        "--attn-queries", type=_ints, default=None, help="queries per call (default 1,128)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="samples per figure for decode and attention (default 5)",
    )
    p.add_argument("--prefill-repeats", type=int, default=None, help="default 3")
    p.add_argument(
        "--serving-repeats", type=int, default=None, help="rounds per stream count (default 3)"
    )
    p.add_argument("--prefill-chunk", type=int, default=None, help="default 128")
    p.add_argument(
        "--reference-blas-contexts",
        type=_ints,
        default=None,
        help="model contexts also measured on MLX's linked reference BLAS, float32, "
        "both arms, labelled (default 4096; an empty string for none)",
    )
    p.add_argument("--memory-context", type=int, default=None, help="default 16384")
    p.add_argument(
        "--memory-dtype", default=None, help="model dtype of the memory and serving sections"
    )
    p.add_argument(
        "--streams", type=_ints, default=None, help="concurrent streams (default 1,4,16)"
    )
    p.add_argument(
        "--mlx-lm-max-call-s",
        type=float,
        default=None,
        help="skip mlx-lm attention cells predicted to take longer per call (default 30)",
    )
    p.add_argument(
        "--budget-memory",
        type=parse_size,
        default=None,
        help="KV budget of the budget section, e.g. 64MiB (default: what 4 unquantized "
        "sequences need)",
    )
    p.add_argument(
        "--budget-requests", type=int, default=None, help="requests of the budget section (16)"
    )
    p.add_argument(
        "--budget-prompt", type=int, default=None, help="prompt tokens per request there (128)"
    )
    p.add_argument(
        "--budget-tokens", type=int, default=None, help="generated tokens per request there (128)"
    )
    add_setting_flag(
        p,
        "each measured in the model section beside --bits (decode and prefill against "
        "unquantized); without bits flags, the default setting of the benchmark model's layout",
    )
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--seed", type=int, default=None)  # fmt: skip
    p.set_defaults(run=run)


def settings_from_args(args: argparse.Namespace):
    """The `BenchSettings` the flags ask for (ValueError for an unknown section)."""
    from ..bench.settings import SECTIONS, BenchSettings, quick

    s = quick() if args.quick else BenchSettings()
    changes = {
        "sections": args.sections, "dtypes": args.dtypes, "bits": args.bits,
        "group_size": args.kv_group_size, "model": args.model_size, "contexts": args.contexts,
        "attn_contexts": args.attn_contexts, "attn_queries": args.attn_queries,
        "decode_repeats": args.repeats, "attn_repeats": args.repeats,
        "prefill_repeats": args.prefill_repeats, "prefill_chunk": args.prefill_chunk,
        "memory_context": args.memory_context, "memory_dtype": args.memory_dtype, "streams": args.streams,
        "mlx_lm_max_call_s": args.mlx_lm_max_call_s, "seed": args.seed,
        "serving_repeats": args.serving_repeats,
        "budget_memory": args.budget_memory, "budget_requests": args.budget_requests,
        "budget_prompt": args.budget_prompt, "budget_tokens": args.budget_tokens,
        "reference_blas_contexts": args.reference_blas_contexts,
    }  # fmt: skip
    s = replace(s, **{k: v for k, v in changes.items() if v is not None})
    if args.model_config:
        text = args.model_config
        cfg = (
            json.loads(text)
            if text.lstrip().startswith("{")
            else json.loads(Path(text).read_text())
        )
        s = replace(s, model_config=cfg)
    if args.setting:
        from ..plan import has_bounded_layers

        bounded = has_bounded_layers(s.resolved_model_config())
        spaces = setting_namespaces(args.setting, argparse.Namespace())
        s = replace(s, kv_settings=tuple(kv_config(ns, bounded) for ns in spaces))
    unknown = set(s.sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown bench sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.memory_dtype is None and s.memory_dtype not in s.dtypes:
        s = replace(s, memory_dtype=s.dtypes[0])
    return s


def run(args: argparse.Namespace) -> int:
    from ..bench.run import run as run_bench

    settings = settings_from_args(args)
    command = "mlx-kvq " + " ".join(args.argv)
    return run_bench(settings, Path(args.out), plots=not args.no_plots, command=command.strip())

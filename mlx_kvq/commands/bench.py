"""`mlx-kvq bench`: attention, model, memory and serving benchmarks, quantized
against unquantized (see `mlx_kvq/bench/`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from .flags import add_bench_flags, kv_config, setting_namespaces


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="speed and memory benchmark")
    add_bench_flags(p)
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
        "server_arms": args.server_arms, "server_streams": args.server_streams,
        "server_prompt": args.server_prompt, "server_tokens": args.server_tokens,
        "server_mixed": args.server_mixed, "server_long": args.server_long,
        "server_rounds": args.server_rounds, "server_text": args.server_text,
        "server_starts": args.server_starts,
        "agent_arms": args.agent_arms, "agent_sessions": args.agent_sessions,
        "agent_turns": args.agent_turns, "agent_system": args.agent_system,
        "agent_tool_chars": args.agent_tool_chars, "agent_tokens": args.agent_tokens,
        "agent_rewrite": args.agent_rewrite, "agent_api": args.agent_api,
        "agent_sources": args.agent_sources,
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
    if args.model:
        s = replace(s, server_model=_model_directory(args.model))
    if args.setting:
        from ..plan import has_bounded_layers

        bounded = has_bounded_layers(s.resolved_model_config())
        spaces = setting_namespaces(args.setting, argparse.Namespace())
        s = replace(s, kv_settings=tuple(kv_config(ns, bounded) for ns in spaces))
    unknown = set(s.sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown bench sections {sorted(unknown)}; choose from {SECTIONS}")
    for section in ("servers", "agents"):
        if section in s.sections and not s.server_model:
            raise ValueError(
                f"the {section} section runs both servers on a real model: pass --model"
            )
    if "agents" in s.sections:
        from ..bench.agents_bench import check_settings

        check_settings(s)
    if args.memory_dtype is None and s.memory_dtype not in s.dtypes:
        s = replace(s, memory_dtype=s.dtypes[0])
    return s


def _model_directory(model: str) -> str:
    """`--model` as a directory both servers load (a GGUF file converted once)."""
    from ..demo import resolve_model
    from .startup import model_directory

    location, _ = resolve_model(model)
    return model_directory(location, "--model")[0]


def run(args: argparse.Namespace) -> int:
    from ..bench.run import run as run_bench

    settings = settings_from_args(args)
    command = "mlx-kvq " + " ".join(args.argv)
    return run_bench(settings, Path(args.out), plots=not args.no_plots, command=command.strip())

"""`mlx-kvq bench` / `python -m mlx_kvq.bench`: arguments and the run."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

from .settings import MODELS, SECTIONS, BenchSettings, quick

SECTION_MODULES = {
    "attention": "attention_bench",
    "model": "model_bench",
    "memory": "memory_bench",
    "serving": "serving_bench",
}
SECTION_TITLES = {
    "attention": "attention alone",
    "model": "model",
    "memory": "memory",
    "serving": "serving",
}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_bench_args(p: argparse.ArgumentParser) -> None:
    d = BenchSettings()
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
    p.add_argument("--group-size", type=int, default=None, help="default 64")
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
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--seed", type=int, default=None)  # fmt: skip


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    s = quick() if args.quick else BenchSettings()
    changes = {
        "sections": args.sections, "dtypes": args.dtypes, "bits": args.bits,
        "group_size": args.group_size, "model": args.model_size, "contexts": args.contexts,
        "attn_contexts": args.attn_contexts, "attn_queries": args.attn_queries,
        "decode_repeats": args.repeats, "attn_repeats": args.repeats,
        "prefill_repeats": args.prefill_repeats, "prefill_chunk": args.prefill_chunk,
        "memory_context": args.memory_context, "memory_dtype": args.memory_dtype, "streams": args.streams,
        "mlx_lm_max_call_s": args.mlx_lm_max_call_s, "seed": args.seed,
        "serving_repeats": args.serving_repeats,
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
    unknown = set(s.sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown bench sections {sorted(unknown)}; choose from {SECTIONS}")
    if args.memory_dtype is None and s.memory_dtype not in s.dtypes:
        s = replace(s, memory_dtype=s.dtypes[0])
    return s


def environment() -> dict:
    import mlx.core as mx
    import mlx_lm

    from ..blas import blas_info
    from ..kernels import native_status

    return {
        "blas": blas_info().to_dict(),
        "blas_summary": blas_info().summary(),
        "native_kernels": native_status().summary(),
        "native_threads": os.environ.get("MLX_KVQ_NATIVE_THREADS", "one per core"),
        "load_average": _load(),
        "device": str(mx.default_device()),
        "metal_available": bool(mx.metal.is_available()),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def _load() -> list[float] | None:
    """1/5/15-minute load averages: how shared the machine was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_bench(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    argv = getattr(args, "argv", None)
    if argv is not None:  # python -m mlx_kvq.bench
        command = "python -m mlx_kvq.bench " + " ".join(argv)
    else:  # mlx-kvq bench
        command = "mlx-kvq " + " ".join(sys.argv[1:])
    return run(settings, Path(args.out), plots=not args.no_plots, command=command.strip())


def run(
    settings: BenchSettings, out: Path, plots: bool = True, command: str = "", log=print
) -> int:
    from .. import caches  # noqa: F401  (installs the attention redirect)
    from . import report

    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    log("mlx-kvq bench configuration:")
    log(json.dumps({"environment": env, "settings": settings.to_dict()}, indent=1, default=str))
    if env["device"].startswith("Device(cpu") or not env["metal_available"]:
        log("note: CPU backend. Apple-GPU (Metal) results cannot be produced on this machine.")
    t0 = time.perf_counter()
    result: dict = {
        "command": command,
        "environment": env,
        "settings": settings.to_dict(),
        "notes": [],
    }
    failed = []
    for name in SECTIONS:
        if name not in settings.sections:
            continue
        module = importlib.import_module(f"{__package__}.{SECTION_MODULES[name]}")
        log(f"{SECTION_TITLES[name]}:")
        try:
            result[name] = module.run(settings, log)
        except RuntimeError as e:  # the backend cannot run it (an MLX op, a dtype)
            failed.append(name)
            note = f"{name} section not run: {type(e).__name__}: {e}"
            result["notes"].append(note)
            log(f"  {note}")
    result["duration_s"] = time.perf_counter() - t0
    result["load_average_end"] = _load()
    result["goals"] = report.goals(result)
    if plots:
        paths, message = report.plots(result, out)
        result["plots"] = paths
        if message:
            result["notes"].append(message)
            log(message)
    report.write_json(result, out / "bench.json")
    (out / "bench.md").write_text(report.markdown(result) + "\n")
    for g in result["goals"]:
        met = {True: "met", False: "NOT MET", None: "n/a"}[g["met"]]
        val = "-" if g["value"] is None else f"{g['value']:.3f}"
        log(f"goal: {g['goal']}: {val} (target {g['target']}) {met}")
    log(f"wrote {out / 'bench.json'} and {out / 'bench.md'} in {result['duration_s']:.0f} s")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_kvq.bench", description=__doc__)
    add_bench_args(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return run_bench(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

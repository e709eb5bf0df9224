"""One benchmark run: the sections asked for, then the report files.

`mlx-kvq bench` (mlx_kvq/commands/bench.py) parses the flags into
`BenchSettings` and calls `run`.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import platform
import time
from pathlib import Path

from .settings import SECTIONS, BenchSettings
from .timing import load_average

SECTION_MODULES = {
    "attention": "attention_bench",
    "model": "model_bench",
    "memory": "memory_bench",
    "serving": "serving_bench",
    "budget": "budget_bench",
    "servers": "servers_bench",
    "agents": "agents_bench",
}
SECTION_TITLES = {
    "attention": "attention alone",
    "model": "model",
    "memory": "memory",
    "serving": "serving",
    "budget": "serving under a KV memory budget",
    "servers": "mlx-kvq serve against mlx_lm.server over HTTP",
    "agents": "coding-agent sessions against mlx_lm.server over HTTP",
}


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
        "load_average": load_average(),
        "device": str(mx.default_device()),
        "metal_available": bool(mx.metal.is_available()),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def run(
    settings: BenchSettings, out: Path, plots: bool = True, command: str = "", log=print
) -> int:
    from .. import attention
    from . import report

    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    log("mlx-kvq bench configuration:")
    log(json.dumps({"environment": env, "settings": settings.to_dict()}, indent=1, default=str))
    if attention.current_backend() is attention.Backend.CPU:
        log("note: CPU backend. GPU (Metal, CUDA) results cannot be produced on this machine.")
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
    result["load_average_end"] = load_average()
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
        target = f"at most {g['target']}" if g.get("at_most") else g["target"]
        log(f"goal: {g['goal']}: {val} (target {target}) {met}")
    log(f"wrote {out / 'bench.json'} and {out / 'bench.md'} in {result['duration_s']:.0f} s")
    return 1 if failed else 0

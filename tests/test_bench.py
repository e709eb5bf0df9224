"""The benchmark runs on its tiny setting (`--quick`) and writes well-formed
JSON and markdown. Timings are never asserted: only structure, and the
memory facts that do not depend on the machine."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from mlx_kvq.bench import cli, report
from mlx_kvq.bench.settings import SECTIONS, quick


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = cli.main(["--quick", "--out", str(out), "--no-plots"])
    assert rc == 0
    return out, json.loads((out / "bench.json").read_text())


def _stat_ok(d: dict) -> bool:
    if d.get("median") is None:
        return bool(d.get("skipped"))
    return (
        d["n"] >= 1
        and len(d["samples"]) == d["n"]
        and d["min"] <= d["median"] <= d["max"]
        and all(math.isfinite(x) and x > 0 for x in d["samples"])
    )


def test_json_has_every_section_and_configuration(quick_run):
    _, result = quick_run
    s = quick()
    assert result["settings"]["sections"] == list(SECTIONS)
    assert result["environment"]["mlx"] and result["environment"]["device"]
    assert result["command"].startswith("python -m mlx_kvq.bench")
    assert result["duration_s"] > 0

    att = result["attention"]
    assert len(att) == len(s.dtypes) * len(s.attn_contexts) * len(s.attn_queries)
    for row in att:
        assert set(row["seconds"]) == {"ours", "mlx_lm", "unquantized"}
        assert all(_stat_ok(v) for v in row["seconds"].values())
        # quantization error only: our output stays close to exact attention
        assert row["max_abs_error"]["ours"] < 0.5

    rows = result["model"]["rows"]
    assert [(r["dtype"], r["context"]) for r in rows] == [
        (d, c) for d in s.dtypes for c in s.contexts
    ]
    for r in rows:
        for what in ("decode_tps", "prefill_tps"):
            assert set(r[what]) == {"unquantized", "8-bit", "4-bit"}
            assert all(_stat_ok(v) for v in r[what].values())
        for what in ("decode_ratio", "prefill_ratio"):
            assert set(r[what]) == {"8-bit", "4-bit"}
            assert all(_stat_ok(v) for v in r[what].values())

    serving = result["serving"]
    assert [r["streams"] for r in serving["rows"]] == list(s.streams)
    for r in serving["rows"]:
        assert set(r["generation_tps"]) == {"unquantized", "4-bit"}
        assert all(_stat_ok(v) for v in r["generation_tps"].values())
        assert _stat_ok(r["generation_ratio"]["4-bit"])


def test_memory_matches_theory_per_held_slot(quick_run):
    """Machine-independent: quantized layers hold bits/8 + 4/group bytes per
    element of every allocated slot, and the windows stay bounded."""
    _, result = quick_run
    mem = result["memory"]
    gs = mem["group_size"]
    for entry in mem["contexts"]:
        for layer in entry["layers"]:
            if layer["quantized"]:
                assert layer["theory_bytes_per_element"] == entry["bits"] / 8 + 4 / gs
                assert abs(layer["deviation"]) <= 0.02
        sliding = entry["by_kind"].get("sliding")
        if sliding:
            window = result["model"]["config"]["sliding_window"]
            assert all(x["tokens"] <= window for x in entry["layers"] if x["kind"] == "sliding")
    four = [e for e in mem["contexts"] if e["bits"] == 4]
    unq = {e["context"]: e["kv_bytes"] for e in mem["contexts"] if e["bits"] is None}
    assert four and all(e["kv_bytes"] < unq[e["context"]] for e in four)
    assert {p["config"] for p in mem["peak"]} == {"unquantized", "8-bit", "4-bit"}
    for p in mem["peak"]:
        assert p["peak"] >= p["active_before"] > 0


def test_markdown_summary(quick_run):
    out, result = quick_run
    md = (out / "bench.md").read_text()
    for heading in ("# mlx-kvq benchmark", "## Goals", "## Attention alone", "## Model",
                    "## Memory", "## Serving"):  # fmt: skip
        assert heading in md
    assert "python -m mlx_kvq.bench" in md
    # every table row has as many cells as its header
    lines = md.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|---"):
            width = lines[i - 1].count("|")
            j = i + 1
            while j < len(lines) and lines[j].startswith("|"):
                assert lines[j].count("|") == width, lines[j]
                j += 1
    assert report.markdown(result) + "\n" == md


def test_goals_are_reported(quick_run):
    _, result = quick_run
    goals = result["goals"]
    assert goals
    for g in goals:
        assert set(g) >= {"goal", "value", "target", "met"}
        assert g["met"] in (True, False, None)


def test_plots_or_a_message(tmp_path, quick_run):
    _, result = quick_run
    paths, message = report.plots(result, tmp_path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert paths == [] and "matplotlib" in message
    else:
        assert message is None and len(paths) == 3
        for p in paths:
            assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_module_entry_point_and_bad_section(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_kvq.bench", "--quick", "--sections", "nope",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "unknown bench sections" in proc.stderr


def test_cli_subcommand_wiring():
    from mlx_kvq.cli import build_parser

    args = build_parser().parse_args(["bench", "--quick", "--sections", "memory"])
    assert args.func is cli.run_bench
    assert cli.settings_from_args(args).sections == ("memory",)

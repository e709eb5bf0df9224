"""The benchmark runs on its tiny setting (`--quick`) and writes well-formed
JSON and markdown. Timings are never asserted: only structure, and the
memory facts that do not depend on the machine."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from mlx_kvq.bench import report
from mlx_kvq.bench import run as bench_run
from mlx_kvq.bench.settings import DEFAULT_SECTIONS, quick
from mlx_kvq.commands import bench as bench_command
from mlx_kvq.commands import main


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = main(["bench", "--quick", "--out", str(out), "--no-plots"])
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
    assert result["settings"]["sections"] == list(DEFAULT_SECTIONS)
    assert result["environment"]["mlx"] and result["environment"]["device"]
    assert result["command"].startswith("mlx-kvq bench --quick")
    assert result["duration_s"] > 0

    att = result["attention"]
    assert len(att) == len(s.dtypes) * len(s.attn_contexts) * len(s.attn_queries)
    for row in att:
        assert set(row["seconds"]) == {"ours", "mlx_lm", "unquantized"}
        assert all(_stat_ok(v) for v in row["seconds"].values())
        # quantization error only: our output stays close to exact attention
        assert row["max_abs_error"]["ours"] < 0.5

    rows = result["model"]["rows"]
    # float32 ends with its labelled rows on MLX's linked reference BLAS
    assert [(r["dtype"], r["context"], r["reference_blas"]) for r in rows] == [
        (d, c, False) for d in s.dtypes for c in s.contexts
    ] + [("float32", c, True) for c in s.reference_blas_contexts]
    if sys.platform.startswith("linux"):
        assert result["environment"]["blas"]["kind"] == "OpenBLAS"
        assert {r["blas"] for r in rows if not r["reference_blas"]} == {"OpenBLAS"}
        assert {r["blas"] for r in rows if r["reference_blas"]} == {"reference BLAS"}
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
        for what in ("model_forward_tps", "scaling", "model_forward_scaling", "engine_efficiency"):
            assert set(r[what]) == {"unquantized", "4-bit"}
            assert all(_stat_ok(v) for v in r[what].values())
    first = serving["rows"][0]
    assert all(v["median"] == 1.0 for v in first["scaling"].values())
    names = [g["goal"] for g in result["goals"]]
    assert any(n.startswith("serving 4-bit: 2 streams vs 1") for n in names)
    assert len(names) == len(set(names))  # the reference-BLAS rows set no goal


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
    assert "mlx-kvq bench --quick" in md
    assert "- BLAS (both arms): " in md and "(both arms, for comparison)" in md
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
        assert message is None and len(paths) == 4
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
    from mlx_kvq.commands import build_parser

    args = build_parser().parse_args(["bench", "--quick", "--sections", "memory"])
    assert args.run is bench_command.run
    assert bench_command.settings_from_args(args).sections == ("memory",)


# -- the CPU fast paths of quantized attention that the benchmark measures -----
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("L", [1, 5, 40])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "per_head", "batched", "sinks"])
def test_attention_fast_paths_match_reference(monkeypatch, split, L, mask_kind):
    """Per-(sequence, KV head) split on sliced cache views, the dense
    dequantized-block products (several key blocks) and the quantized_matmul
    path all equal mx.fast attention on the dequantized K/V."""
    import mlx.core as mx
    import numpy as np
    from kvq_testing.helpers import dequantize_f32

    from mlx_kvq import attention
    from mlx_kvq.config import QuantSpec
    from mlx_kvq.quant import Store

    monkeypatch.setattr(attention, "_SPLIT_MIN_TOKENS", 0 if split else 1 << 30)
    monkeypatch.setattr(attention, "_key_block", lambda rows, tokens, dim: 64)  # several blocks
    rng = np.random.default_rng(L)
    B = 2 if mask_kind == "batched" else 1
    n_q, n_kv, D, S, buf = 8, 2, 64, 150, 256
    q = mx.array(rng.standard_normal((B, n_q, L, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((B, n_kv, buf, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, n_kv, buf, D)).astype(np.float32))
    # as caches hand them out: views of a longer buffer, strided across heads
    kq = Store.encode(k, QuantSpec(4)).fetch().map(lambda a: a[..., :S, :])
    vq = Store.encode(v, QuantSpec(8)).fetch().map(lambda a: a[..., :S, :])
    kd, vd = dequantize_f32(kq), dequantize_f32(vq)
    sinks = None
    causal = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    mask = {"none": None, "causal": "causal", "sinks": "causal"}.get(mask_kind)
    if mask_kind == "per_head":
        mask = mx.array(rng.random((1, n_q, L, S)) > 0.3) & causal
    elif mask_kind == "batched":
        left = mx.array([0, 37])
        mask = causal[None, None] & (mx.arange(S)[None, None, None] >= left[:, None, None, None])
    elif mask_kind == "sinks":
        sinks = mx.array(rng.standard_normal(n_q).astype(np.float32))
    ref = mx.fast.scaled_dot_product_attention(q, kd, vd, scale=0.125, mask=mask, sinks=sinks)
    out = attention.quantized_attention(q, kq, vq, 0.125, mask, sinks)
    assert out.shape == ref.shape
    assert mx.allclose(out, ref, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("blas", ["fast", "linked"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_attention_fast_paths_half_precision(monkeypatch, dtype, blas):
    """Half-precision models: prefill products run in float32 on a fast BLAS;
    on the reference BLAS bfloat16 models multiply in bfloat16 (MLX's own
    product, then the faster); all stay close to the float32 computation."""
    import contextlib

    import mlx.core as mx
    import numpy as np

    from mlx_kvq import attention
    from mlx_kvq.blas import use_linked_blas
    from mlx_kvq.config import QuantSpec
    from mlx_kvq.quant import Store

    monkeypatch.setattr(attention, "_SPLIT_MIN_TOKENS", 0)
    rng = np.random.default_rng(3)
    q = mx.array(rng.standard_normal((1, 8, 32, 64)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 200, 64)).astype(np.float32))
    kq = Store.encode(k, QuantSpec(4)).fetch()
    exact = attention.quantized_attention(q, kq, kq, 0.125, "causal")
    with use_linked_blas() if blas == "linked" else contextlib.nullcontext():
        if sys.platform.startswith("linux"):
            linked_bf16 = blas == "linked" and dtype == "bfloat16"
            want = mx.bfloat16 if linked_bf16 else mx.float32
            assert attention._dense_dtype(getattr(mx, dtype)) == want
        half = attention.quantized_attention(q.astype(getattr(mx, dtype)), kq, kq, 0.125, "causal")
    assert half.dtype == getattr(mx, dtype)
    assert mx.max(mx.abs(half.astype(mx.float32) - exact)).item() < 0.05


def test_a_section_the_backend_cannot_run_is_reported_not_fatal(tmp_path, monkeypatch):
    """A model dtype the backend cannot run is skipped with the reason; a
    failing section leaves a note, the others still write their results,
    and the exit status says something was not run."""
    from dataclasses import replace

    import mlx.core as mx

    from mlx_kvq.bench import memory_bench, model_bench

    real_build = model_bench.build_model

    def build(config, dtype, seed=0):
        model = real_build(config, dtype, seed)
        if dtype == mx.float16:

            def refuse(*args, **kwargs):
                raise RuntimeError("[Op::eval] not in float16 here")

            return refuse
        return model

    def memory_fails(settings, log=print):
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(model_bench, "build_model", build)
    monkeypatch.setattr(model_bench, "count_params", lambda model: 1)
    monkeypatch.setattr(memory_bench, "run", memory_fails)
    settings = replace(
        quick(), sections=("model", "memory"), contexts=(48,), reference_blas_contexts=()
    )
    rc = bench_run.run(settings, tmp_path, plots=False, log=lambda *a: None)
    assert rc == 1
    result = json.loads((tmp_path / "bench.json").read_text())
    model = result["model"]
    assert model["skipped"] == [{"dtype": "float16", "reason": "[Op::eval] not in float16 here"}]
    assert [r["dtype"] for r in model["rows"]] == ["float32"]
    assert "memory" not in result
    assert any("memory section not run" in n and "no kernel" in n for n in result["notes"])
    md = (tmp_path / "bench.md").read_text()
    assert "Not run in float16" in md and "memory section not run" in md


def test_budget_section_rows(quick_run):
    """One budget, every KV setting: the sequences admitted at once and tokens/s."""
    out, result = quick_run
    section = result["budget"]
    rows = {r["setting"]: r for r in section["rows"]}
    assert list(rows) == ["unquantized", "8-bit", "4-bit", "default"]
    for r in rows.values():
        # admitted by what they hold: at least the whole sequences that fit decode at once
        assert min(r["fits"], section["requests"]) <= r["at_once"] <= section["requests"]
        assert r["preemptions"] >= 0
        assert _stat_ok(r["tokens_per_s"]) and _stat_ok(r["decode_tokens_per_s"])
        assert r["overruns"] == 0 and 0 < r["peak_held"] <= section["budget"]
    assert rows["unquantized"]["fits"] == quick().budget_unquantized
    # 600-token sequences: past the default's exact sinks and tail (its 3x the
    # unquantized sequences at 1,000 tokens: test_budget.py)
    assert rows["default"]["fits"] >= 2 * rows["unquantized"]["fits"]
    assert "## Serving under a KV memory budget" in (out / "bench.md").read_text()

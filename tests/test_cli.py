"""`mlx-kvq plan` and `mlx-kvq generate` as a user runs them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from mlx_kvq.commands import build_parser, main


def _gemma4_config(tmp_path):
    # mlx-lm's gemma4_text defaults for the layer schedule (4 sliding : 1 full,
    # KV-shared tail), with full-size heads: planning reads config.json only.
    cfg = {"model_type": "gemma4_text", "num_hidden_layers": 35, "num_kv_shared_layers": 20,
           "sliding_window": 512, "vocab_size": 262144}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_plan_gemma4_schedule_every_kv_layer_quantized(tmp_path, capsys):
    path = _gemma4_config(tmp_path)
    assert not list(path.glob("*.safetensors"))
    assert (
        main(["plan", "--model", str(path), "--kv-bits", "4", "--context", "32768", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    kv = [layer for layer in out["layers"] if layer["kind"] in ("full", "sliding")]
    assert len(kv) == 15 and all(layer["quantized"] for layer in kv)
    assert out["quantized_layers"] == out["kv_layers"] == 15
    assert all(layer["window"] == 512 for layer in kv if layer["kind"] == "sliding")
    assert out["shared_layers"] == 20
    est = out["estimate"]
    assert est["bytes"] <= 0.29 * est["fp16_bytes"]

    assert main(["plan", "--model", str(path), "--kv-bits", "4"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("gemma4_text: 15/15 KV layers quantized")
    assert "sliding(512)" in table and "KV-shared" in table


def test_plan_says_which_default_a_model_gets(tmp_path, capsys):
    path = _gemma4_config(tmp_path)  # sliding layers: the bounded layout's default
    assert main(["plan", "--model", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["setting_origin"].startswith("DEFAULT_KV_CONFIG")
    assert main(["plan", "--model", str(path), "--kv-bits", "4"]) == 0
    assert "KV setting: K 4b/g64 V 4b/g64, as the bits flags ask" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kv-bits", "7"], "kv bits must be one of"),
        (["--kv-bits", "4", "--kv-group-size", "48"], "group size must be one of"),
        (["--kv-bits", "4", "--kv-skip-layers", "1"], "allow-partial-kv"),
    ],
)
def test_bad_settings_exit_2_before_weights(tmp_path, flags, message):
    path = _gemma4_config(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_kvq", "plan", "--model", str(path), *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert message in proc.stderr


def test_generate_prints_plan_and_kv_bytes(tmp_path):
    from kvq_testing.tiny import save_tiny_model

    path = save_tiny_model(tmp_path / "m", "gemma3_text")
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_kvq", "generate", "--model", str(path), "--prompt", "Hello",
         "--kv-bits", "4", "--max-tokens", "12"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "KV layers quantized" in lines[0]
    assert any(line.startswith("Generation: ") for line in lines)
    held = [line for line in lines if line.startswith("KV bytes held: ")]
    assert held and int(held[0].split()[3]) > 0
    blas = [line for line in lines if line.startswith("BLAS: ")]
    assert blas and ("OpenBLAS" in blas[0] or sys.platform != "linux"), lines
    assert any(line.startswith("Native kernels: ") for line in lines)


def test_serve_exits_2_naming_a_tokenizer_it_cannot_load(tmp_path):
    """`serve` loads the tokenizer beside the weights and the warm-up: a
    tokenizer that fails still stops the start with status 2 and its name."""
    from kvq_testing.tiny import save_tiny_model

    path = save_tiny_model(tmp_path / "m", "gemma3_text")
    (path / "tokenizer.json").write_text("{not json")
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_kvq", "serve", "--model", str(path), "--port", "0"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"could not load the tokenizer of {path}" in proc.stderr


def test_prompt_cache_file_with_quantized_windows(tmp_path):
    from kvq_testing.tiny import save_tiny_model

    from mlx_kvq.generate import load_prompt_cache

    path = save_tiny_model(tmp_path / "m", "gemma3_text")
    cache_file = tmp_path / "prefix.safetensors"
    prefix = "The quick brown fox jumps over the lazy dog while the server warms up."

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "mlx_kvq", *args, "--model", str(path)],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip

    made = run(
        "cache-prompt", "--prompt", prefix, "--prompt-cache-file", str(cache_file), "--kv-bits", "4"
    )
    assert made.returncode == 0, made.stderr
    cache = load_prompt_cache(str(cache_file))
    kinds = {type(c).__name__ for c in cache}
    assert kinds == {"KVQWindowCache", "KVQFullCache"}
    assert all(c.quantized for c in cache)
    window = next(c for c in cache if type(c).__name__ == "KVQWindowCache")
    assert window.offset > window.max_size  # the ring wrapped inside the prefix

    ok = run("generate", "--prompt", " And", "--prompt-cache-file", str(cache_file),
             "--kv-bits", "4", "--max-tokens", "5")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "Generation: " in ok.stdout

    mismatch = run("generate", "--prompt", " And", "--prompt-cache-file", str(cache_file),
                   "--kv-bits", "8", "--max-tokens", "5")  # fmt: skip
    assert mismatch.returncode == 2
    assert "layer 0 was stored as sliding K 4b/g64" in mismatch.stderr


def test_skipped_layers_hold_unquantized_bytes_through_generate(tmp_path):
    """`--kv-skip-layers` reaches the caches generate runs, not only the report: the
    skipped slots hold what unquantized slots hold, the others what quantized ones do;
    a prompt file made with the same flags is accepted by generate, and refused without."""
    from kvq_testing.tiny import save_tiny_model

    path = save_tiny_model(tmp_path / "m", "gemma3_text")
    skip = ["--allow-partial-kv", "--kv-skip-layers", "0,1"]

    def run(*args, rc=0):
        proc = subprocess.run(
            [sys.executable, "-m", "mlx_kvq", *args, "--model", str(path)],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert proc.returncode == rc, proc.stderr
        return proc

    def slots(*kv):
        out = run("generate", "--prompt", "Hello", "--max-tokens", "8", "--verbose", *kv).stdout
        rows = [line.split() for line in out.splitlines() if line.startswith("held slot ")]
        return [(r[3], r[4], int(r[5]), int(r[6])) for r in rows]  # kind, quantized, bytes, tokens

    every, partial, plain = (
        slots("--kv-bits", "4"),
        slots("--kv-bits", "4", *skip),
        slots("--kv-bits", "0"),
    )
    assert len(every) == len(partial) == len(plain) > 2
    for i, got in enumerate(partial):
        want = plain[i] if i in (0, 1) else every[i]
        assert got == want, (i, got, want)
    assert partial[0][1] == "unquantized" and partial[2][1] == "quantized"

    cache_file = tmp_path / "skip.safetensors"
    run("cache-prompt", "--prompt", "The quick brown fox", "--prompt-cache-file",
        str(cache_file), "--kv-bits", "4", *skip)  # fmt: skip
    follow = ["generate", "--prompt", " And", "--prompt-cache-file", str(cache_file),
              "--kv-bits", "4", "--max-tokens", "4"]  # fmt: skip
    assert "Generation: " in run(*follow, *skip).stdout
    assert "layer 0 is unquantized" in run(*follow, rc=2).stderr


def test_server_log_follows_the_current_stderr(monkeypatch):
    """Records go to `sys.stderr` as it is when they are emitted, not to the
    stream that was current when logging was set up (closed since)."""
    import io
    import logging

    from mlx_kvq.commands.serve import setup_logging

    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    setup_logging(argparse.Namespace(log_level="INFO"))
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("mlx_kvq.server").info("after the first stream closed")
    written = second.getvalue()
    assert "INFO mlx_kvq.server: after the first stream closed" in written
    assert "Logging error" not in written


def test_every_command_runs_on_the_fast_blas():
    """`import mlx_kvq` leaves MLX's BLAS alone; every subcommand, in a fresh
    process, runs with the fast one (each command's `run` is replaced by a
    probe of the binding)."""
    code = (
        "import json\n"
        "from mlx_kvq import blas, commands\n"
        "seen = {'import': blas.blas_info().fast}\n"
        "for c in commands.COMMANDS:\n"
        "    c.run = lambda args: seen.__setitem__(args.command, blas.blas_info().fast)\n"
        "for c in commands.COMMANDS:\n"
        "    name = c.__name__.rsplit('.', 1)[1].replace('_', '-')\n"
        "    extra = {'cache-prompt': ['-p', 'x', '--prompt-cache-file', 'f'], 'convert': ['m.gguf', 'out']}.get(name, [])\n"
        "    assert commands.main([name, *extra]) == 0\n"
        "print(json.dumps(seen))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MLX_KVQ_BLAS"}
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    names = {"serve", "generate", "plan", "cache-prompt", "eval", "bench", "convert"}
    assert set(seen) == names | {"import"}, seen
    imported = seen.pop("import")
    assert not (imported and sys.platform.startswith("linux")), "import mlx_kvq rebound the BLAS"
    assert all(seen.values()), seen


def test_every_flag_is_defined_in_flags_py_and_one_pipeline_starts_every_command():
    """Commands compose the definitions of `commands/flags.py` (none adds a flag
    of its own), and whether a command runs under `mlx.launch` is decided in
    `startup.Launch` alone (no command has a second startup path)."""
    import ast
    from pathlib import Path

    import mlx_kvq.commands

    folder = Path(mlx_kvq.commands.__file__).parent
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {n.attr if isinstance(n, ast.Attribute) else n.id
                 for n in ast.walk(tree) if isinstance(n, ast.Attribute | ast.Name)}  # fmt: skip
        defines = {"add_argument", "add_argument_group"} & names
        assert path.name == "flags.py" or not defines, f"{path.name} defines flags: {defines}"
        launch_checks = {"launched", "run_ranks"} & names
        assert path.name == "startup.py" or not launch_checks, (path.name, launch_checks)
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("serve", "generate"):
        flags = {o for a in sub.choices[name]._actions for o in a.option_strings}
        assert {"--temp", "--top-p", "--top-k", "--min-p", "--max-tokens", "--pipeline"} <= flags

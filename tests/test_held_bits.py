"""scripts/held_bits.py: bits per element priced from the bytes caches hold, at several contexts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import held_bits  # noqa: E402


def _table(capsys) -> dict[str, list[str]]:
    lines = capsys.readouterr().out.strip().splitlines()[2:]
    return {ln.split("`")[1]: [c.strip() for c in ln.split("|")[2:-1]] for ln in lines}


def test_per_token_bits_are_flat_and_the_split_layouts_fall_with_the_context(capsys):
    """4-bit per token in groups of 64 is 4 + 32/64 bits at any length; the
    split layout's 16-bit sinks and tail weigh less as the context grows."""
    split = (
        "--kv-bits 4 --kv-key-scales channel --kv-key-group-size 128 --kv-sinks 4 --kv-residual 128"
    )
    held_bits.main(["--model", "demo:full", "--context", "1024", "--context", "4096",
                    "--setting", "--kv-bits 4", "--setting", split])  # fmt: skip
    rows = _table(capsys)
    assert rows["K 4b/g64 V 4b/g64"] == ["4.50", "4.50"]
    at_1k, at_4k = map(float, rows["K 4b/c128 V 4b/g64, 4 sinks, last 128 exact"])
    assert 4.375 < at_4k < at_1k < 16


def test_a_report_adds_its_settings_with_their_worst_text(tmp_path, capsys):
    """Settings come from `mlx-kvq eval --json` reports (two texts, two
    windows), each row with the worse text's top-1 and KL; a decoded or
    one-window measurement is not a frontier row."""
    from mlx_kvq.config import KVConfig

    def setting(cfg: KVConfig, windows: int, decode: int = 0) -> dict:
        d = {**cfg.__dict__, "skip_layers": list(cfg.skip_layers)}
        texts = [{"windows": windows, "decode": decode, "top1": t, "kl_mean": k}
                 for t, k in ((0.97, 2e-3), (0.95, 1e-3))]  # fmt: skip
        return {"setting": cfg.describe(), "kv_config": d, "texts": texts}

    report = tmp_path / "run.json"
    report.write_text(json.dumps({"settings": [
        setting(KVConfig(bits=8), 2), setting(KVConfig(bits=3), 1), setting(KVConfig(bits=2), 2, 5),
    ]}))  # fmt: skip
    held_bits.main(["--model", "demo:full", "--context", "512", "--report", str(report)])
    rows = _table(capsys)
    assert rows == {"K 8b/g64 V 8b/g64": ["8.50", "95.00%", "2.0e-03"]}

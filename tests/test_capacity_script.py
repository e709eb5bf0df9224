"""scripts/capacity.py: the sequences a budget holds, as the engine prices them."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import capacity  # noqa: E402


def test_the_default_holds_more_long_sequences_than_unquantized_and_fewer_as_they_grow(capsys):
    capacity.main(["--model", "demo:full", "--budget", "4", "--context", "60", "--context", "1000",
                   "--context", "4000", "--setting", "", "--setting", "--kv-bits 0"])  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()[2:]
    rows = {ln.split("`")[1]: [int(c) for c in ln.split("|")[2:-1]] for ln in lines}
    default = next(v for k, v in rows.items() if k.startswith("K 5b/c128"))
    unquantized = rows["unquantized"]
    assert default[0] > default[1] > default[2] and unquantized[0] > unquantized[1]
    assert default[1] >= 2 * unquantized[1] and default[2] >= 1

"""`mlx-kvq bench --sections servers`: both servers start on one model, answer
the same prompts, and the report has every arm, scenario and ratio. Tiny
sizes on the demo model; timings are never asserted."""

from __future__ import annotations

import json

from mlx_kvq.bench import report
from mlx_kvq.commands import main


def test_servers_section_runs_both_servers_end_to_end(tmp_path):
    rc = main(
        ["bench", "--sections", "servers", "--model", "demo:gemma", "--server-arms", "default",
         "--server-streams", "1,2", "--server-prompt", "8", "--server-tokens", "3",
         "--server-mixed", "24,8,1", "--server-long", "16", "--server-rounds", "2",
         "--no-plots", "--out", str(tmp_path)]
    )  # fmt: skip
    assert rc == 0
    out = json.loads((tmp_path / "bench.json").read_text())["servers"]
    names = ["mlx_lm.server", "mlx-kvq default"]
    assert list(out["startup"]) == names
    for n in names:
        st = out["startup"][n]
        assert 0 < st["ready_s"] <= st["first_answer_s"]
        # timed alone, twice each (the default), every start's figures kept
        assert st["ready"]["n"] == st["first_answer"]["n"] == 2
        pairs = zip(st["ready"]["samples"], st["first_answer"]["samples"], strict=True)
        assert all(0 < r <= a for r, a in pairs)
        assert st["blas"]
    # both arms bound the same BLAS library
    assert (
        out["startup"][names[0]]["blas"]
        .split("(")[0]
        .strip()
        .startswith(out["startup"][names[1]]["blas"].split()[0])
    )
    assert [sc["scenario"] for sc in out["scenarios"]] == [
        "streams 1", "streams 2", "mixed 1x24 + 1x8"
    ]  # fmt: skip
    for sc in out["scenarios"]:
        assert sc["requests"] == len(sc["prompt_tokens"])
        for n in names:
            # every request answered with tokens, in both rounds
            assert sc["completion_tokens"][n] >= 2 * sc["requests"]
            assert sc["tokens_per_s"][n]["n"] == 2
        assert sc["ratio"][names[1]]["median"] > 0
    ttft = out["time_to_first_token"]
    assert ttft["prompt_tokens"] == 16
    assert set(ttft["cold"]["seconds"]) == set(names)
    assert out["same_text"][names[1]][names[0]]["of"] == 2 * (1 + 2 + 2)
    assert out["prompt_tokens_agree"]
    goals = [g["goal"] for g in report.goals({"servers": out})]
    assert any("streams 1" in g for g in goals) and any("ready" in g for g in goals)
    md = (tmp_path / "bench.md").read_text()
    assert "## mlx-kvq serve against mlx_lm.server" in md and "streams 2" in md


def test_a_prompt_past_the_models_context_is_refused_before_any_server_starts(tmp_path, capsys):
    rc = main(
        ["bench", "--sections", "servers", "--model", "demo:gemma", "--server-long", "10000000",
         "--no-plots", "--out", str(tmp_path)]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 2 and "--server-long" in captured.err
    assert "max_position_embeddings" in captured.err
    assert "starting" not in captured.out  # refused before any server


def test_no_timed_start_is_refused_before_any_server_starts(tmp_path, capsys):
    rc = main(
        ["bench", "--sections", "servers", "--model", "demo:gemma", "--server-starts", "0",
         "--server-long", "0", "--server-mixed", "0,0,0",
         "--no-plots", "--out", str(tmp_path)]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert rc == 2 and "--server-starts must be at least 1" in captured.err
    assert "alone" not in captured.out

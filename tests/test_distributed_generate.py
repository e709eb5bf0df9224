"""`mlx-kvq generate` on 2 ranks: `mlx.launch`, ring backend, loopback.

One launch runs four command lines in the same two processes (imports paid
once): tensor parallel on gpt_oss (sliding layers, sinks) and ministral3,
pipeline parallel on ministral3, and a run whose planning fails on rank 1.
Each greedy output must equal the single-process output with the same
quantized settings; each rank must hold half the KV bytes (tensor parallel)
or exactly the bytes of its own layers (pipeline parallel).
"""

from __future__ import annotations

import re

import pytest
from kvq_testing.distributed import (
    FAIL_PLAN,
    cli_runs,
    launcher,
    mlx_launch,
    split_runs,
    tiny_model,
)

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(launcher() is None, reason="mlx.launch is not installed"),
]

PROMPT = "Tell me a story about a robot"
MAX_TOKENS = 24
KV = ["--kv-bits", "4", "--kv-group-size", "64"]
RANK_LINE = re.compile(r"rank (\d+) \((\w+) parallel, layers ([\d-]+)\): KV bytes held: (\d+)")


def gen_args(model, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "-p", PROMPT, "--max-tokens", str(MAX_TOKENS),
            *KV, *extra]  # fmt: skip


def generated_text(output: str) -> str:
    """The text between the two '==========' lines of `mlx-kvq generate`."""
    parts = output.split("=" * 10)
    assert len(parts) >= 3, output
    return parts[1]


def single_process(model, capsys) -> tuple[str, list[int]]:
    """Single-process CLI output text, and KV bytes per cache slot for the same run."""
    from mlx_lm import load

    from mlx_kvq.caches import cache_report
    from mlx_kvq.commands import main
    from mlx_kvq.config import KVConfig
    from mlx_kvq.generate import stream_generate
    from mlx_kvq.plan import plan_kv

    capsys.readouterr()
    assert main(gen_args(model)) == 0
    out = capsys.readouterr().out
    held = int(re.search(r"KV bytes held: (\d+)", out).group(1))

    m, tok = load(str(model))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    cache = plan_kv(m, KVConfig(bits=4, group_size=64)).make_cache()
    for _ in stream_generate(m, tok, tok.encode(prompt), max_tokens=MAX_TOKENS, prompt_cache=cache):
        pass
    slots = [int(r["nbytes"]) for r in cache_report(cache)]
    assert sum(slots) == held  # the CLI ran the same thing
    return generated_text(out), slots


@pytest.fixture(scope="module")
def launched():
    gpt_oss, ministral3 = tiny_model("gpt_oss"), tiny_model("ministral3")
    result = mlx_launch(
        cli_runs(
            gen_args(gpt_oss),
            gen_args(ministral3),
            gen_args(ministral3, "--pipeline"),
            [FAIL_PLAN + "1", *gen_args(ministral3)],
        ),
        timeout=240,
    )
    runs = split_runs(result.stdout)
    assert len(runs) == 4, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return runs, result


def rank_bytes(output: str) -> dict[int, tuple[str, str, int]]:
    return {int(r): (mode, layers, int(b)) for r, mode, layers, b in RANK_LINE.findall(output)}


@pytest.mark.parametrize(
    "run, model_type, mode",
    [(0, "gpt_oss", "tensor"), (1, "ministral3", "tensor"), (2, "ministral3", "pipeline")],
)
def test_two_ranks_match_single_process(launched, capsys, run, model_type, mode):
    runs, result = launched
    rc, out = runs[run]
    assert rc == 0, f"{out}\n{result.stderr[-3000:]}"
    text, slots = single_process(tiny_model(model_type), capsys)
    assert generated_text(out) == text  # greedy, same quantized settings

    ranks = rank_bytes(out)
    assert sorted(ranks) == [0, 1], out
    total = sum(slots)
    for r, (got_mode, layers, held) in ranks.items():
        assert got_mode == mode
        if mode == "tensor":  # every layer, half the KV heads
            assert layers == f"0-{len(slots) - 1}"
            assert held == total // 2, (r, held, total)
        else:  # its own layers: rank 0 the last ones
            first, last = map(int, layers.split("-"))
            assert held == sum(slots[first : last + 1]), (r, layers, held, slots)
    assert sum(b for _, _, b in ranks.values()) == total
    assert "4/4 KV layers quantized" in out or "2/2 KV layers quantized" in out


def test_a_rank_that_cannot_honour_the_plan_stops_the_group(launched):
    runs, result = launched
    rc, out = runs[3]
    assert rc == 2  # rank 0 exits non-zero too, naming rank 1
    errors = [line for line in result.stderr.split("\n") if "mlx-kvq generate: error:" in line]
    for r in (0, 1):  # every rank stops with the failing rank's number and message
        mine = [line for line in errors if f"mlx-kvq generate: error: rank {r}: " in line]
        assert len(mine) == 1, result.stderr[-3000:]
        assert "cannot be honoured on rank 1 of 2" in mine[0] and "injected" in mine[0]
    # Each rank exits 2, unless mlx.launch, seeing the other exit first,
    # terminates it; at least one exit 2 is always seen.
    assert re.search(r"Node with rank [01] exited with code 2", result.stderr), result.stderr[
        -3000:
    ]
    for r in (0, 1):
        assert re.search(
            rf"Node with rank {r} (exited with code (2|-15)|was killed)", result.stderr
        )

"""`mlx-kvq generate` on 2 ranks: `mlx.launch`, ring backend, loopback.

One launch runs seven command lines in the same two processes (imports paid
once): tensor parallel on gpt_oss (sliding layers, sinks), on gpt_oss with a
single KV head (replicated on both ranks) and on ministral3, pipeline
parallel on ministral3; two runs refused before loading (`--pipeline` on a
model without pipelining; tensor parallel on a model with one KV head that
mlx-kvq does not replicate), and a run whose planning fails on rank 1.
Each greedy output must equal the single-process output with the same
quantized settings; each rank must hold half the KV bytes (tensor parallel),
all of them (replicated KV heads) or exactly the bytes of its own layers
(pipeline parallel).
"""

from __future__ import annotations

import re

import pytest
from kvq_testing.distributed import (
    FAIL_PLAN,
    REFUSED_EARLY,
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


ONE_KV_HEAD = {"num_key_value_heads": 1}
MODELS = {
    "gpt_oss": ("gpt_oss", {}),
    "gpt_oss, 1 KV head": ("gpt_oss", ONE_KV_HEAD),
    "ministral3": ("ministral3", {}),
    "minimax, 1 KV head": ("minimax", ONE_KV_HEAD),
}


def model_dir(name: str):
    model_type, overrides = MODELS[name]
    return tiny_model(model_type, **overrides)


@pytest.fixture(scope="module")
def launched():
    gpt_oss, ministral3 = model_dir("gpt_oss"), model_dir("ministral3")
    result = mlx_launch(
        cli_runs(
            gen_args(gpt_oss),
            gen_args(ministral3),
            gen_args(ministral3, "--pipeline"),
            gen_args(model_dir("gpt_oss, 1 KV head")),
            [REFUSED_EARLY, *gen_args(gpt_oss, "--pipeline")],
            [REFUSED_EARLY, *gen_args(model_dir("minimax, 1 KV head"))],
            [FAIL_PLAN + "1", *gen_args(ministral3)],
        ),
        timeout=300,
    )
    runs = split_runs(result.stdout)
    assert len(runs) == 7, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return runs, result


def rank_bytes(output: str) -> dict[int, tuple[str, str, int]]:
    return {int(r): (mode, layers, int(b)) for r, mode, layers, b in RANK_LINE.findall(output)}


@pytest.mark.parametrize(
    "run, name, mode",
    [
        (0, "gpt_oss", "tensor"),
        (1, "ministral3", "tensor"),
        (2, "ministral3", "pipeline"),
        (3, "gpt_oss, 1 KV head", "tensor"),
    ],
)
def test_two_ranks_match_single_process(launched, capsys, run, name, mode):
    runs, result = launched
    rc, out = runs[run]
    assert rc == 0, f"{out}\n{result.stderr[-3000:]}"
    text, slots = single_process(model_dir(name), capsys)
    assert generated_text(out) == text  # greedy, same quantized settings

    ranks = rank_bytes(out)
    assert sorted(ranks) == [0, 1], out
    total = sum(slots)
    replicated = MODELS[name][1] == ONE_KV_HEAD
    if replicated:  # the plan says so, and each rank's plan shows its one head
        assert "KV heads 1 per layer, 1 per rank over 2 ranks (each KV head replicated x2" in out
        assert out.count("1 KV heads per layer") == 2, out
    for r, (got_mode, layers, held) in ranks.items():
        assert got_mode == mode
        if mode == "tensor":  # every layer; half the KV heads, or all of one replicated head
            assert layers == f"0-{len(slots) - 1}"
            assert held == (total if replicated else total // 2), (r, held, total)
        else:  # its own layers: rank 0 the last ones
            first, last = map(int, layers.split("-"))
            assert held == sum(slots[first : last + 1]), (r, layers, held, slots)
    assert sum(b for _, _, b in ranks.values()) == (2 * total if replicated else total)
    assert "4/4 KV layers quantized" in out or "2/2 KV layers quantized" in out


def _errors(stderr: str, rank: int, marker: str) -> list[str]:
    return [
        line for line in stderr.split("\n")
        if line.startswith(f"mlx-kvq generate: error: rank {rank}: ") and marker in line
    ]  # fmt: skip


def test_pipeline_without_model_support_is_refused_before_loading(launched):
    runs, result = launched
    rc, out = runs[4]
    assert rc == 2 and "==========" not in out  # nothing generated, nothing loaded
    for r in (0, 1):
        (line,) = _errors(result.stderr, r, "--pipeline: gpt_oss")
        assert "has no pipeline()" in line and "drop --pipeline (tensor parallel)" in line


def test_too_few_kv_heads_without_replication_is_refused_before_loading(launched):
    runs, result = launched
    rc, out = runs[5]
    assert rc == 2 and "==========" not in out
    for r in (0, 1):
        (line,) = _errors(result.stderr, r, "minimax has 1 KV head(s) per layer")
        assert "tensor parallelism over 2 ranks cannot split" in line
        assert "replicates KV heads across ranks only for" in line and "gpt_oss" in line
        assert "Alternatives: " in line and "one machine" in line
    assert "could not load" not in result.stderr  # refused from config.json, no weights read


def test_a_rank_that_cannot_honour_the_plan_stops_the_group(launched):
    runs, result = launched
    rc, out = runs[6]
    assert rc == 2  # rank 0 exits non-zero too, naming rank 1
    for r in (0, 1):  # every rank stops with the failing rank's number and message
        mine = _errors(result.stderr, r, "cannot be honoured")
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

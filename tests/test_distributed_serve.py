"""`mlx-kvq serve` on 2 ranks over loopback (ring backend).

- Tensor parallel (gpt_oss: sliding layers, sinks) through `mlx.launch`: a
  chat completion from the official `openai` client equals the single-process
  engine's greedy output with the same quantized settings; `/health` waited
  for every rank's warm-up and reports per-rank KV bytes (half each), as does
  `/metrics`; Anthropic's `/v1/messages` and the Responses API give the
  same answer. Killing rank 1 then ends the whole group (mlx.launch's policy)
  in bounded time.
- Pipeline parallel (ministral3), one process per rank started with the
  variables mlx.launch sets: same equality and per-rank bytes (each rank the
  bytes of its own layers); killing rank 1 during a streaming request turns
  `/health` into 503 with the reason, ends the stream with an error and
  refuses new requests, all in bounded time.

No timings are asserted; every wait is bounded so that a hang fails.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from kvq_testing.distributed import LaunchedServer, RankGroup, launcher, tiny_model

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(launcher() is None, reason="mlx.launch is not installed"),
]

KV = ("--kv-bits", "4", "--kv-group-size", "64")
MESSAGES = [{"role": "user", "content": "Tell me a story about a robot"}]
MAX_TOKENS = 16
BOUND_S = 60.0  # the longest any single wait may take before the test fails


SEEDED = {"temperature": 0.9, "seed": 7}  # sampling, not greedy: the same draws on every rank


def reference(model_dir) -> tuple[str, str, dict]:
    """Single-process engine, same settings: greedy text, seeded-sampling text,
    and warm-up KV bytes by cache kind."""
    from mlx_lm import load

    from mlx_kvq.config import KVConfig
    from mlx_kvq.engine import Engine, EngineOptions, GenerationRequest, SamplingParams
    from mlx_kvq.engine.prompts import chat_tokens
    from mlx_kvq.engine.requests import ErrorEvent, FinishEvent, TokenEvent
    from mlx_kvq.plan import plan_kv

    model, tokenizer = load(str(model_dir))
    kv = KVConfig(bits=4, group_size=64)
    plan = plan_kv(model, kv, batch=True)
    engine = Engine(model, tokenizer, plan, kv, EngineOptions(max_context=plan.max_context))
    engine.start()
    try:
        assert engine.readiness.ready_event.wait(BOUND_S) and engine.readiness.ready
        prompt = chat_tokens(tokenizer, MESSAGES, {}, None)
        texts = []
        for params in ({}, SEEDED):
            events: queue.Queue = queue.Queue()
            request = GenerationRequest(prompt, SamplingParams(max_tokens=MAX_TOKENS, **params))
            engine.submit(request, events.put)
            text = []
            while True:
                ev = events.get(timeout=BOUND_S)
                if isinstance(ev, TokenEvent):
                    text.append(ev.text)
                elif isinstance(ev, FinishEvent):
                    break
                else:
                    assert not isinstance(ev, ErrorEvent), ev
            texts.append("".join(text))
        by_kind = {k: v["nbytes"] for k, v in engine.readiness.get().report["batch"].items()}
        return texts[0], texts[1], by_kind
    finally:
        engine.stop()


def chat(server, temperature: float = 0.0, seed: int | None = None) -> str:
    out = server.client().chat.completions.create(
        model="default_model", messages=MESSAGES, max_tokens=MAX_TOKENS,
        temperature=temperature, seed=seed,
    )  # fmt: skip
    return out.choices[0].message.content


def agent_answers(server) -> list[str]:
    """The greedy answer's text through /v1/messages and /v1/responses (the same engine)."""
    body = {"model": "any", "max_tokens": MAX_TOKENS, "messages": MESSAGES}
    m = httpx.post(server.url + "/v1/messages", json=body, timeout=BOUND_S).json()
    r = server.client().responses.create(model="any", input=MESSAGES[0]["content"],
                                         max_output_tokens=MAX_TOKENS, store=False)  # fmt: skip
    return ["".join(b["text"] for b in m["content"] if b["type"] == "text"), r.output_text]


def check_ranks(health: dict, ref_by_kind: dict, mode: str) -> None:
    """Per-rank warm-up bytes: half each (tensor), or the bytes of the rank's layers (pipeline)."""
    assert f"2 ranks ({mode} parallel)" in health["plan"]["summary"]
    ranks = health["warmup"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    total_slots = {
        k: sum(r["batch"][k]["slots"] for r in ranks if k in r["batch"]) for k in ref_by_kind
    }
    for r in ranks:
        assert r["mode"] == mode
        for kind, nbytes in ref_by_kind.items():
            got = r["batch"].get(kind, {"nbytes": 0, "slots": 0})
            if mode == "tensor":
                assert got["nbytes"] * 2 == nbytes, (r["rank"], kind, got, nbytes)
            else:
                assert got["nbytes"] * total_slots[kind] == nbytes * got["slots"], (r, kind, nbytes)
            assert got["quantized"] == got["slots"]
        assert r["kv_bytes"] == sum(k["nbytes"] for k in r["batch"].values())
    assert sum(r["kv_bytes"] for r in ranks) == sum(ref_by_kind.values())


def check_budget(health: dict, per_rank: int | None) -> None:
    """The group's KV budget: every rank's share, and what every rank holds."""
    budget = health["kv_budget"]
    assert budget["ranks"] == 2 and "per rank (2 ranks)" in budget["line"], budget
    assert budget["sequences"] >= 1
    if per_rank is not None:
        assert budget["budget"] == per_rank


def test_tensor_parallel_server_under_mlx_launch():
    model = tiny_model("gpt_oss")
    text, sampled, by_kind = reference(model)
    with LaunchedServer(model, *KV) as server:
        health = server.wait_ready(180).json()
        check_ranks(health, by_kind, "tensor")
        check_budget(health, None)
        assert chat(server) == text
        assert chat(server, **SEEDED) == sampled
        assert agent_answers(server) == [(text or "").lstrip()] * 2

        m = server.metrics()
        assert m["mlx_kvq_distributed_ranks"] == 2
        assert m['mlx_kvq_rank_up{rank="0"}'] == m['mlx_kvq_rank_up{rank="1"}'] == 1
        assert (
            m['mlx_kvq_rank_kv_bytes_per_token{rank="0"}'] * 2 == health["plan"]["bytes_per_token"]
        )
        assert (
            m['mlx_kvq_rank_kv_bytes_per_token{rank="1"}'] * 2 == health["plan"]["bytes_per_token"]
        )
        held = [m[f'mlx_kvq_rank_prompt_cache_bytes{{rank="{r}"}}'] for r in (0, 1)]
        assert held[0] == held[1] > 0  # the finished request's KV, half on each rank
        assert [m[f'mlx_kvq_rank_warmup_kv_bytes{{rank="{r}"}}'] for r in (0, 1)] == [
            sum(by_kind.values()) / 2
        ] * 2

        # mlx.launch stops every rank when one exits with an error: the group ends.
        pids = server.rank_pids()
        assert sorted(pids) == [0, 1], pids
        signal_rank(pids[1])
        server.proc.wait(BOUND_S)
        with pytest.raises(httpx.TransportError):
            httpx.get(server.url + "/health", timeout=5)


def signal_rank(pid: int) -> None:
    import os

    os.kill(pid, signal.SIGKILL)


def test_pipeline_parallel_server_and_a_dead_rank(tmp_path):
    model = tiny_model("ministral3")
    text, sampled, by_kind = reference(model)
    gate = tmp_path / "gate-{rank}"
    budget = ("--kv-cache-memory", "64MiB")  # each rank's share
    with RankGroup(model, *KV, *budget, "--pipeline", "--warmup-gate", str(gate)) as group:
        # Rank 1's warm-up is held back: rank 0 must not report ready.
        Path(str(gate).replace("{rank}", "0")).touch()
        assert group.wait_for("/health", 503, 180).json()["status"] == "warming_up"
        time.sleep(1.0)
        assert group.health().json()["status"] == "warming_up"
        Path(str(gate).replace("{rank}", "1")).touch()
        health = group.wait_ready(180).json()
        check_ranks(health, by_kind, "pipeline")
        check_budget(health, 64 << 20)
        assert chat(group) == text
        assert chat(group, **SEEDED) == sampled

        # A long streaming request, then rank 1 dies.
        outcome: dict = {}
        first_chunk = threading.Event()

        def stream() -> None:
            try:
                chunks = group.client().chat.completions.create(
                    model="default_model", messages=MESSAGES, max_tokens=400, temperature=0,
                    stream=True,
                )  # fmt: skip
                for chunk in chunks:
                    first_chunk.set()
                    if chunk.choices and chunk.choices[0].finish_reason:
                        outcome["finish"] = chunk.choices[0].finish_reason
                outcome.setdefault("finish", None)
            except Exception as e:  # noqa: BLE001 - the error is what we look at
                outcome["error"] = str(e)
            finally:
                first_chunk.set()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert first_chunk.wait(BOUND_S)
        group.kill(1)

        deadline = time.monotonic() + BOUND_S
        while True:
            r = group.health()
            if r.status_code == 503:
                break
            assert time.monotonic() < deadline, "health never turned 503"
            time.sleep(0.1)
        body = r.json()
        assert body["status"] == "failed" and "rank 1 of 2 is lost" in body["reason"], body

        t.join(BOUND_S)
        assert not t.is_alive(), "the in-flight request hangs; rank 0:\n" + group.log(0)[-4000:]
        if "error" in outcome:  # it was still generating when rank 1 died
            assert "rank 1 of 2 is lost" in outcome["error"]
        else:  # it had already finished: nothing was lost
            assert outcome["finish"] == "length"

        with pytest.raises(Exception) as refused:
            chat(group)
        assert "503" in str(refused.value) and "rank 1 of 2 is lost" in str(refused.value)
        m = group.metrics()
        assert m['mlx_kvq_rank_up{rank="1"}'] == 0 and m["mlx_kvq_ready"] == 0
        assert group.procs[0].poll() is None  # rank 0 stays up to say why

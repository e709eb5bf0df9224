"""A server under a small KV budget, flooded with more long requests than fit.

The requests arrive while the warm-up is held back, so the queue is full
and its depth known: one more gets 429 with Retry-After, one whose prompt
could never fit gets 400 at once naming the budget and what it needs, and
once the engine runs every queued request is served, never more of them at
once than the budget holds as they are (preempting when they grow past it),
with the bytes held (live sequences and prompt cache) never above the budget
after any step (counted inside the engine), paged and in padded rows.

Sixteen chat sessions sharing a system prompt much longer than the hybrid
model's windows, sent at once under a tight budget: the system prompt is
computed once and mapped by the others, many decode at once, every one
gets its whole answer, and the budget holds.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from kvq_testing.server import ServerProcess
from kvq_testing.sessions import Sessions, chat_bodies, send, shared_prefix
from kvq_testing.tiny import save_tiny_model
from mlx_lm import load

from mlx_kvq.defaults import DEFAULT_KV_CONFIG
from mlx_kvq.engine import EngineOptions
from mlx_kvq.engine.budget import Shape, format_bytes, share_for
from mlx_kvq.engine.runner import choose_layout
from mlx_kvq.plan import plan_kv

BUDGET = (
    1_200_000  # bytes: two of the requests below at the default KV setting, three as they start
)
QUEUE = 6
PROMPT, MAX_TOKENS = 40, 150
WAIT_S = 300
SHOWN = format_bytes(BUDGET)  # as the capacity line and the errors write it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(
        tmp_path_factory.mktemp("budget") / "m", "gemma3_text", sliding_window=32,
        max_position_embeddings=4096,
    )  # fmt: skip


def wait_for(predicate, what):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def completion(server, prompt, max_tokens, stream=False):
    body = {"model": "default_model", "prompt": prompt, "max_tokens": max_tokens}
    if not stream:
        return httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S)
    body["stream"] = True
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=WAIT_S) as r:
        r.read()
        return r


@pytest.mark.parametrize(
    ("block_size", "flags"),
    [(EngineOptions().block_size, ()), (None, ("--kv-block-size", "0"))],
    ids=["paged", "padded"],
)
def test_flood_under_a_small_budget(model_dir, tmp_path, block_size, flags):
    model, _ = load(str(model_dir))
    plan = plan_kv(model, DEFAULT_KV_CONFIG, batch=True)
    layout = choose_layout(plan, block_size)  # as the server lays it out
    cost = share_for(
        plan, BUDGET, prefill_step=2048, prompt_rows=8, paged=layout.paged,
        block_size=layout.block_size or 0,
    ).cost  # fmt: skip
    worst = cost.sequences(BUDGET, Shape(PROMPT, PROMPT + MAX_TOKENS))
    # what the budget holds as the sequences are when they start decoding
    fits = max(n for n in range(1, 64) if cost.bound([Shape(PROMPT, PROMPT + 1)] * n, []) <= BUDGET)
    assert 2 <= worst < QUEUE and worst < fits

    gate = tmp_path / "gate"
    args = ("--kv-cache-memory", str(BUDGET), "--max-queued-requests", str(QUEUE),
            "--warmup-gate", str(gate), *flags)  # fmt: skip
    with ServerProcess(model_dir, *args) as server:
        server.wait_for("/health", 503)
        assert f"KV budget {SHOWN}" in server.log()  # the capacity line, at startup

        answers: dict[int, httpx.Response] = {}

        def ask(i: int) -> None:
            prompt = [1 + (7 * i + j) % 300 for j in range(PROMPT)]
            answers[i] = completion(server, prompt, MAX_TOKENS, stream=i % 2 == 1)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(QUEUE)]
        for t in threads:
            t.start()
        wait_for(lambda: server.metrics()["mlx_kvq_queue_depth"] == QUEUE, "a full queue")

        full = completion(server, list(range(1, PROMPT + 1)), 10)
        assert full.status_code == 429, full.text
        assert full.headers["Retry-After"].isdigit()
        assert full.json()["error"]["code"] == "queue_full"
        assert "--max-queued-requests" in full.json()["error"]["message"]

        t0 = time.monotonic()
        huge = completion(server, [1 + j % 300 for j in range(2000)], 10)
        assert huge.status_code == 400, huge.text
        assert time.monotonic() - t0 < 30  # answered while the queue waits
        error = huge.json()["error"]
        assert error["code"] == "kv_budget_exceeded"
        for words in ("prompt needs", f"KV budget of {SHOWN}", "--kv-cache-memory",
                      "shorten the prompt"):  # fmt: skip
            assert words in error["message"], error["message"]

        def budget_status():
            return httpx.get(server.url + "/status", timeout=10).json()["budget"]

        waiting = budget_status()  # what the page shows while the queue waits
        assert (waiting["admitted"], waiting["waiting"]) == (0, QUEUE)

        gate.touch()
        admitted = []  # sequences admitted, as the page sees them while the flood runs
        while any(t.is_alive() for t in threads):
            admitted.append(budget_status()["admitted"])
            time.sleep(0.05)
        for t in threads:
            t.join(WAIT_S)
        assert 2 <= max(admitted) <= fits, admitted
        assert sorted(answers) == list(range(QUEUE))
        for i, r in answers.items():
            assert r.status_code == 200, (i, r.text)
            if i % 2 == 0:
                assert r.json()["usage"]["prompt_tokens"] == PROMPT
            else:
                assert r.text.rstrip().endswith("data: [DONE]")

        m = wait_for(
            lambda: (m := server.metrics())["mlx_kvq_batch_size"] == 0 and m, "an idle engine"
        )
        print(f"{QUEUE} requests under {BUDGET} bytes: {m['mlx_kvq_batch_size_max']:.0f} at once")
        assert m['mlx_kvq_requests_total{status="ok"}'] == QUEUE
        assert m['mlx_kvq_rejections_total{reason="queue_full"}'] == 1
        assert m['mlx_kvq_rejections_total{reason="kv_budget"}'] == 1
        assert m["mlx_kvq_kv_cache_memory_bytes"] == BUDGET
        assert m["mlx_kvq_kv_budget_overruns_total"] == 0
        assert 0 < m["mlx_kvq_kv_bytes_held_max"] <= BUDGET
        assert 2 <= m["mlx_kvq_batch_size_max"] <= fits
        assert m["mlx_kvq_kv_bytes_reserved"] == 0 and m["mlx_kvq_kv_bytes_live"] == 0
        assert m["mlx_kvq_kv_sequences_admitted"] == 0
        assert m["mlx_kvq_preempted"] == 0
        assert 0 <= m["mlx_kvq_resumptions_total"] <= m["mlx_kvq_preemptions_total"]

        health = server.health().json()["kv_budget"]
        assert health["budget"] == BUDGET and health["tokens"] == 4096  # the model's context
        assert health["sequences"] == cost.sequences(BUDGET, Shape(4095, 4096))
        unquantized = cost.unquantized().sequences(BUDGET, Shape(4095, 4096))
        assert health["sequences_unquantized"] == unquantized
        assert health["line"].startswith(f"KV budget {SHOWN}: ")
        status = httpx.get(server.url + "/status", timeout=10).json()["budget"]
        assert status["bytes"] == BUDGET and status["capacity"] == health["line"]
        assert status["reserved"] == status["live"] == status["admitted"] == status["waiting"] == 0


SESSIONS = Sessions(system_tokens=600, own_words=10, answer=64, window=64, kv_heads=1)


def test_sessions_sharing_a_system_prompt_sent_at_once(tmp_path):
    """Sixteen streaming chats with max_tokens 32000 sent at once to a hybrid
    model (2 sliding-window layers of 64 tokens, 2 full-attention layers), one
    system message of ~600 tokens and their own user message, under 1.5x what
    one whole session holds plus what the other fifteen hold of their own, as
    the budget prices them: 16 of 16 get the whole answer, no overrun, at most
    the budget held, at least 14 decoding at once, and the prompt tokens
    computed at most 1.2x the shared prefix and every session's own tokens.
    (scripts/sessions_http.py runs it at any size.)"""
    path = SESSIONS.save_model(tmp_path / "m")
    model, tokenizer = load(str(path))
    plan = plan_kv(model, DEFAULT_KV_CONFIG, batch=True)
    options = EngineOptions()
    layout = choose_layout(plan, options.block_size)  # as the server lays it out
    cost = share_for(
        plan, 1, prefill_step=options.prefill_step_size, prompt_rows=options.prompt_concurrency,
        paged=layout.paged, block_size=layout.block_size or 0,
    ).cost  # fmt: skip
    conversations = SESSIONS.conversations()
    prompts = SESSIONS.prompts(tokenizer, conversations)
    shared = shared_prefix(prompts)
    assert shared > 8 * SESSIONS.window
    budget = SESSIONS.priced_budget(cost, prompts)
    with ServerProcess(path, "--kv-cache-memory", str(budget)) as server:
        server.wait_ready()
        outcome = send(server, chat_bodies(SESSIONS, conversations), SESSIONS.answer_text)
    assert outcome.served == 16, outcome.errors
    assert outcome.overruns == 0 and 0 < outcome.held_max <= budget == outcome.budget
    assert outcome.decoding_at_once >= 14, outcome
    own = sum(len(p) - shared for p in prompts)
    assert outcome.prompt_tokens <= 1.2 * (shared + own), outcome
    assert outcome.cached_tokens >= 15 * (shared - SESSIONS.window), outcome

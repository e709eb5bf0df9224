"""Continuous batching through the real server: many clients, and clients that leave.

16 concurrent streaming clients on a tiny hybrid model (quantized sliding
and full layers) all complete with correct usage while the engine decodes
at least 8 of them together; a client that disconnects mid-stream has its
sequence removed and its cache released, and the server keeps serving.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from kvq_testing.server import ServerProcess
from kvq_testing.tiny import save_tiny_model
from mlx_lm.utils import load_tokenizer

CLIENTS = 16
MAX_TOKENS = 32
WAIT_S = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("conc") / "tiny-hybrid", "gemma3_text")


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, "--decode-concurrency", "32", "--prompt-concurrency", "8") as s:
        s.wait_ready()
        yield s


def wait_metrics(server, predicate, what):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        m = server.metrics()
        if predicate(m):
            return m
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}: {server.metrics()}")


def test_sixteen_streaming_clients_are_batched(server, model_dir):
    tokenizer = load_tokenizer(model_dir)
    client = server.client()
    start = threading.Barrier(CLIENTS)
    results, errors = {}, []

    def run(i):
        messages = [{"role": "user", "content": f"Client {i}: tell me a story about stars."}]
        try:
            start.wait(WAIT_S)
            text, counted, usage, reason = "", 0, None, None
            for chunk in client.chat.completions.create(
                model="default_model", messages=messages, max_tokens=MAX_TOKENS, stream=True,
                stream_options={"include_usage": True}, logprobs=True,
            ):  # fmt: skip
                usage = chunk.usage or usage
                for c in chunk.choices:
                    text += c.delta.content or ""
                    counted += len(c.logprobs.content) if c.logprobs and c.logprobs.content else 0
                    reason = c.finish_reason or reason
            expected_prompt = len(
                tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            )
            results[i] = (usage, counted, reason, expected_prompt)
        except Exception as e:  # reported below with the client number
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not errors, errors
    assert len(results) == CLIENTS
    for usage, counted, reason, expected_prompt in results.values():
        assert usage.prompt_tokens == expected_prompt
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        if reason == "length":
            assert usage.completion_tokens == counted == MAX_TOKENS
        else:
            assert reason == "stop" and usage.completion_tokens == counted + 1

    m = wait_metrics(server, lambda m: m["mlx_kvq_batch_size"] == 0, "an idle batch")
    assert m["mlx_kvq_batch_size_max"] >= 8
    print(f"16 clients: largest batch decoded together {m['mlx_kvq_batch_size_max']:.0f}")
    assert m["mlx_kvq_kv_bytes_live"] == 0
    assert m["mlx_kvq_generation_tokens_total"] >= CLIENTS
    assert m['mlx_kvq_requests_total{status="ok"}'] >= CLIENTS


def stream_lines(server, body):
    return httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=WAIT_S)


def test_client_disconnect_mid_stream_releases_its_sequence(server):
    before = server.metrics()
    cancelled0 = before['mlx_kvq_requests_total{status="cancelled"}']
    long_body = {"messages": [{"role": "user", "content": "Never stop talking."}],
                 "max_tokens": 400, "stream": True}  # fmt: skip

    # B stays connected and reads to the end; A goes away after two chunks.
    b_done, b_result = threading.Event(), {}

    def run_b():
        with stream_lines(server, {**long_body, "max_tokens": 200}) as r:
            b_result["lines"] = [line for line in r.iter_lines() if line]
        b_done.set()

    with stream_lines(server, long_body) as a:
        lines = a.iter_lines()
        assert next(lines).startswith("data: ")
        b = threading.Thread(target=run_b)
        b.start()
        for line in lines:
            if line.startswith("data: ") and '"content"' in line:
                break
    # A's connection is closed here, mid-stream.

    # The cancel is counted when it is taken; the batch gauge follows at the next step.
    wait_metrics(
        server,
        lambda m: (
            m['mlx_kvq_requests_total{status="cancelled"}'] == cancelled0 + 1
            and m["mlx_kvq_batch_size"] <= 1
        ),  # only B (if still running) is decoded
        "the disconnected stream to be cancelled and leave the batch",
    )

    r = server.client().chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": "still there?"}],
        max_tokens=4,
    )  # fmt: skip
    assert r.usage.completion_tokens > 0
    b.join(WAIT_S)
    assert b_done.is_set() and b_result["lines"][-1] == "data: [DONE]"

    m = wait_metrics(server, lambda m: m["mlx_kvq_batch_size"] == 0, "an idle batch")
    assert m["mlx_kvq_kv_bytes_live"] == 0
    assert m["mlx_kvq_queue_depth"] == 0
    assert m['mlx_kvq_requests_total{status="cancelled"}'] == cancelled0 + 1


def test_non_streaming_client_disconnect_is_cancelled(server):
    m0 = server.metrics()
    ended0 = (
        m0['mlx_kvq_requests_total{status="cancelled"}'] + m0['mlx_kvq_requests_total{status="ok"}']
    )
    body = json.dumps({"messages": [{"role": "user", "content": "A long answer please."}],
                       "max_tokens": 480}).encode()  # fmt: skip
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_metrics(server, lambda m: m["mlx_kvq_batch_size"] >= 1 or m["mlx_kvq_steps_total"]
                 > m0["mlx_kvq_steps_total"] + 5, "the request to be decoded")  # fmt: skip
    sock.close()  # the client goes away without reading the answer
    # Cancelled once the server notices (or finished first, on a fast machine).
    m = wait_metrics(
        server,
        lambda m: (
            m['mlx_kvq_requests_total{status="cancelled"}']
            + m['mlx_kvq_requests_total{status="ok"}']
            == ended0 + 1
            and m["mlx_kvq_batch_size"] == 0
        ),
        "the abandoned request to end",
    )
    assert m["mlx_kvq_kv_bytes_live"] == 0

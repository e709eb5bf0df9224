"""No request can take the server down.

Each request that used to kill the engine thread, hang, or get a 500 now gets
its answer (200 where it is valid, otherwise a 400 naming the field), and the
same server then answers a normal request correctly. Then: a non-streaming
client that leaves is noticed and its request cancelled; a random-body fuzz
run finds no 5xx; SIGTERM drains in-flight requests and exits 0.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvq_testing.server import ServerProcess
from kvq_testing.tiny import save_tiny_model

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
WAIT_S = 60  # bounds waits so a broken server fails the test instead of hanging it


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # A long context: a request for 100,000 tokens must still be generating when
    # its client leaves (at 512 positions it ends within the client's timeout).
    return save_tiny_model(
        tmp_path_factory.mktemp("reliability") / "m",
        "llama:sliding",
        max_position_embeddings=1 << 20,
    )


@pytest.fixture(scope="module")
def server(model):
    with ServerProcess(model) as s:
        s.wait_ready()
        yield s


def post(server, path, body=None, raw=None, timeout=WAIT_S):
    content = raw if raw is not None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=timeout)


def assert_400(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param, err


def assert_still_serving(server, reference=None):
    r = post(server, COMPLETIONS, {"prompt": "The quick brown fox", "max_tokens": 6})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
    if reference is not None:
        assert r.json()["choices"][0]["text"] == reference
    h = server.health()
    assert h.status_code == 200 and h.json()["status"] == "ok", h.text


@pytest.fixture(scope="module")
def reference(server):
    r = post(server, COMPLETIONS, {"prompt": "The quick brown fox", "max_tokens": 6})
    return r.json()["choices"][0]["text"]


def sample(server, **fields):
    body = {"prompt": "Hi", "max_tokens": 6, "temperature": 0.9, **fields}
    return post(server, COMPLETIONS, body)


def test_seed_minus_one_is_unseeded_and_any_64_bit_seed_is_taken(server, reference):
    assert sample(server, seed=-1).status_code == 200
    for seed in (0, 2**63 - 1, 2**64 - 1, -(2**63)):
        r = sample(server, seed=seed)
        assert r.status_code == 200, (seed, r.text)
    # A negative seed is the unsigned seed with the same 64 bits.
    same = [sample(server, seed=s).json()["choices"][0]["text"] for s in (-2, 2**64 - 2)]
    assert same[0] == same[1]
    for seed in (2**64, -(2**63) - 1):
        assert_400(sample(server, seed=seed), "seed")
    assert_still_serving(server, reference)


def test_top_k_at_or_above_the_vocabulary_keeps_every_token(server, reference):
    wide = sample(server, top_k=4096, seed=5)
    assert wide.status_code == 200, wide.text
    plain = sample(server, top_k=0, seed=5)
    assert wide.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert sample(server, top_k=4096).status_code == 200  # unseeded: a shared sampler
    assert_400(sample(server, top_k=2**64), "top_k")
    assert_still_serving(server, reference)


@pytest.mark.parametrize(
    "kwargs",
    [{"return_tensors": "np"}, {"return_tensors": "mlx"}, {"tokenize": False},
     {"return_dict": True}, {"add_generation_prompt": False}],
    ids=lambda k: next(iter(k)),
)  # fmt: skip
def test_template_kwargs_that_change_what_rendering_returns_are_refused(server, reference, kwargs):
    body = {"messages": HI, "max_tokens": 3, "chat_template_kwargs": kwargs}
    assert_400(post(server, CHAT, body), "chat_template_kwargs")
    assert_still_serving(server, reference)


def test_harmless_template_kwargs_still_work(server):
    body = {"messages": HI, "max_tokens": 3, "chat_template_kwargs": {"enable_thinking": False}}
    assert post(server, CHAT, body).status_code == 200


def test_absurd_json_gets_400(server, reference):
    assert_400(post(server, CHAT, raw=b"[" * 100_000), None)
    deep: dict = {"x": 1}
    for _ in range(100):
        deep = {"x": deep}
    assert_400(post(server, CHAT, {"messages": HI, "chat_template_kwargs": deep}),
               "chat_template_kwargs")  # fmt: skip
    digits = "9" * 5001
    for field in ("max_tokens", "seed"):
        raw = f'{{"prompt": "Hi", "{field}": {digits}}}'.encode()
        assert_400(post(server, COMPLETIONS, raw=raw), None)
    assert_still_serving(server, reference)


@pytest.mark.parametrize("where", ["model", "prompt", "stop", "messages", "key"])
def test_lone_surrogates_get_400_naming_the_field(server, reference, where):
    bad = '"a\\ud800b"'
    raw = {
        "model": f'{{"model": {bad}, "prompt": "Hi", "max_tokens": 2}}',
        "prompt": f'{{"prompt": {bad}, "max_tokens": 2}}',
        "stop": f'{{"prompt": "Hi", "stop": [{bad}], "max_tokens": 2}}',
        "messages": f'{{"messages": [{{"role": "user", "content": {bad}}}], "max_tokens": 2}}',
        "key": f'{{"prompt": "Hi", "metadata": {{{bad}: 1}}, "max_tokens": 2}}',
    }[where]
    path = CHAT if where == "messages" else COMPLETIONS
    param = "metadata" if where == "key" else where
    r = post(server, path, raw=raw.encode())
    assert_400(r, param)
    assert "surrogate" in r.json()["error"]["message"]
    assert_still_serving(server, reference)


def test_stream_options_need_stream(server):
    body = {"prompt": "Hi", "max_tokens": 2, "stream_options": {"include_usage": True}}
    assert_400(post(server, COMPLETIONS, body), "stream_options")
    assert post(server, COMPLETIONS, {**body, "stream": True}).status_code == 200


def test_a_non_streaming_client_that_leaves_is_cancelled(server, model):
    """The request is cancelled while its tokens are flowing, and its memory freed."""
    before = server.metrics().get('mlx_kvq_requests_total{status="cancelled"}', 0)
    eos = json.loads((model / "config.json").read_text())["eos_token_id"]
    body = {"prompt": "Tell me a long story", "max_tokens": 100_000, "temperature": 0,
            "logit_bias": {str(eos): -100}}  # fmt: skip
    try:
        r = post(server, COMPLETIONS, body, timeout=2.0)  # the client gives up and leaves
    except httpx.ReadTimeout:
        pass
    else:
        pytest.fail(f"answered before the client left: {r.status_code} {r.text[:300]}")
    deadline = time.monotonic() + WAIT_S
    while server.metrics().get('mlx_kvq_requests_total{status="cancelled"}', 0) == before:
        assert time.monotonic() < deadline, "the request was never cancelled"
        time.sleep(0.1)
    while server.metrics().get("mlx_kvq_batch_size", 0) > 0:
        assert time.monotonic() < deadline, "the cancelled sequence stayed in the batch"
        time.sleep(0.1)
    assert sum(v for k, v in server.metrics().items() if k.startswith("mlx_kvq_kv_bytes{")) == 0


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "seed", "stop", "stream", "stream_options", "n", "logprobs",
          "top_logprobs", "tools", "chat_template_kwargs", "echo", "user"]  # fmt: skip
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "bot"]),
     "content": st.one_of(st.text(max_size=30), JSON_VALUES)},
)  # fmt: skip
BODIES = st.dictionaries(
    st.sampled_from(FIELDS),
    JSON_VALUES | st.lists(MESSAGE, min_size=1, max_size=3) | st.integers(-(2**70), 2**70),
    max_size=8,
)


# MLX_KVQ_FUZZ_EXAMPLES=3000 runs the long version; MLX_KVQ_FUZZ_REPORT=FILE
# writes the count of answers by status there (docs/reliability.md).
FUZZ_EXAMPLES = int(os.environ.get("MLX_KVQ_FUZZ_EXAMPLES", "60"))
FUZZ_STATUSES: collections.Counter = collections.Counter()


def bounded(body: dict) -> dict:
    """Keep the fuzz run quick: valid token limits become small ones."""
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int) and not isinstance(body[field], bool):
            if body[field] > 4:
                body[field] = 4
    body.setdefault("max_tokens", 2)
    return body


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, chat=st.booleans())
def test_fuzzed_bodies_never_get_a_server_error(server, body, chat):
    body = bounded(body)
    if chat and "messages" not in body:
        body["messages"] = HI
    if not chat and "prompt" not in body:
        body["prompt"] = "Hi"
    r = post(server, CHAT if chat else COMPLETIONS, body)
    FUZZ_STATUSES[f"{'chat' if chat else 'completions'} {r.status_code}"] += 1
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, r.text
    assert server.proc.poll() is None


def test_fuzzing_left_the_engine_alive(server, reference):
    assert_still_serving(server, reference)
    assert server.metrics().get('mlx_kvq_requests_total{status="error"}', 0) == 0
    if os.environ.get("MLX_KVQ_FUZZ_REPORT"):
        with open(os.environ["MLX_KVQ_FUZZ_REPORT"], "w") as f:
            json.dump(dict(sorted(FUZZ_STATUSES.items())), f, indent=1)


def stream_until_done(server, body, out: dict) -> None:
    """Read an SSE response to its end; record the last finish reason or error."""
    try:
        with httpx.stream("POST", server.url + COMPLETIONS, json={**body, "stream": True},
                          timeout=WAIT_S) as r:  # fmt: skip
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    out["error"] = data["error"]["message"]
                for choice in data.get("choices", []):
                    if choice.get("finish_reason"):
                        out["finish"] = choice["finish_reason"]
                        out["tokens"] = out.get("tokens", 0)
                    if choice.get("text"):
                        out["tokens"] = out.get("tokens", 0) + 1
    except httpx.HTTPError as e:
        out["transport_error"] = repr(e)


def start_stream(server, max_tokens: int) -> tuple[threading.Thread, dict]:
    out: dict = {}
    body = {"prompt": "Tell me a story", "max_tokens": max_tokens, "temperature": 0}
    t = threading.Thread(target=stream_until_done, args=(server, body, out), daemon=True)
    t.start()
    deadline = time.monotonic() + WAIT_S
    while server.metrics().get("mlx_kvq_batch_size", 0) == 0:
        assert time.monotonic() < deadline, "the stream never started decoding"
        time.sleep(0.02)
    return t, out


def test_sigterm_lets_in_flight_requests_finish_and_exits_0(model):
    with ServerProcess(model, "--shutdown-timeout", "60") as s:
        s.wait_ready()
        t, out = start_stream(s, max_tokens=300)
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + WAIT_S
        refused = None
        while refused is None and time.monotonic() < deadline:
            try:
                r = post(s, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2}, timeout=5)
            except httpx.TransportError:
                break  # the listener closed: the drain already ended
            if r.status_code == 503:
                refused = r
        assert refused is not None, "no request was refused while draining"
        assert refused.headers.get("retry-after")
        assert refused.json()["error"]["code"] == "shutting_down"
        health = s.health()
        assert health.status_code == 503 and health.json()["status"] == "shutting_down"
        t.join(WAIT_S)
        assert out.get("finish") == "length", out
        assert s.proc.wait(WAIT_S) == 0, s.log()[-3000:]


def test_the_shutdown_timeout_answers_what_is_left_and_exits_0(model):
    with ServerProcess(model, "--shutdown-timeout", "0.5") as s:
        s.wait_ready()
        t, out = start_stream(s, max_tokens=100_000)
        s.proc.send_signal(signal.SIGTERM)
        t.join(WAIT_S)
        assert not t.is_alive()
        assert "shutting down" in out.get("error", ""), out
        assert s.proc.wait(WAIT_S) == 0, s.log()[-3000:]
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", s.port), timeout=2):
            pass

"""Bad input gets a 4xx with OpenAI's error body, and the server stays up.

Each bad request is followed by a valid one that succeeds; the server runs
with an API key (from MLX_KVQ_API_KEY) and a small `--max-request-bytes`.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from kvq_testing.server import ServerProcess
from kvq_testing.tiny import save_tiny_model

KEY = "sk-test-0123456789"
MAX_BODY = 64 * 1024
CHAT = "/v1/chat/completions"
OK_BODY = {"model": "default_model", "messages": [{"role": "user", "content": "hi"}],
           "max_tokens": 3}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("errors") / "m", "llama:sliding")
    # The key comes from MLX_KVQ_API_KEY here; test_server_api passes --api-key.
    with ServerProcess(path, "--max-request-bytes", str(MAX_BODY), api_key=KEY,
                       api_key_via_env=True) as s:  # fmt: skip
        s.wait_ready()
        yield s


def post(server, path, body, headers=None, raw=None):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    h.update(headers or {})
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=h, timeout=60)


def assert_openai_error(r, status, code=None, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param


def assert_still_serving(server):
    r = post(server, CHAT, OK_BODY)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
    assert server.health().status_code == 200


BAD_BODIES = {
    "malformed JSON": (b'{"messages": [', 400, None),
    "not an object": (b"[1, 2, 3]", 400, None),
    "missing messages": ({"model": "default_model"}, 400, "messages"),
    "empty messages": ({"messages": []}, 400, "messages"),
    "messages of wrong type": ({"messages": "hello"}, 400, "messages"),
    "bad role": ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    "max_tokens as text": ({**OK_BODY, "max_tokens": "ten"}, 400, "max_tokens"),
    "max_tokens zero": ({**OK_BODY, "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens negative": ({**OK_BODY, "max_tokens": -5}, 400, "max_tokens"),
    "temperature as text": ({**OK_BODY, "temperature": "hot"}, 400, "temperature"),
    "top_p out of range": ({**OK_BODY, "top_p": 1.5}, 400, "top_p"),
    "stream not a bool": ({**OK_BODY, "stream": "yes"}, 400, "stream"),
    "n above one": ({**OK_BODY, "n": 2}, 400, "n"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_bodies_get_400(server, case):
    body, status, param = BAD_BODIES[case]
    raw = body if isinstance(body, bytes) else None
    r = post(server, CHAT, body, raw=raw)
    assert_openai_error(r, status, param=param)
    assert_still_serving(server)


def test_completion_bad_bodies_get_400(server):
    for body in ({"prompt": 5}, {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "echo": True},
                 {"prompt": [10**9]}):  # fmt: skip
        assert_openai_error(post(server, "/v1/completions", body), 400)
    assert_still_serving(server)


def test_auth_failures_are_counted_apart_from_bad_requests(server):
    before = server.metrics()
    r = httpx.post(server.url + CHAT, json=OK_BODY, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    after = server.metrics()
    unauthorized = 'mlx_kvq_requests_total{status="unauthorized"}'
    rejected = 'mlx_kvq_requests_total{status="rejected"}'
    assert after[unauthorized] == before.get(unauthorized, 0) + 1
    assert after.get(rejected, 0) == before.get(rejected, 0)


def test_unknown_model_gets_404(server):
    r = post(server, CHAT, {**OK_BODY, "model": "no-such-model"})
    assert_openai_error(r, 404, code="model_not_found", param="model")
    assert_still_serving(server)


def test_oversized_body_gets_413(server):
    big = {**OK_BODY, "messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}
    assert_openai_error(post(server, CHAT, big), 413, code="request_too_large")

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(MAX_BODY // 1024 + 2):
            yield b"y" * 1024
        yield b'"}]}'

    r = httpx.post(server.url + CHAT, content=chunks(), timeout=60,
                   headers={"Authorization": f"Bearer {KEY}",
                            "Content-Type": "application/json"})  # fmt: skip
    assert_openai_error(r, 413, code="request_too_large")
    assert_still_serving(server)


def test_too_long_prompt_gets_400(server):
    # The tiny model's plan allows 512 tokens of context; send more.
    words = " ".join(["river"] * 700)
    r = post(server, CHAT, {**OK_BODY, "messages": [{"role": "user", "content": words}]})
    assert_openai_error(r, 400, code="context_length_exceeded")
    r = post(server, "/v1/completions", {"prompt": words, "max_tokens": 2})
    assert_openai_error(r, 400, code="context_length_exceeded")
    assert_still_serving(server)


def test_missing_or_wrong_api_key_gets_401(server):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"},
                    {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):  # fmt: skip
        r = post(server, CHAT, OK_BODY, headers=headers)
        assert_openai_error(r, 401, code="invalid_api_key")
        assert r.headers.get("www-authenticate") == "Bearer"
    r = httpx.get(server.url + "/v1/models", timeout=10)
    assert_openai_error(r, 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    # Probes and metrics stay open.
    for path in ("/health", "/live", "/metrics"):
        assert httpx.get(server.url + path, timeout=10).status_code == 200
    assert_still_serving(server)


def test_openai_client_sees_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="default_model", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="default_model", messages=[{"role": "user", "content": "hi"}], max_tokens=-1
        )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    r = client.chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert r.usage.completion_tokens > 0


def test_rejections_are_counted(server):
    m = server.metrics()
    assert m['mlx_kvq_requests_total{status="rejected"}'] > 0
    assert m['mlx_kvq_requests_total{status="ok"}'] > 0

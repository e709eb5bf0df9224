"""A request cannot make the server compute without bounds, stall its event
loop, or be sent by a web page the server does not trust; slow clients are
cut off.

One server (tiny model, 512 positions) with short header and body timeouts
answers: a client's own chat template is a 400; a 100,000-message request
is refused while `/live` keeps answering and a running stream keeps its
pace; a cross-site text/plain POST, a foreign Origin and a foreign Host are
refused; an idle connection and a slow body are cut off at their timeouts.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from kvq_testing.server import ServerProcess
from kvq_testing.tiny import save_tiny_model

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
WAIT_S = 60
BOUND_S = 0.5  # the pace the issue asks of /live and of a running stream
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("hardening") / "m", "llama:sliding")
    with ServerProcess(model, "--header-timeout", str(HEADER_TIMEOUT_S),
                       "--body-timeout", str(BODY_TIMEOUT_S)) as s:  # fmt: skip
        s.wait_ready()
        yield s


def post(server, path, body, headers=None, timeout=WAIT_S):
    h = {"Content-Type": "application/json", **(headers or {})}
    return httpx.post(server.url + path, content=json.dumps(body).encode(), headers=h,
                      timeout=timeout)  # fmt: skip


def error_of(r, status):
    assert r.status_code == status, r.text
    return r.json()["error"]


# -- client templates and template variables ---------------------------------------------
def test_a_client_chat_template_is_a_400_naming_the_field(server):
    hog = "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}"
    body = {"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"chat_template": hog}}
    err = error_of(post(server, CHAT, body), 400)
    assert err["param"] == "chat_template_kwargs" and "'chat_template'" in err["message"]
    for kwargs in ({"range": [1]}, {"raise_exception": "x"}, {"__class__": 1}, {"a b": 1}):
        body = {"messages": HI, "max_tokens": 2, "chat_template_kwargs": kwargs}
        err = error_of(post(server, CHAT, body), 400)
        assert err["param"] == "chat_template_kwargs", kwargs
    ok = post(server, CHAT, {"messages": HI, "max_tokens": 2,
                             "chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert ok.status_code == 200, ok.text


# -- the event loop keeps its pace ---------------------------------------------------------
def test_live_and_a_stream_keep_their_pace_while_a_huge_request_is_refused(server):
    arrivals: list[float] = []
    done = threading.Event()

    def stream():
        body = {"prompt": "Tell me a story", "max_tokens": 400, "stream": True}
        with httpx.stream("POST", server.url + COMPLETIONS, json=body, timeout=WAIT_S) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
        done.set()

    huge = {"messages": [{"role": "user", "content": "hi"}] * 100_000, "max_tokens": 2}
    refused: dict = {}

    def send_huge():
        refused["r"] = post(server, CHAT, huge)
        refused["at"] = time.monotonic()

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    while len(arrivals) < 3:
        assert not done.is_set(), "the stream ended before the huge request was sent"
        time.sleep(0.01)
    sender = threading.Thread(target=send_huge, daemon=True)
    start = time.monotonic()
    sender.start()
    live = []
    while sender.is_alive() or len(live) < 3:
        t = time.monotonic()
        r = httpx.get(server.url + "/live", timeout=WAIT_S)
        live.append(time.monotonic() - t)
        assert r.status_code == 200
        time.sleep(0.02)
    sender.join(WAIT_S)
    err = error_of(refused["r"], 400)
    assert err["code"] == "context_length_exceeded", err
    window = [a for a in arrivals if start <= a <= refused["at"]]
    assert not done.is_set() and window, "the stream must run through the refusal"
    gaps = [b - a for a, b in zip(window, window[1:], strict=False)]
    assert max(live) < BOUND_S, live
    assert not gaps or max(gaps) < BOUND_S, gaps
    streamer.join(WAIT_S)


# -- web pages -----------------------------------------------------------------------
def test_a_cross_site_text_plain_post_and_a_foreign_host_are_refused(server):
    raw = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    before = server.metrics().get('mlx_kvq_requests_total{status="ok"}', 0)
    r = httpx.post(server.url + COMPLETIONS, content=raw, timeout=WAIT_S,
                   headers={"Content-Type": "text/plain", "Origin": "https://evil.example"})  # fmt: skip
    assert error_of(r, 403)["code"] == "origin_not_allowed"
    r = httpx.post(server.url + COMPLETIONS, content=raw, timeout=WAIT_S,
                   headers={"Content-Type": "text/plain"})  # fmt: skip
    assert error_of(r, 415)["code"] == "unsupported_media_type"
    r = httpx.post(server.url + COMPLETIONS, content=raw, timeout=WAIT_S)  # no content type
    assert r.status_code == 415
    pre = httpx.options(server.url + COMPLETIONS, timeout=WAIT_S, headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})  # fmt: skip
    assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
    # DNS rebinding: a page's own name resolved to 127.0.0.1.
    for path in ("/live", "/status", "/"):
        r = httpx.get(server.url + path, headers={"Host": f"evil.example:{server.port}"})
        assert error_of(r, 403)["code"] == "host_not_allowed"
    r = post(server, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2},
             headers={"Host": "rebind.example"})  # fmt: skip
    assert r.status_code == 403
    assert server.metrics().get('mlx_kvq_requests_total{status="ok"}', 0) == before

    # The server's own page and loopback pages are answered, with CORS headers.
    for origin in (server.url, f"http://localhost:{server.port}", "http://localhost:3000"):
        r = post(server, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2}, {"Origin": origin})
        assert r.status_code == 200, (origin, r.text)
        assert r.headers["access-control-allow-origin"] == origin
    pre = httpx.options(server.url + CHAT, timeout=WAIT_S, headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})  # fmt: skip
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "authorization" in pre.headers["access-control-allow-headers"]
    r = httpx.get(server.url + "/live", headers={"Host": f"localhost:{server.port}"})
    assert r.status_code == 200


def test_guard_policy():
    from mlx_kvq.server.guards.browser import is_json
    from mlx_kvq.server.guards.policy import GuardPolicy, host_name, is_loopback

    loop = GuardPolicy.for_bind("127.0.0.1", None, [])
    assert loop.host_allowed("127.0.0.1:8080") and loop.host_allowed("[::1]:8080")
    assert loop.host_allowed("localhost") and loop.host_allowed("app.localhost:1")
    assert not loop.host_allowed("evil.example:8080") and not loop.host_allowed("10.0.0.1")
    assert not loop.origin_allowed("null", "127.0.0.1:8080", "http")
    assert loop.origin_allowed("http://127.0.0.1:8080", "127.0.0.1:8080", "http")
    assert not loop.origin_allowed("https://app.example", "127.0.0.1:8080", "http")
    wider = GuardPolicy.for_bind("127.0.0.1", ["box.lan"], ["https://app.example/"])
    assert wider.host_allowed("box.lan:8080") and not wider.host_allowed("other.lan")
    assert wider.origin_allowed("https://APP.example", "box.lan:8080", "http")
    assert GuardPolicy.for_bind("127.0.0.1", None, ["*"]).origin_allowed("null", None, "http")
    public = GuardPolicy.for_bind("0.0.0.0", None, [])
    assert public.host_allowed("box.lan:8080")
    assert public.origin_allowed("http://box.lan:8080", "box.lan:8080", "http")
    assert not public.origin_allowed("http://evil.example", "box.lan:8080", "http")
    assert GuardPolicy.for_bind("0.0.0.0", [], []).hosts == ()
    assert is_loopback("127.3.4.5") and is_loopback("::1") and not is_loopback("0.0.0.0")
    assert host_name("[::1]:80") == "::1" and host_name("Example.COM:80") == "example.com"
    assert is_json("application/json; charset=utf-8") and is_json("application/vnd.x+json")
    assert not is_json("text/plain") and not is_json(None)


# -- slow clients ----------------------------------------------------------------------
def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing `sock`, or None if it still holds it."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        return None
    return got


def test_idle_connections_and_slow_bodies_are_cut_off(server):
    with socket.create_connection(("127.0.0.1", server.port)) as idle:
        assert closed_within(idle, HEADER_TIMEOUT_S * 10) == b""
    with socket.create_connection(("127.0.0.1", server.port)) as partial:
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert closed_within(partial, HEADER_TIMEOUT_S * 10) == b""
    with socket.create_connection(("127.0.0.1", server.port)) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")  # fmt: skip
        got = closed_within(slow, BODY_TIMEOUT_S * 5)
        assert got is not None and got.startswith(b"HTTP/1.1 408"), got
        assert b"request_timeout" in got
    assert httpx.get(server.url + "/live", timeout=WAIT_S).status_code == 200


def test_an_api_key_no_header_can_carry_exits_2():
    for key in ("cl\u00e9\u2713", " padded", "a\nb"):
        proc = subprocess.run(
            [sys.executable, "-m", "mlx_kvq", "serve", "--api-key", key, "--port", "1"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert "--api-key" in proc.stderr


def test_connection_cap_and_a_drain_that_does_not_wait_for_arriving_bodies(tmp_path):
    import signal

    model = save_tiny_model(tmp_path / "m", "llama:sliding")
    with ServerProcess(model, "--max-connections", "3", "--shutdown-timeout", "60") as s:
        s.wait_ready()
        time.sleep(0.5)  # the readiness polls' connections are gone
        held = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(3)]
        with socket.create_connection(("127.0.0.1", s.port)) as extra:
            got = closed_within(extra, WAIT_S)
        assert got is not None and got.startswith(b"HTTP/1.1 503"), got
        for sock in held:
            sock.close()
        time.sleep(0.5)
        assert httpx.get(s.url + "/live", timeout=WAIT_S).status_code == 200

        upload = socket.create_connection(("127.0.0.1", s.port))
        upload.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                       b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"pro")  # fmt: skip
        time.sleep(0.5)
        signalled = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        got = closed_within(upload, WAIT_S)
        upload.close()
        assert got is not None and got.startswith(b"HTTP/1.1 503") and b"shutting_down" in got
        assert s.proc.wait(WAIT_S) == 0
        # The drain did not wait out --shutdown-timeout for a body that never came.
        assert time.monotonic() - signalled < 30
        assert "Traceback" not in s.log(), s.log()[-3000:]

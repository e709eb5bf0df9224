"""The suite's guard against KV budget overruns: a test that ran an engine
which counted one fails, whatever it asserts (tests/conftest.py), and a
server process whose `/metrics` counted one fails when it stops
(`kvq_testing.server.ServerProcess`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kvq_testing.server import TESTS_DIR, BudgetOverrun, ServerProcess, python_path

PROBE = """
import threading

from mlx_kvq.engine.budget import CostModel, Ledger, Share, SlotCost

def ledger():
    cost = CostModel((SlotCost(None, 10, 40),), 0, 0, 16, 2, "K4/V4")
    return Ledger([Share(1000, cost)])

def test_within():
    assert ledger().check(0, 1000)  # nothing live: within its bound

def test_over_on_another_thread():  # as the engine thread measures
    t = threading.Thread(target=ledger().check, args=(0, 1001))
    t.start()
    t.join()
"""


def test_a_test_whose_engine_overran_its_budget_fails(tmp_path):
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(PROBE))
    env = {"PYTHONPATH": python_path({}), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:xdist", "-p",
         "no:cacheprovider", "-q", "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "test_over_on_another_thread" in out and "exceeded its KV budget" in out, out
    assert "live 0 + prompt cache 1,001 bytes, budget 1,000" in out, out
    assert str(TESTS_DIR) in env["PYTHONPATH"]


class _Metrics(BaseHTTPRequestHandler):
    overruns = 0

    def do_GET(self):  # noqa: N802 - the handler's name
        body = f"mlx_kvq_kv_budget_overruns_total {self.overruns}\n".encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _FakeServer(ServerProcess):
    """A process that only sleeps, whose `/metrics` says `overruns`."""

    def __init__(self, overruns: int):
        super().__init__(None)
        handler = type("Handler", (_Metrics,), {"overruns": overruns})
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def command(self) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.mark.parametrize("overruns", [0, 3])
def test_a_server_that_overran_its_budget_fails_when_it_stops(overruns):
    server = _FakeServer(overruns).start()
    try:
        if overruns:
            with pytest.raises(BudgetOverrun, match="counted 3 KV budget overruns"):
                server.stop()
        else:
            server.stop()
        assert server.proc.poll() is not None  # stopped either way
    finally:
        server.http.shutdown()


def test_a_failing_test_shows_its_own_failure_not_the_overrun():
    fakes = [_FakeServer(2), _FakeServer(2)]
    try:
        with pytest.raises(KeyError):
            with fakes[0].start():
                raise KeyError("the test's own failure")
        with pytest.raises(BudgetOverrun):
            with fakes[1].start():
                pass  # the body passes: the overrun is the failure
        assert all(f.proc.poll() is not None for f in fakes)
    finally:
        for f in fakes:
            f.http.shutdown()

"""Run `mlx-kvq serve` as a real subprocess on a free loopback port, for tests.

Tests talk to it with the official `openai` client and plain HTTP; nothing
here asserts timings: waits are bounded only so that a broken server fails
the test instead of hanging it. `MlxLmServerProcess` runs mlx-lm's own
`mlx_lm.server` the same way, for parity tests that send both the same request.

Exceeding the KV budget is a bug whatever a test asserts: a server stopped
while it answers reads its `/metrics` first, and `stop` raises
`BudgetOverrun` when the engine counted an overrun of its budget.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = REPO_ROOT / "tests"
STARTUP_TIMEOUT_S = 180.0
METRICS_AT_STOP_S = 5.0  # how long a stopping server's /metrics is waited for
OVERRUNS = "mlx_kvq_kv_budget_overruns_total"


class BudgetOverrun(AssertionError):
    """The server's engine counted steps that held more than its KV budget."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to {'name{label="v"}': value} (labels sorted as exported)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def python_path(env: dict[str, str]) -> str:
    """PYTHONPATH for a subprocess: the checkout and these helpers first."""
    parts = (str(REPO_ROOT), str(TESTS_DIR), env.get("PYTHONPATH"))
    return os.pathsep.join(p for p in parts if p)


class ServerProcess:
    """`python -m mlx_kvq serve --model DIR ...` on 127.0.0.1:<free port>."""

    def __init__(
        self,
        model: str | Path | None,
        *args: str,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        api_key_via_env: bool = False,
    ):
        self.model = model
        self.args = list(args)
        self.api_key = api_key
        self.api_key_via_env = api_key_via_env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_env = env or {}
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="mlx-kvq-serve-", suffix=".log")

    # -- lifecycle -------------------------------------------------------------
    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "mlx_kvq", "serve"]
        if self.model is not None:
            cmd += ["--model", str(self.model)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.api_key and not self.api_key_via_env:
            cmd += ["--api-key", self.api_key]
        return cmd + self.args

    def start(self) -> ServerProcess:
        env = dict(os.environ)
        env["PYTHONPATH"] = python_path(env)
        env.pop("MLX_KVQ_API_KEY", None)
        if self.api_key and self.api_key_via_env:
            env["MLX_KVQ_API_KEY"] = self.api_key
        env.update(self.extra_env)
        self.proc = subprocess.Popen(
            self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT
        )
        return self

    def run_to_exit(self, timeout: float = STARTUP_TIMEOUT_S) -> int:
        """Start and wait for the process to exit by itself; returns its exit code."""
        self.start()
        return self.proc.wait(timeout)

    def stop(self) -> None:
        """Stop the server; `BudgetOverrun` if its engine counted an overrun
        of the KV budget (read from `/metrics` first, when it answers)."""
        overruns = self.budget_overruns()
        self.terminate()
        if overruns:
            raise BudgetOverrun(
                f"the server counted {overruns:g} KV budget overruns ({OVERRUNS}):\n"
                f"{self.log()[-4000:]}"
            )

    def budget_overruns(self) -> float:
        """The engine's count of budget overruns (0 when the server does not
        run or answer, or has no budget)."""
        if self.proc is None or self.proc.poll() is not None:
            return 0
        try:
            r = httpx.get(self.url + "/metrics", headers=self.headers(), timeout=METRICS_AT_STOP_S)
        except httpx.HTTPError:
            return 0
        if r.status_code != 200:
            return 0
        found = parse_metrics(r.text)  # every engine's count (labelled by model, if several)
        return sum(v for k, v in found.items() if k == OVERRUNS or k.startswith(OVERRUNS + "{"))

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            self.stop()
        except BudgetOverrun:
            if exc_type is None:  # else the test's own failure is the one to show
                raise
        finally:
            self._log.close()

    def log(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    # -- waiting -----------------------------------------------------------------
    def wait_for(self, path: str, status: int = 200, timeout: float = STARTUP_TIMEOUT_S):
        """Poll GET `path` until it answers `status`; fail if the process dies."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode} before {path} answered "
                    f"{status}:\n{self.log()[-4000:]}"
                )
            try:
                r = httpx.get(self.url + path, timeout=5)
                last = r
                if r.status_code == status:
                    return r
            except httpx.TransportError:
                pass
            else:
                if (
                    path == "/health"
                    and r.status_code == 503
                    and r.json().get("status") == "failed"
                ):
                    raise RuntimeError(f"engine failed: {r.json()}:\n{self.log()[-4000:]}")
            time.sleep(0.05)
        raise TimeoutError(f"{path} never answered {status} (last: {last}):\n{self.log()[-4000:]}")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> httpx.Response:
        return self.wait_for("/health", 200, timeout)

    # -- talking -------------------------------------------------------------------
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs: Any):
        import openai

        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", **kwargs)

    def metrics(self) -> dict[str, float]:
        r = httpx.get(self.url + "/metrics", timeout=10)
        r.raise_for_status()
        return parse_metrics(r.text)

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=10)


class MlxLmServerProcess(ServerProcess):
    """`python -m mlx_lm.server --model DIR ...` on 127.0.0.1:<free port>: the
    reference that parity tests compare `mlx-kvq serve` with.

    Its `/health` answers 200 while the model is still loading (the model
    loads in its generation thread); requests wait for the load, so
    `wait_ready` followed by a request is still safe.
    """

    def budget_overruns(self) -> float:
        return 0  # mlx_lm.server has no KV budget

    def command(self) -> list[str]:
        if self.api_key:
            raise ValueError("mlx_lm.server has no API key")
        cmd = [sys.executable, "-m", "mlx_lm.server"]
        if self.model is not None:
            cmd += ["--model", str(self.model)]
        return cmd + ["--host", "127.0.0.1", "--port", str(self.port)] + self.args

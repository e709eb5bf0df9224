"""The servers that the HTTP sections compare (servers, agents): arms, their
processes, readiness and the BLAS each one bound.

Every arm runs as its own process on the same model directory and the same
BLAS: mlx-kvq binds OpenBLAS itself (`mlx_kvq.blas`), and `mlx_lm.server` is
started by a launcher that binds the same library the same way before running
`mlx_lm.server`'s own `main` (an `LD_PRELOAD` cannot do it: the
`scipy-openblas32` library exports its functions as `scipy_cblas_*`). Each
server's BLAS line is recorded from the server itself.

Ready means `/health` answering 200 for mlx-kvq and, for `mlx_lm.server`
(whose `/health` answers while the model still loads), its first completion
answered; mlx-kvq's first answer is recorded too.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

BASELINE = "mlx_lm.server"
STARTUP_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 3600.0
BLAS_MARKER = "mlx-kvq bench: BLAS "

# mlx_lm.server on the BLAS mlx-kvq binds: the same library, bound the same way.
_MLX_LM_LAUNCHER = (
    "import sys\n"
    "from mlx_kvq.blas import use_fast_blas\n"
    f"print({BLAS_MARKER!r} + use_fast_blas().summary(), file=sys.stderr, flush=True)\n"
    "from mlx_lm.server import main\n"
    "sys.argv = ['mlx_lm.server', *sys.argv[1:]]\n"
    "main()\n"
)


@dataclass(frozen=True)
class Arm:
    """One server of the comparison: its name and the command line that starts it."""

    name: str
    flags: tuple[str, ...]
    baseline: bool = False

    def display(self, model: str) -> str:
        """The command line a user would type for this arm."""
        name = BASELINE if self.baseline else "mlx-kvq serve"
        return " ".join([name, "--model", model, *self.flags])

    def command(self, model: str, port: int) -> list[str]:
        where = ["--model", model, "--host", "127.0.0.1", "--port", str(port)]
        if self.baseline:
            return [sys.executable, "-c", _MLX_LM_LAUNCHER, *where, *self.flags]
        return [sys.executable, "-m", "mlx_kvq", "serve", *where, *self.flags]


def arms(server_flags: tuple[str, ...]) -> list[Arm]:
    """`mlx_lm.server` first, then one mlx-kvq arm per entry of `server_flags`
    (its `serve` flags as one string; an empty entry: the defaults)."""
    out = [Arm(BASELINE, (), baseline=True)]
    for text in server_flags:
        flags = tuple(shlex.split(text))
        out.append(Arm("mlx-kvq " + (" ".join(flags) or "default"), flags))
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Answer:
    seconds: float
    text: str
    prompt_tokens: int
    completion_tokens: int


def post_json(url: str, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> dict:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def get_json(url: str, timeout: float = 10.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


@dataclass
class Server:
    """A running server process and what its start measured."""

    arm: Arm
    model: str
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: str = ""
    ready_s: float | None = None  # mlx-kvq: /health 200; mlx_lm.server: first answer
    first_answer_s: float | None = None
    blas: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, warm_prompt: str) -> None:
        """Start the process and wait until it has answered a first request."""
        fd, self.log_path = tempfile.mkstemp(prefix="mlx-kvq-bench-server-", suffix=".log")
        log = os.fdopen(fd, "w")
        env = dict(os.environ)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.arm.command(self.model, self.port), stdout=log, stderr=subprocess.STDOUT, env=env
        )
        log.close()
        deadline = t0 + STARTUP_TIMEOUT_S
        if not self.arm.baseline:
            while True:
                self._alive_or_raise(deadline)
                try:
                    status, body = get_json(self.url + "/health", timeout=5)
                except OSError:
                    status, body = 0, {}
                if status == 200:
                    self.ready_s = time.perf_counter() - t0
                    self.blas = (body.get("blas") or {}).get("config") or str(body.get("blas"))
                    break
                if body.get("status") == "failed":
                    raise RuntimeError(f"{self.arm.name}: engine failed: {body}\n{self.tail()}")
                time.sleep(0.02)
        while True:
            self._alive_or_raise(deadline)
            try:
                self.complete(warm_prompt, 1, timeout=STARTUP_TIMEOUT_S)
                break
            except (ConnectionError, urllib.error.URLError, OSError):
                time.sleep(0.02)
        self.first_answer_s = time.perf_counter() - t0
        if self.arm.baseline:
            self.ready_s = self.first_answer_s
            line = next((x for x in self.tail(20000).splitlines() if BLAS_MARKER in x), "")
            self.blas = line.split(BLAS_MARKER, 1)[-1] or None

    def _alive_or_raise(self, deadline: float) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.arm.name} exited with {self.proc.returncode} while starting:\n{self.tail()}"
            )
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{self.arm.name} not ready after {STARTUP_TIMEOUT_S:.0f} s")

    def tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def complete(self, prompt: str, max_tokens: int, timeout: float = REQUEST_TIMEOUT_S) -> Answer:
        body = {
            "model": "default_model",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": False,
        }
        t0 = time.perf_counter()
        reply = post_json(self.url + "/v1/completions", body, timeout)
        seconds = time.perf_counter() - t0
        usage = reply.get("usage") or {}
        return Answer(
            seconds,
            reply["choices"][0].get("text", ""),
            int(usage.get("prompt_tokens", 0)),
            int(usage.get("completion_tokens", 0)),
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.log_path:
            Path(self.log_path).unlink(missing_ok=True)


def model_context(model: str) -> int | None:
    """The model's context in tokens (`max_position_embeddings` in
    config.json, or in its `text_config`); None when it does not say."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("max_position_embeddings") or (config.get("text_config") or {}).get(
        "max_position_embeddings"
    )


def load_tokenizer(model: str):
    """The model's tokenizer as both servers load it (mlx-lm's wrapper)."""
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    return mlx_lm_load_tokenizer(Path(model))


def read_weights(model: str) -> None:
    """Read the weight files once, so that every start finds them in the page cache."""
    for path in Path(model).glob("*.safetensors"):
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass

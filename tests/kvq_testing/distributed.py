"""Run mlx-kvq as a 2-rank group on loopback, for tests and by hand.

Two ways to start a group, both on the ring backend over 127.0.0.1:

- `mlx_launch(...)`: through `mlx.launch --backend ring -n N`, exactly as a
  user would (the launcher tears the whole group down when a rank exits
  non-zero);
- `RankGroup`: one process per rank started directly with the two variables
  `mlx.launch` sets (MLX_RANK, MLX_HOSTFILE), as a per-host process manager
  would; a rank can then be killed and the others observed.

`python -m kvq_testing.distributed ARGS :: ARGS ...` runs several
`mlx-kvq` command lines one after the other in the same processes (one group,
imports paid once), printing `### run I exit RC` on rank 0 after each.
Nothing here asserts timings; waits are bounded so a broken group fails
instead of hanging.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvq_testing.server import REPO_ROOT, ServerProcess, free_port, python_path

RUN_MARK = "### run"


def free_port_run(n: int = 2, tries: int = 200) -> int:
    """A port p such that p .. p+n-1 are free on 127.0.0.1 (ring ports of n ranks)."""
    for _ in range(tries):
        base = free_port()
        if base + n >= 65535:
            continue
        socks = []
        try:
            for i in range(n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports found")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = python_path(env)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.update(extra or {})
    return env


def launcher() -> str | None:
    """Path of `mlx.launch` (next to this Python, or on PATH), if installed."""
    beside = Path(sys.executable).parent / "mlx.launch"
    return str(beside) if beside.exists() else shutil.which("mlx.launch")


def mlx_launch_command(argv: list[str], n: int = 2, port: int | None = None) -> list[str]:
    port = port or free_port_run(n)
    return [
        launcher() or "mlx.launch",
        "--backend",
        "ring",
        "-n",
        str(n),
        "--starting-port",
        str(port),
        "--",
        *argv,
    ]


def mlx_launch(argv: list[str], n: int = 2, timeout: float = 120.0,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """Run `argv` (a command line) on `n` ranks with `mlx.launch`; wait for it, bounded."""
    cmd = mlx_launch_command(argv, n)
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env),
        cwd=REPO_ROOT, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(p)
        out, err = p.communicate()
        raise TimeoutError(
            f"mlx.launch did not finish in {timeout:g} s:\n{out[-3000:]}\n{err[-3000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def cli_runs(*runs: list[str]) -> list[str]:
    """The command line that runs several `mlx-kvq` invocations in one group."""
    argv = [sys.executable, "-m", "kvq_testing.distributed"]
    for i, run in enumerate(runs):
        if i:
            argv.append("::")
        argv.extend(run)
    return argv


def split_runs(stdout: str) -> list[tuple[int, str]]:
    """(exit code, rank 0's output) of each run, from a `cli_runs` launch."""
    out, chunk = [], []
    for line in stdout.split("\n"):  # not splitlines(): generated text may hold \x1c-\x1e
        if line.startswith(RUN_MARK):
            out.append((int(line.rsplit(" ", 1)[1]), "\n".join(chunk)))
            chunk = []
        else:
            chunk.append(line)
    return out


def _kill_group(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- servers -----------------------------------------------------------------
class LaunchedServer(ServerProcess):
    """`mlx-kvq serve` on 2 ranks through `mlx.launch`; rank 0 serves HTTP."""

    def __init__(self, model: str | Path, *args: str, n: int = 2, **kw: Any):
        super().__init__(model, *args, **kw)
        self.n = n

    def command(self) -> list[str]:
        return mlx_launch_command(super().command(), self.n)

    def start(self) -> LaunchedServer:
        self.proc = subprocess.Popen(
            self.command(), stdout=self._log, stderr=subprocess.STDOUT,
            env=_env(self.extra_env), cwd=REPO_ROOT, start_new_session=True,
        )  # fmt: skip
        return self

    def rank_pids(self) -> dict[int, int]:
        """pid of each rank's python process (children of the launcher's shells)."""
        return _rank_pids(self.proc.pid)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _kill_group(self.proc, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                _kill_group(self.proc)
                self.proc.wait(5)


def _rank_pids(root: int) -> dict[int, int]:
    """Find processes below `root` whose environment says MLX_RANK=r."""
    found: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getsid(int(d.name)) != os.getsid(root):
                continue
            env = (d / "environ").read_bytes().split(b"\0")
            cmdline = (d / "cmdline").read_bytes()
        except (OSError, ProcessLookupError):
            continue
        if b"mlx_kvq" not in cmdline:
            continue
        for item in env:
            if item.startswith(b"MLX_RANK="):
                found[int(item.split(b"=", 1)[1])] = int(d.name)
    return found


class RankGroup(ServerProcess):
    """`mlx-kvq serve` as one process per rank, started without `mlx.launch`."""

    def __init__(self, model: str | Path, *args: str, n: int = 2, **kw: Any):
        super().__init__(model, *args, **kw)
        self.n = n
        self.procs: list[subprocess.Popen] = []
        self._logs = [tempfile.NamedTemporaryFile("w+", prefix=f"mlx-kvq-rank{r}-", suffix=".log")
                      for r in range(n)]  # fmt: skip
        self._hostfile = tempfile.NamedTemporaryFile("w", prefix="mlx-kvq-hosts-", suffix=".json")

    def start(self) -> RankGroup:
        base = free_port_run(self.n)
        json.dump([[f"127.0.0.1:{base + r}"] for r in range(self.n)], self._hostfile)
        self._hostfile.flush()
        for r in range(self.n):
            env = _env({**self.extra_env, "MLX_RANK": str(r), "MLX_HOSTFILE": self._hostfile.name})
            self.procs.append(subprocess.Popen(
                self.command(), stdout=self._logs[r], stderr=subprocess.STDOUT, env=env,
                cwd=REPO_ROOT, start_new_session=True,
            ))  # fmt: skip
        self.proc = self.procs[0]
        return self

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        self.procs[rank].send_signal(sig)
        self.procs[rank].wait(15)

    def terminate(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for f in self._logs:
                f.close()
            self._hostfile.close()

    def log(self, rank: int = 0) -> str:
        self._logs[rank].flush()
        return Path(self._logs[rank].name).read_text(errors="replace")


# -- tiny models, made once per process -----------------------------------------
_TINY: dict[str, Path] = {}
_TINY_ROOT: tempfile.TemporaryDirectory | None = None


def tiny_model(model_type: str, **overrides: Any) -> Path:
    """A tiny float32 model directory for `model_type` (kv heads 2, head_dim 64,
    unless `overrides` say otherwise), written once per process and shared by
    every test that asks."""
    global _TINY_ROOT
    name = model_type + "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
    if name not in _TINY:
        from kvq_testing.tiny import save_tiny_model

        if _TINY_ROOT is None:
            _TINY_ROOT = tempfile.TemporaryDirectory(prefix="mlx-kvq-dist-models-")
        _TINY[name] = save_tiny_model(Path(_TINY_ROOT.name) / name, model_type, **overrides)
    return _TINY[name]


# -- several CLI runs in one group -------------------------------------------
FAIL_PLAN = "@fail-plan-on-rank="  # first word of a run: make planning fail on that rank
# First word of a run refused on every rank before any collective (settings
# checked from config.json): the group stays usable, so later runs still go.
REFUSED_EARLY = "@refused-before-loading"


def _fail_plan_on(rank: int):
    """Make the group's KV plan (`plan_on_every_rank`, after loading) refuse
    on `rank` only (a rank that cannot honour the plan)."""
    from mlx_kvq.config import UnsupportedKVConfig
    from mlx_kvq.distributed import planning, world
    from mlx_kvq.plan import plan_kv

    original = planning.plan_on_every_rank

    def refuse(*a, **kw):
        if world().rank() == rank:
            raise UnsupportedKVConfig(f"injected for the test: rank {rank} cannot hold its caches")
        return plan_kv(*a, **kw)

    def plan_on_every_rank(*a, **kw):
        return original(*a, **kw, planner=refuse)

    planning.plan_on_every_rank = plan_on_every_rank
    return lambda: setattr(planning, "plan_on_every_rank", original)


def main(argv: list[str]) -> int:
    from mlx_kvq.commands import main as cli_main
    from mlx_kvq.distributed import world

    runs, current = [], []
    for a in argv:
        if a == "::":
            runs.append(current)
            current = []
        else:
            current.append(a)
    runs.append(current)
    worst = 0
    for i, run in enumerate(runs):
        restore = None
        early = bool(run) and run[0] == REFUSED_EARLY
        if early:
            run = run[1:]
        if run and run[0].startswith(FAIL_PLAN):  # this run: planning fails on one rank
            restore = _fail_plan_on(int(run.pop(0).split("=", 1)[1]))
        try:
            rc = cli_main(run)
        except SystemExit as e:
            rc = int(e.code or 0)
        finally:
            if restore is not None:
                restore()
        sys.stdout.flush()
        if world().rank() == 0:
            print(f"{RUN_MARK} {i} exit {rc}", flush=True)
        if early and rc == 2:  # refused as expected, before any collective
            continue
        worst = max(worst, rc)
        if rc:  # the group is not usable after a failed run
            break
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

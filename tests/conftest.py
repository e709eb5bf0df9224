"""Pytest configuration shared by the test-suite.

The suite runs MLX's float products on the fast BLAS, as every `mlx-kvq`
command does (`mlx_kvq.use_fast_blas()`): the paths and tolerances tested
are the ones the commands take. What `import mlx_kvq` alone does is tested
in fresh subprocesses (tests/test_import_isolation.py).

The suite runs on as many workers as the machine has cores (pytest-xdist,
`-n auto --dist loadfile` in pyproject.toml: a file's tests and its module
fixtures stay on one worker); each worker and the servers it starts take one
BLAS thread, since the workers already share the cores, and the files that
take longest are handed out first so that none of them starts last.

Exceeding the KV budget is a bug, whatever a test asserts: every test that
runs an engine in this process fails when the engine's own check after a
step (`Ledger.check`) counted an overrun or a missed bound, whichever engine
it was (one of the test's, or a module fixture's). Server processes are
checked by `kvq_testing.server.ServerProcess` when they stop.
"""

import os
from dataclasses import dataclass

import pytest

import mlx_kvq

LONGEST_FIRST = (  # the slowest files, slowest first (pytest --durations)
    "test_real_models.py",
    "test_server_soak.py",
    "test_distributed_serve.py",
    "test_quality_docs.py",
    "test_cli.py",
    "test_distributed_generate.py",
    "test_bench_servers.py",
    "test_server_disk.py",
    "test_bench.py",
)


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    mlx_kvq.use_fast_blas()
    config.addinivalue_line(
        "markers",
        "distributed: launches a 2-rank mlx.distributed group on loopback "
        "(ring backend); deselect with -m 'not distributed'",
    )


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file is kept


@dataclass(frozen=True)
class Overrun:
    """One failed budget check: what was measured against what was allowed."""

    live: int
    prompt_cache: int
    budget: int
    bound: int

    def __str__(self) -> str:
        return (
            f"live {self.live:,} + prompt cache {self.prompt_cache:,} bytes, budget "
            f"{self.budget:,}, bound of the admitted sequences {self.bound:,}"
        )


OVERRUNS = pytest.StashKey[list]()  # the test's failed budget checks
REPORTED = pytest.StashKey[int]()  # how many of them failed its call already


def overrun_message(found: list[Overrun]) -> str:
    lines = "\n".join(f"  {o}" for o in found[:5])
    more = f"\n  ... and {len(found) - 5} more" if len(found) > 5 else ""
    return f"the engine exceeded its KV budget or its bound {len(found)} times:\n{lines}{more}"


@pytest.fixture(autouse=True)
def _kv_budget_held(request, monkeypatch):
    """Record every budget check that fails during the test: the engine
    thread calls `Ledger.check` after each step, on whichever ledger, so
    the class's method is wrapped while the test runs. The test fails on
    any (`pytest_runtest_call`), or errors on one that comes while its
    fixtures are torn down."""
    from mlx_kvq.engine.budget import Ledger

    found: list[Overrun] = []
    request.node.stash[OVERRUNS] = found
    check = Ledger.check

    def counted(self, live, prompt_cache):
        ok = check(self, live, prompt_cache)
        if not ok:
            found.append(Overrun(live, prompt_cache, self.budget, self.reserved()))
        return ok

    monkeypatch.setattr(Ledger, "check", counted)
    yield
    if len(found) > request.node.stash.get(REPORTED, 0):
        pytest.fail(overrun_message(found), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    found = item.stash.get(OVERRUNS, [])
    if found:
        item.stash[REPORTED] = len(found)
        pytest.fail(overrun_message(found), pytrace=False)
    return result

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
"""

import os

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

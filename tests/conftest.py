"""Pytest configuration shared by the test-suite.

The suite runs MLX's float products on the fast BLAS, as every `mlx-kvq`
command does (`mlx_kvq.use_fast_blas()`): the paths and tolerances tested
are the ones the commands take. What `import mlx_kvq` alone does is tested
in fresh subprocesses (tests/test_import_isolation.py).
"""

import mlx_kvq


def pytest_configure(config):
    mlx_kvq.use_fast_blas()
    config.addinivalue_line(
        "markers",
        "distributed: launches a 2-rank mlx.distributed group on loopback "
        "(ring backend); deselect with -m 'not distributed'",
    )

"""Pytest configuration shared by the test-suite."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "distributed: launches a 2-rank mlx.distributed group on loopback "
        "(ring backend); deselect with -m 'not distributed'",
    )

"""Every KV-bearing mlx-lm architecture runs with 4-bit caches on every KV
layer, or is refused by the plan at load time; never a failure later."""

from __future__ import annotations

import pytest
from kvq_testing import archs
from kvq_testing.sweep import FAILED, SUPPORTED, sweep_one

_results: dict[str, str] = {}


@pytest.mark.parametrize("name", list(archs.TINY_CONFIGS))
def test_architecture_quantizes_or_is_refused_at_plan_time(name):
    result = sweep_one(name)
    _results[name] = result.verdict
    assert result.verdict != FAILED, result.reason
    if result.verdict == SUPPORTED:
        assert result.checks["quantized"] == result.checks["kv_layers"] > 0


def test_at_least_95_percent_supported():
    missing = [n for n in archs.TINY_CONFIGS if n not in _results]
    for name in missing:  # when run on its own
        _results[name] = sweep_one(name).verdict
    supported = sum(v == SUPPORTED for v in _results.values())
    assert supported / len(_results) >= 0.95, {k: v for k, v in _results.items() if v != SUPPORTED}

"""A spy on the engine's budget checks, and the per-token setting whose
arithmetic the budget and scheduler tests size their budgets by."""

from __future__ import annotations

from mlx_kvq.config import KVConfig
from mlx_kvq.engine.budget import Ledger

# Per token, 8-bit windows (the hybrid default before the split layout): what
# a row holds is whole tokens at one width, so a test can size a budget to it.
WINDOWS_8BIT = KVConfig(bits=4, value_bits=3, group_size=64, rotation="hadamard", window_bits=8)


def spy_checks(monkeypatch) -> list[tuple[int, int, int]]:
    """(live, bound, prompt cache) at every measurement inside the engine."""
    measured = []
    check = Ledger.check

    def spy(self, live, prompt_cache):
        measured.append((live, self.reserved(), prompt_cache))
        return check(self, live, prompt_cache)

    monkeypatch.setattr(Ledger, "check", spy)
    return measured

"""A spy on the engine's budget checks, shared by the budget and scheduler tests."""

from __future__ import annotations

from mlx_kvq.engine.budget import Ledger


def spy_checks(monkeypatch) -> list[tuple[int, int, int]]:
    """(live, bound, prompt cache) at every measurement inside the engine."""
    measured = []
    check = Ledger.check

    def spy(self, live, prompt_cache):
        measured.append((live, self.reserved(), prompt_cache))
        return check(self, live, prompt_cache)

    monkeypatch.setattr(Ledger, "check", spy)
    return measured

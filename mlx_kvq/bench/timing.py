"""Interleaved timing: every candidate runs once per round, rounds repeat.

Timings on a shared machine drift by whole factors over minutes, so
candidates that are compared are measured in the same rounds (A B C A B C
...) and reported as the median with the min-max spread; ratios are taken
between medians of the same run.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx


def load_average() -> list[float] | None:
    """1/5/15-minute load averages: how shared the machine was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


@dataclass
class Stat:
    """Repeated measurements of one quantity (seconds, or any unit)."""

    samples: list[float] = field(default_factory=list)
    skipped: str | None = None
    predicted: float | None = None  # an estimate standing in for a skipped measurement

    @property
    def ok(self) -> bool:
        return bool(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    @property
    def min(self) -> float:
        return min(self.samples) if self.samples else float("nan")

    @property
    def max(self) -> float:
        return max(self.samples) if self.samples else float("nan")

    def rate(self, amount: float) -> Stat:
        """`amount / seconds` per sample (tokens/s from seconds)."""
        return Stat([amount / s for s in self.samples if s > 0], self.skipped)

    def to_dict(self, digits: int = 6) -> dict:
        if not self.samples:
            d = {"median": None, "min": None, "max": None, "n": 0, "skipped": self.skipped}
            if self.predicted is not None:
                d["predicted"] = round(self.predicted, digits)
            return d
        return {
            "median": round(self.median, digits),
            "min": round(self.min, digits),
            "max": round(self.max, digits),
            "n": len(self.samples),
            "samples": [round(s, digits) for s in self.samples],
        }


def timed(fn: Callable[[], object]) -> float:
    """Seconds to build and evaluate what `fn` returns."""
    t = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - t


def interleave(
    candidates: dict[str, Callable[[], float]],
    repeats: int,
    warmup: int = 1,
    budget_s: float | None = None,
) -> dict[str, Stat]:
    """Run each candidate (a callable returning the seconds it measured)
    `repeats` times, interleaved round by round, after `warmup` untimed runs.

    With `budget_s`, a candidate whose warm-up run shows that `repeats` runs
    would exceed the budget gets fewer (at least one); a warm-up run longer
    than half the budget is kept as the one sample instead of being repeated.
    """
    stats = {name: Stat() for name in candidates}
    wanted = dict.fromkeys(candidates, repeats)
    for name, fn in candidates.items():
        for _ in range(warmup):
            t = fn()
            if budget_s is not None:
                if t > budget_s / 2:
                    stats[name].samples.append(t)
                    wanted[name] = 0
                    break
                wanted[name] = max(1, min(repeats, int(budget_s / max(t, 1e-9))))
    names = list(candidates)
    for r in range(max(wanted.values(), default=0)):
        # A B C, then C B A: a load that drifts during a round weighs on
        # every candidate alike over two rounds.
        for name in names if r % 2 == 0 else reversed(names):
            if r < wanted[name]:
                stats[name].samples.append(candidates[name]())
    return stats


def paired_ratio(base: Stat, other: Stat) -> Stat:
    """`base / other` round by round (samples taken in the same rounds), so
    load changes between rounds cancel; falls back to the ratio of medians
    when the two were not sampled in the same rounds."""
    if not (base.ok and other.ok):
        return Stat(skipped=base.skipped or other.skipped or "not measured")
    if len(base.samples) == len(other.samples):
        return Stat([b / o for b, o in zip(base.samples, other.samples, strict=True) if o > 0])
    return Stat([base.median / other.median])


def format_spread(
    d: dict | None, fmt: str = "{:.1f}", scale: float = 1.0, mark_single: bool = False
) -> str:
    """A stat's dict as `median (min-max)`; one sample alone marked `(n=1)`
    when `mark_single`, a section not run as `not run (why)`."""
    if not d or d.get("median") is None:
        return f"not run ({d['skipped']})" if d and d.get("skipped") else "-"
    med = fmt.format(d["median"] * scale)
    if d.get("n", 1) > 1:
        return f"{med} ({fmt.format(d['min'] * scale)}-{fmt.format(d['max'] * scale)})"
    return f"{med} (n=1)" if mark_single else med

"""The seam between the engine and the processes it decodes with.

A single process decodes alone (`LocalCoordinator`: every call is the
identity). Under `mlx.launch` every rank runs the same engine, and the
collectives inside the model only match if every rank admits, steps and
finishes the same sequences in the same order: the group's coordinator
(`mlx_kvq.distributed.coordinator`) makes rank 0's commands every rank's
commands, once per step, and agrees on the warm-up. The engine calls these
methods and nothing else; it never knows how many ranks there are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from .budget import Share
from .requests import GenerationRequest


@dataclass(frozen=True)
class StepCommands:
    """What one engine step applies: new requests, cancellations, and stop."""

    submits: tuple[GenerationRequest, ...] = ()
    cancels: frozenset[int] = frozenset()
    stop: bool = False

    def __bool__(self) -> bool:
        return bool(self.submits or self.cancels or self.stop)


@dataclass(frozen=True)
class RankStatus:
    """What a rank reports after each step."""

    kv_bytes: int = 0
    prompt_cache_bytes: int = 0


@dataclass(frozen=True)
class WarmupVerdict:
    """The outcome of a warm-up: this rank's, or the group's once agreed."""

    ok: bool
    report: dict[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class RankView:
    """One rank as `/metrics` shows it (group runs only)."""

    rank: int
    up: bool
    kv_bytes: int
    prompt_cache_bytes: int
    bytes_per_token: float
    warmup_kv_bytes: int


@dataclass(frozen=True)
class StopNotice:
    """What the engine tells its coordinator when it stops."""

    reason: str
    normal: bool = field(default=False)  # a requested stop, not a failure


class Coordinator(Protocol):
    """What the engine needs from the processes it decodes with."""

    @property
    def leader(self) -> bool:
        """Whether this process receives requests (rank 0, or the only process)."""

    def step(self, commands: StepCommands, status: RankStatus) -> StepCommands:
        """This step's commands on every rank (the leader's `commands`); blocks
        on followers until the leader calls."""

    def agree_warmup(self, mine: WarmupVerdict) -> WarmupVerdict:
        """The group's verdict on the warm-up, given this rank's."""

    def agree_budget(self, mine: Share) -> tuple[list[Share], int]:
        """Every rank's KV budget share, given this rank's, and this rank's index:
        the group admits a request only when every rank can hold it."""

    def stopping(self, notice: StopNotice) -> str:
        """The engine stops; returns the reason to give the requests still running."""

    def ranks(self) -> list[RankView]:
        """Per-rank figures for `/metrics` (empty for a single process)."""


class LocalCoordinator:
    """A single process: no group to agree with."""

    leader = True

    def step(self, commands: StepCommands, status: RankStatus) -> StepCommands:
        return commands

    def agree_warmup(self, mine: WarmupVerdict) -> WarmupVerdict:
        return mine

    def agree_budget(self, mine: Share) -> tuple[list[Share], int]:
        return [mine], 0

    def stopping(self, notice: StopNotice) -> str:
        return notice.reason

    def ranks(self) -> list[RankView]:
        return []

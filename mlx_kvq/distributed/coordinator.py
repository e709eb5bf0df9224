"""The engine's coordinator on every rank of a group, driven by rank 0.

`GroupCoordinator` implements the engine's `Coordinator` seam:

- `step`: one control collective per engine step hands rank 0's commands
  (new requests, cancels, stop) to every rank, and every rank's KV bytes to
  rank 0. All ranks then admit, step and finish the same sequences in the
  same order, which keeps the collectives inside the model matched.
- `agree_warmup`: every rank runs the warm-up; the group is ready only when
  every rank's passed.
- `agree_budget`: every rank learns every rank's KV budget share, so that all
  admit a request only when every rank can hold it, and all alike.
- `stopping`: a failure on any rank travels over the heartbeat channel.
- `on_rank_lost`: the heartbeat watchdog on rank 0 calls it when a rank is
  lost; it fails the engine (503 with the reason) and every request at once,
  even while the engine thread is stuck in a collective with the dead rank.

Followers (rank > 0) answer no HTTP: their engine has no inbox.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from ..engine import (
    BudgetShare,
    Engine,
    RankStatus,
    RankView,
    StepCommands,
    StopNotice,
    WarmupVerdict,
)
from .group import exchange, gather_json, world
from .heartbeat import Heartbeat, RankLoss
from .wire import LocalFields, decode, encode

log = logging.getLogger("mlx_kvq.distributed")

# Fields of the step's messages that stay on rank 0, with the reason. Every
# other field crosses to the other ranks (`wire.encode` raises on a value that
# cannot), and tests/test_distributed_units.py checks each one arrives.
LOCAL_ONLY: LocalFields = {}

LOST_GRACE_S = 3.0  # how long an engine error waits for the watchdog to name a lost rank


def commands_payload(commands: StepCommands) -> bytes:
    """Rank 0's step commands for the other ranks: every field of every
    request (the same prompt, sampling settings and checkpoints on every rank
    mean the same model calls, so matched collectives), less `LOCAL_ONLY`."""
    return json.dumps(encode(commands, LOCAL_ONLY)).encode()


def commands_from_payload(payload: bytes) -> StepCommands:
    return decode(StepCommands, json.loads(payload), LOCAL_ONLY)


class GroupCoordinator:
    """See the module docstring."""

    def __init__(self, heartbeat: Heartbeat, rank_infos: list[dict[str, Any]],
                 step_timeout: float | None = None):  # fmt: skip
        g = world()
        self.rank, self.size = g.rank(), g.size()
        self.heartbeat = heartbeat
        self.rank_infos = rank_infos
        self.rank_kv = [0] * self.size  # live KV bytes per rank, as of the last step
        self.rank_prompt_cache = [0] * self.size  # prompt-cache bytes per rank, likewise
        self.rank_warmup: list[dict | None] = [None] * self.size
        self.stopped_normally = False
        self._engine: Engine | None = None
        self._group_failed: str | None = None
        self._group_lost = threading.Event()
        self._busy_since: float | None = time.monotonic()  # the warm-up starts the clock
        if self.rank == 0:
            heartbeat.set_on_lost(self.on_rank_lost)
            heartbeat.progress = self.busy_seconds
            heartbeat.step_timeout = step_timeout
        else:
            heartbeat.set_on_lost(self._leader_lost)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def bind(self, engine: Engine) -> None:
        """The engine this coordinator serves (the watchdog fails it)."""
        self._engine = engine

    # ------------------------------------------------------------ the seam
    def step(self, commands: StepCommands, status: RankStatus) -> StepCommands:
        self._busy_since = time.monotonic()
        payload = b""
        if self.rank == 0 and commands:
            payload = commands_payload(commands)
        if commands.stop:
            self._stop_normally()
        headers, payload = exchange([0, status.kv_bytes, status.prompt_cache_bytes], payload)
        self.rank_kv = [h[1] for h in headers]
        self.rank_prompt_cache = [h[2] for h in headers]
        if self.rank == 0 or not payload:
            return commands
        cmd = commands_from_payload(payload)
        if cmd.stop:
            self._stop_normally()
        return cmd

    def agree_warmup(self, mine: WarmupVerdict) -> WarmupVerdict:
        batch = (mine.report or {}).get("batch")
        everyone = gather_json({
            "ok": mine.ok,
            "error": mine.error,
            "batch": batch,
            "kv_bytes": sum(k["nbytes"] for k in (batch or {}).values()),
        })  # fmt: skip
        self._busy_since = None
        self.rank_warmup = everyone
        failed = [(r, w["error"]) for r, w in enumerate(everyone) if not w["ok"]]
        if failed:
            reason = "warm-up failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed)
            return WarmupVerdict(False, error=reason)
        keys = ("rank", "mode", "layers", "kv_heads", "bytes_per_token")
        report = dict(mine.report or {})
        report["ranks"] = [
            {**{k: self.rank_infos[r].get(k) for k in keys}, "batch": w["batch"],
             "kv_bytes": w["kv_bytes"]}
            for r, w in enumerate(everyone)
        ]  # fmt: skip
        return WarmupVerdict(True, report=report)

    def agree_budget(self, mine: BudgetShare) -> tuple[list[BudgetShare], int]:
        everyone = gather_json(mine.to_dict())
        return [BudgetShare.from_dict(d) for d in everyone], self.rank

    def stopping(self, notice: StopNotice) -> str:
        self._busy_since = None
        if notice.normal or self.stopped_normally:
            return notice.reason
        if self.rank == 0 and self._group_failed is None:
            # A collective that failed because a peer died (the ring backend raises
            # on a closed link) races the watchdog: give it a moment to name the rank.
            self._group_lost.wait(LOST_GRACE_S)
        if self._group_failed is not None:
            return self._group_failed
        # this rank's own failure: make sure the other end hears why
        self.heartbeat.report_fatal(
            notice.reason if self.rank == 0 else f"rank {self.rank}: {notice.reason}"
        )
        return notice.reason

    def ranks(self) -> list[RankView]:
        return [
            RankView(
                rank=r,
                up=self.heartbeat.up(r) and self._group_failed is None,
                kv_bytes=self.rank_kv[r],
                prompt_cache_bytes=self.rank_prompt_cache[r],
                bytes_per_token=float(self.rank_infos[r].get("bytes_per_token") or 0),
                warmup_kv_bytes=int((self.rank_warmup[r] or {}).get("kv_bytes", 0)),
            )
            for r in range(self.size)
        ]

    # ------------------------------------------------------------ watchdog side
    def busy_seconds(self) -> float | None:
        """Seconds the engine has spent in its current step (None: idle or stopped)."""
        t = self._busy_since
        if t is None or self._engine is None or not self._engine.alive:
            return None
        return time.monotonic() - t

    def on_rank_lost(self, loss: RankLoss) -> None:
        """Rank 0: a rank is lost. Fail readiness and every request, for good."""
        if self._group_failed is not None or self.stopped_normally:
            return
        who = "the group" if loss.rank is None else f"rank {loss.rank} of {self.size}"
        what = f"{who} failed ({loss.reason})" if loss.reported else f"{who} is lost: {loss.reason}"
        message = f"{what}; the group cannot serve until all ranks are restarted"
        self._group_failed = message
        self._group_lost.set()
        log.error("%s", message)
        if self._engine is not None:
            self._engine.fail(message)
        self.heartbeat.report_fatal(message)

    def _leader_lost(self, loss: RankLoss) -> None:
        """Followers: rank 0 is gone, nothing left to serve."""
        if self.stopped_normally:
            os._exit(0)
        log.error("rank %d: rank 0 is lost (%s); exiting", self.rank, loss.reason)
        print(f"mlx-kvq serve: rank {self.rank}: rank 0 is lost ({loss.reason}); exiting",
              flush=True)  # fmt: skip
        os._exit(3)

    def _stop_normally(self) -> None:
        self.stopped_normally = True
        self.heartbeat.stopping()

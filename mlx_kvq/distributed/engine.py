"""The serving engine on every rank of a group, driven by rank 0.

`DistributedEngine` is the single-process `Engine` with four seams replaced:

- `_take_inbox`: rank 0 drains its HTTP inbox as usual, then one control
  collective per step hands the step's commands (new requests, cancels,
  stop) to every rank, and every rank's KV bytes to rank 0. All ranks then
  admit, step and finish the same sequences in the same order, which keeps
  the collectives inside the model matched.
- `_warmup`: every rank runs the warm-up; readiness on rank 0 turns ready
  only after all ranks report that theirs passed.
- `_shutdown`: a failure on any rank travels over the heartbeat channel.
- `fail_group`: called by the heartbeat watchdog on rank 0 when a rank is
  lost; fails readiness (503 with the reason) and every in-flight request.

Followers (rank > 0) answer no HTTP; their sinks discard events.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import asdict
from typing import Any

from ..engine.engine import IDLE_POLL_S, Engine
from ..engine.requests import ErrorEvent, GenerationRequest, SamplingParams
from ..engine.warmup import Readiness, ReadinessState
from .group import exchange, gather_json, world

log = logging.getLogger("mlx_kvq.distributed")

NORMAL_STOP = "server is shutting down"
LOST_GRACE_S = 3.0  # how long an engine error waits for the watchdog to name a lost rank


class GroupReadiness(Readiness):
    """Readiness that stays "warming_up" until the whole group passed.

    The base warm-up calls `set_ready` when this rank's warm-up passed; that
    report is held until `release` (every rank passed). Failures show at once.
    """

    def __init__(self) -> None:
        super().__init__()
        self._held = True
        self.held_report: dict | None = None

    def set_ready(self, report: dict[str, Any]) -> None:
        if self._held:
            self.held_report = report
            return
        super().set_ready(report)

    def release(self, report: dict[str, Any]) -> None:
        self._held = False
        super().set_ready(report)


def _discard(_event: Any) -> None:
    """Followers' sink: the client talks to rank 0 only."""


class DistributedEngine(Engine):
    """See the module docstring."""

    def __init__(self, *args: Any, heartbeat: Any, rank_infos: list[dict], shard: Any,
                 step_timeout: float | None = None, **kwargs: Any):  # fmt: skip
        super().__init__(*args, **kwargs)
        g = world()
        self.rank, self.size = g.rank(), g.size()
        self.readiness = GroupReadiness()
        self.heartbeat = heartbeat
        self.rank_infos = rank_infos
        self.shard = shard
        self.rank_kv = [0] * self.size  # live KV bytes per rank, as of the last step
        self.rank_prompt_cache = [0] * self.size  # prompt-cache bytes per rank, likewise
        self.rank_warmup: list[dict | None] = [None] * self.size
        self._local_kv = 0
        self._group_failed: str | None = None
        self._group_lost = threading.Event()
        self._stopped_normally = False
        self._busy_since: float | None = None
        if self.rank == 0:
            heartbeat.set_on_lost(self.fail_group)
            heartbeat.progress = self.busy_seconds
            heartbeat.step_timeout = step_timeout
        else:
            heartbeat.set_on_lost(self._leader_lost)

    # ------------------------------------------------------------ watchdog side
    def busy_seconds(self) -> float | None:
        """Seconds the engine thread has spent in the current step (None: idle/stopped)."""
        t = self._busy_since
        if t is None or not self.alive:
            return None
        return time.monotonic() - t

    def fail_group(self, rank: int | None, reason: str) -> None:
        """Rank 0: a rank is lost. Fail readiness and every request, for good."""
        who = "the group" if rank is None else f"rank {rank} of {self.size}"
        if reason.startswith("failed: "):  # the rank said why before stopping
            what = f"{who} failed ({reason[len('failed: ') :]})"
        else:
            what = f"{who} is lost: {reason}"
        message = f"{what}; the group cannot serve until all ranks are restarted"
        if self._group_failed is not None or self._stopped_normally:
            return
        self._group_failed = message
        self._group_lost.set()
        self.readiness.set_failed(message)  # the reason, even over an earlier engine error
        log.error("%s", message)
        self.heartbeat.report_fatal(message)
        self._shutdown(message)

    def _leader_lost(self, rank: int | None, reason: str) -> None:
        """Followers: rank 0 is gone, nothing left to serve."""
        if self._stopped_normally:
            os._exit(0)
        log.error("rank %d: rank 0 is lost (%s); exiting", self.rank, reason)
        print(f"mlx-kvq serve: rank {self.rank}: rank 0 is lost ({reason}); exiting", flush=True)
        os._exit(3)

    # ------------------------------------------------------------ engine seams
    def _take_inbox(self, block: bool) -> bool:
        self._busy_since = time.monotonic()
        submits: list[tuple[GenerationRequest, Any]] = []
        cancels: set[int] = set()
        stop = False
        payload = b""
        if self.rank == 0:
            items = []
            try:
                items.append(
                    self._inbox.get(timeout=IDLE_POLL_S) if block else self._inbox.get_nowait()
                )
                while True:
                    items.append(self._inbox.get_nowait())
            except queue.Empty:
                pass
            for item in items:
                if stop:  # queued behind the stop: refuse, as a single process would
                    if item[0] == "submit":
                        item[2](ErrorEvent(NORMAL_STOP, 503, "engine_unavailable"))
                    continue
                if item[0] == "stop":
                    stop = True
                elif item[0] == "submit":
                    submits.append((item[1], item[2]))
                else:
                    cancels.add(item[1])
            if submits or cancels or stop:
                payload = json.dumps({
                    "submit": [
                        {"id": r.id, "prompt": list(r.prompt), "params": asdict(r.params)}
                        for r, _ in submits
                    ],
                    "cancel": sorted(cancels),
                    "stop": stop,
                }).encode()  # fmt: skip
            if stop:
                self._stopped_normally = True
                self.heartbeat.stopping()
        headers, payload = exchange([0, self._local_kv, self.prompt_cache.nbytes], payload)
        self.rank_kv = [h[1] for h in headers]
        self.rank_prompt_cache = [h[2] for h in headers]
        if self.rank != 0 and payload:
            cmd = json.loads(payload)
            for s in cmd["submit"]:
                params = dict(s["params"])
                params["stop"] = tuple(params.get("stop") or ())
                submits.append(
                    (GenerationRequest(s["prompt"], SamplingParams(**params), s["id"]), _discard)
                )
            cancels = set(cmd["cancel"])
            stop = cmd["stop"]
            if stop:
                self._stopped_normally = True
                self.heartbeat.stopping()
        for req, sink in submits:
            self._accept(req, sink)
        if cancels:
            self._cancel(cancels)
        return not stop

    def _publish(self) -> None:
        super()._publish()
        self._local_kv = int(sum(self.metrics.kv_bytes_by_kind.values()))

    def _warmup(self) -> bool:
        self._busy_since = time.monotonic()
        try:
            ok = super()._warmup()
        except Exception as e:  # this rank cannot follow the group's collectives any more
            log.exception("warm-up failed")
            self._shutdown(f"warm-up failed: {type(e).__name__}: {e}")  # tells the group why
            return False
        if not ok and self._stopping.is_set():
            return False
        state: ReadinessState = self.readiness.get()
        report = self.readiness.held_report
        mine = {
            "ok": bool(ok),
            "error": None if ok else (state.reason or "warm-up failed"),
            "batch": (report or {}).get("batch"),
            "kv_bytes": sum(k["nbytes"] for k in ((report or {}).get("batch") or {}).values()),
        }
        everyone = gather_json(mine)
        self._busy_since = None
        self.rank_warmup = everyone
        failed = [(r, w["error"]) for r, w in enumerate(everyone) if not w["ok"]]
        if failed:
            reason = "warm-up failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed)
            if self.readiness.get().status != "failed":
                self._shutdown(reason)
            return False
        report = dict(report or {})
        report["ranks"] = [
            {**{k: self.rank_infos[r].get(k) for k in ("rank", "mode", "layers", "kv_heads",
                                                       "bytes_per_token")},
             "batch": w["batch"], "kv_bytes": w["kv_bytes"]}
            for r, w in enumerate(everyone)
        ]  # fmt: skip
        self.readiness.release(report)
        return True

    def _shutdown(self, reason: str) -> None:
        if (
            self.rank == 0
            and reason != NORMAL_STOP
            and not self._stopped_normally
            and self._group_failed is None
        ):
            # A collective that failed because a peer died (the ring backend raises
            # on a closed link) races the watchdog: give it a moment to name the rank.
            self._group_lost.wait(LOST_GRACE_S)
        super()._shutdown(self._group_failed or reason)
        self._busy_since = None
        if reason == NORMAL_STOP or self._stopped_normally:
            return
        if self._group_failed is None:
            # this rank's own failure: make sure the other end hears why
            self.heartbeat.report_fatal(reason if self.rank == 0 else f"rank {self.rank}: {reason}")

    def _accept(self, req: GenerationRequest, sink: Any) -> None:
        if self._group_failed is not None:
            sink(ErrorEvent(self._group_failed, 503, "engine_unavailable"))
            return
        super()._accept(req, sink)

    # ------------------------------------------------------------ metrics
    def extra_metrics(self):
        """Per-rank families for `/metrics` (rank 0)."""
        from prometheus_client.core import GaugeMetricFamily

        P = "mlx_kvq_"
        ranks = GaugeMetricFamily(P + "distributed_ranks", "Ranks in the mlx.distributed group")
        ranks.add_metric([], float(self.size))
        yield ranks

        def per_rank(name: str, text: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(P + name, text, labels=["rank"])

        up = per_rank("rank_up", "1 while the rank answers heartbeats")
        live = per_rank("rank_kv_bytes", "KV cache bytes held by live sequences on each rank")
        bpt = per_rank("rank_kv_bytes_per_token", "Planned KV bytes per token on each rank")
        cached = per_rank(
            "rank_prompt_cache_bytes", "KV bytes held by the prompt cache on each rank"
        )
        warm = per_rank("rank_warmup_kv_bytes", "KV bytes of the warm-up batch on each rank")
        for r in range(self.size):
            label = [str(r)]
            up.add_metric(label, float(self.heartbeat.up(r) and self._group_failed is None))
            live.add_metric(label, float(self.rank_kv[r]))
            cached.add_metric(label, float(self.rank_prompt_cache[r]))
            bpt.add_metric(label, float(self.rank_infos[r].get("bytes_per_token") or 0))
            w = self.rank_warmup[r]
            warm.add_metric(label, float(w["kv_bytes"] if w else 0))
        yield up
        yield live
        yield cached
        yield bpt
        yield warm

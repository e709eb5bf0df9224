"""The disk tier's writer: one thread, a queue bounded in bytes, never waited on.

The engine thread hands it files to write (`WriteJob`: the arrays already
copied out of the caches and evaluated) and files to touch; `offer`
returns at once, False when the queue's bytes would pass its bound (the
file is not written, and the count says so). The writer, per file, takes
the directory's lock, counts the directory again if another server changed
it, evicts least recently used records until the file fits under the cap,
writes it atomically (`records.write_record`) and indexes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from .directory import DiskDirectory, EntryInfo
from .records import Skip, encode, write_record

log = logging.getLogger("mlx_kvq.engine")

QUEUE_BYTES = 128 << 20  # what the writer's queue may hold (copies of caches waiting)
QUEUE_FILES = 4096  # and how many files or touches


@dataclass(frozen=True)
class WriteJob:
    """One file to write: a record at `path` (an entry's `info` to index)."""

    path: Path
    header: dict[str, Any]
    tensors: tuple[tuple[str, mx.array], ...]
    nbytes: int
    info: EntryInfo | None = None


@dataclass(frozen=True)
class TouchJob:
    paths: tuple[Path, ...]


@dataclass(frozen=True)
class WriterCounts:
    writes: int
    bytes_written: int
    skips: dict[str, int]
    queued_bytes: int


class DiskWriter:
    """The writer thread; see the module docstring."""

    def __init__(
        self,
        directory: DiskDirectory,
        bound: int = QUEUE_BYTES,
        gate: str | None = None,
    ):
        self.directory = directory
        self.bound = bound
        self.gate = gate  # tests: each write waits halfway until this file exists
        self._queue: deque[WriteJob | TouchJob] = deque()
        self._queued = 0
        self._pending: set[Path] = set()
        self._cond = threading.Condition()
        self._closing = False
        self._writes = self._bytes = 0
        self.skips: Counter[str] = Counter()
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="mlx-kvq-disk-writer", daemon=True)
        self._thread.start()

    # -- the engine thread ---------------------------------------------------------
    def pending(self, path: Path) -> bool:
        """Whether `path` waits in the queue."""
        with self._cond:
            return path in self._pending

    def room(self) -> int:
        with self._cond:
            return max(0, self.bound - self._queued)

    def offer(self, job: WriteJob) -> bool:
        """Queue `job`; False (and counted) when the queue cannot take its bytes."""
        with self._cond:
            full = self._queued + job.nbytes > self.bound or len(self._queue) >= QUEUE_FILES
            if self._closing or full:
                self.skips[Skip.QUEUE_FULL.value] += 1
                return False
            self._queue.append(job)
            self._queued += job.nbytes
            self._pending.add(job.path)
            self._cond.notify()
        return True

    def touch(self, paths: list[Path]) -> None:
        if not paths:
            return
        with self._cond:
            if not self._closing and len(self._queue) < QUEUE_FILES:
                self._queue.append(TouchJob(tuple(paths)))
                self._cond.notify()

    def count(self, reason: Skip) -> None:
        with self._cond:
            self.skips[reason.value] += 1

    def counts(self) -> WriterCounts:
        with self._cond:
            return WriterCounts(self._writes, self._bytes, dict(self.skips), self._queued)

    def flush(self, timeout: float) -> bool:
        """Wait until the queue is written (at most `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float) -> None:
        """Write what is queued (within `timeout`), then stop."""
        done = self.flush(timeout)
        with self._cond:
            self._closing = True
            left = len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        if not done:
            log.warning("prompt cache dir: %d queued file(s) not written at shutdown", left)
        self._thread.join(1.0)

    # -- the writer thread -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing and not self._queue:
                    return
                job = self._queue.popleft()
                self._busy = True
            try:
                if isinstance(job, TouchJob):
                    self.directory.touch(list(job.paths))
                else:
                    self._write(job)
            except Exception:  # noqa: BLE001 - the writer goes on; the file is not there
                log.exception("prompt cache dir: writing failed")
            finally:
                with self._cond:
                    self._busy = False
                    if isinstance(job, WriteJob):
                        self._queued -= job.nbytes
                        self._pending.discard(job.path)
                    self._cond.notify_all()

    def _write(self, job: WriteJob) -> None:
        d = self.directory
        record = encode(job.header, job.tensors)
        with d.locked():
            d.refresh()
            if job.path.exists():  # another server wrote it meanwhile
                d.touch([job.path])
                return
            if not d.reserve(record.nbytes):
                self.count(Skip.TOO_LARGE)
                return
            try:
                job.path.parent.mkdir(parents=True, exist_ok=True)
                written = write_record(job.path, record, self._pause())
            except OSError as e:
                self.count(Skip.WRITE_ERROR)
                log.warning("prompt cache dir: %s not written: %s", job.path.name, e)
                return
            info = None if job.info is None else replace(job.info, nbytes=written)
            d.added(job.path, written, info)
        with self._cond:
            self._writes += 1
            self._bytes += written

    def _pause(self) -> Callable[[], None] | None:
        gate = self.gate
        if gate is None:
            return None

        def wait() -> None:
            Path(gate + ".waiting").touch()
            while not Path(gate).exists() and not self._closing:
                time.sleep(0.02)

        return wait


__all__ = ["QUEUE_BYTES", "DiskWriter", "TouchJob", "WriteJob", "WriterCounts"]

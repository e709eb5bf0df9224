"""The models one server holds: which names reach which model, which are
resident, and the one memory budget their weights and KV caches share.

A model is declared at startup (`--model`, repeated, or `--models-file`: a
name, aliases, its own flags, pinned or not) or named by a request (a path,
GGUF file or repo, as mlx_lm.server loads them: `Loader.named`). The first
request for a model that is not resident loads it on the pool's loader
thread, one load at a time, through the steps the server's first model
takes: the loader prices it first (`Loader.prepare`: the weights' bytes
from their shapes, before any is read, and the KV budget its engine will
admit within), room is made, then it is loaded, planned, validated and
warmed up through its quantized batch path (`Prepared.finish`), and only
then serves. Requests that arrive meanwhile wait for the same load (it runs
once); requests to resident models go on, each model has its own engine
thread.

The budget: a resident model holds its weights and its KV budget (its
engine admits and preempts its requests within that, as a single-model
server does), and a load reserves both before its weights are read, so
that what resident and loading models hold never exceeds the budget. A load
that does not fit evicts idle (no request in flight), unpinned models,
least recently used first: their engine is drained and stopped (the prompt
cache's disk tier, when on, already holds every entry, written through, and
is flushed). When nothing can be evicted the load waits up to `wait_s` for
a model to become idle, then fails with 503 and Retry-After. A model that
can never fit beside the pinned ones, or cannot be loaded, fails its
requests with a 4xx naming it and the reason; other models are untouched.

A request holds a `Lease` on its model from the moment it is routed until
its answer ends: a leased model is never evicted.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx

from mlx_kvq.engine import Engine, ReadinessState, Status
from mlx_kvq.engine.budget import format_bytes

log = logging.getLogger("mlx_kvq.server")

DEFAULT_MODEL_ALIAS = "default_model"  # what clients written for mlx_lm.server send
DEFAULT_WAIT_S = 60.0  # how long a load waits for a resident model to become idle
RETRY_AFTER_S = 5  # what a request refused for want of room is told to wait
READY_POLL_S = 0.1  # how often a load waiting for a warm-up looks at whether the pool closed


class ModelState(str, Enum):
    """Where a model is, as `/health` and `/v1/models` report it."""

    AVAILABLE = "available"  # declared or loaded once, not in memory
    LOADING = "loading"  # being loaded, planned and warmed up
    READY = "ready"  # resident: serves requests
    EVICTING = "evicting"  # leaving memory
    FAILED = "failed"  # the last load failed (`reason`); the next request tries again


class Refusal(str, Enum):
    """Why a model cannot serve a request now; the value is the error's code."""

    NOT_FOUND = "model_not_found"  # no such model (404)
    NOT_LOADABLE = "model_not_loadable"  # it cannot be loaded, planned or warmed up (400)
    TOO_LARGE = "model_too_large"  # it can never fit the memory budget (400)
    BUSY = "model_busy"  # no room now: every other model is in use (503, Retry-After)
    SHUTTING_DOWN = "shutting_down"  # the server is going away (503)

    @property
    def status(self) -> int:
        return _STATUS[self]


_STATUS = {
    Refusal.NOT_FOUND: 404,
    Refusal.NOT_LOADABLE: 400,
    Refusal.TOO_LARGE: 400,
    Refusal.BUSY: 503,
    Refusal.SHUTTING_DOWN: 503,
}


_TRANSIENT = (Refusal.BUSY, Refusal.SHUTTING_DOWN)  # refusals that say nothing of the model


class ModelUnavailable(Exception):
    """A request's model cannot serve it; the message names the model and why."""

    def __init__(self, model: str, refusal: Refusal, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.model = model
        self.refusal = refusal
        self.message = message
        self.retry_after = retry_after

    @property
    def status(self) -> int:
        return self.refusal.status


@dataclass(frozen=True)
class ModelEntry:
    """A model the server may serve: declared at startup, or named by a request."""

    name: str  # the id it is served and listed under
    location: str  # where it loads from (a path, GGUF file or repo), as given
    aliases: tuple[str, ...] = ()  # other names requests may use
    pinned: bool = False  # never evicted
    declared: bool = True  # False: named by a request, not declared
    options: Any = None  # the loader's settings for it (the command line's flags)


@dataclass(frozen=True)
class Footprint:
    """What a resident model holds against the budget: its weights and its KV budget."""

    weights: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv

    def describe(self) -> str:
        return (
            f"{format_bytes(self.total)} ({format_bytes(self.weights)} of weights and a KV "
            f"budget of {format_bytes(self.kv)})"
        )


@dataclass(frozen=True, eq=False)
class Loaded:
    """A model in memory: its engine (started) and what the HTTP layer serves it
    with; one model's load is equal to itself only (a key for what is made of it)."""

    engine: Engine
    served: Any  # the HTTP layer's settings for it (`server.settings.ServerSettings`)


class Prepared(Protocol):
    """A model priced and ready to load: nothing of its weights read yet."""

    footprint: Footprint

    def finish(self) -> Loaded:
        """Load, plan, validate and start its engine (warming up), with its
        tokenizer; raises ValueError or FileNotFoundError naming what is refused."""

    def discard(self) -> None:
        """Drop what `prepare` made (the load is not going ahead)."""


class Loader(Protocol):
    """How models are found and loaded: given by the command line."""

    def named(self, name: str, hub: bool) -> ModelEntry | None:
        """The undeclared model a request names (a path, a GGUF file, a repo
        when `hub`), or None: no model goes by that name."""

    def prepare(self, entry: ModelEntry) -> Prepared:
        """Price `entry` (ValueError or FileNotFoundError when it cannot be served)."""


@dataclass(frozen=True)
class ModelView:
    """One model as reported: where it is, what it holds, how often it moved."""

    name: str
    location: str
    aliases: tuple[str, ...]
    state: ModelState
    reason: str | None
    pinned: bool
    declared: bool
    default: bool
    footprint: Footprint | None  # what it holds or reserves against the budget
    requests: int  # requests routed to it and not yet answered
    loads: int
    evictions: int
    load_seconds: float | None  # its last load, from the first request to ready
    loaded: Loaded | None


class _Slot:
    """One model's place in the pool (changed under the pool's lock)."""

    def __init__(self, entry: ModelEntry):
        self.entry = entry
        self.state = ModelState.AVAILABLE
        self.reason: str | None = None
        self.loaded: Loaded | None = None
        self.footprint: Footprint | None = None
        self.leases = 0
        self.used = 0  # when it was last leased (a tick: least recently used goes first)
        self.loads = 0
        self.evictions = 0
        self.load_seconds: float | None = None
        self.loading: Future | None = None  # the load under way


def name_keys(name: str) -> list[str]:
    """The keys `name` is looked up by: itself, and the resolved path when it is one."""
    keys = [name]
    try:
        path = Path(name).expanduser()
        if path.exists():
            keys.append(str(path.resolve()))
    except (OSError, RuntimeError, ValueError):  # ValueError: a NUL byte in the name
        pass
    return keys


class Lease:
    """A request's hold on a resident model: released once its answer ends
    (any number of times; only the first counts)."""

    def __init__(self, pool: ModelPool, model: str, loaded: Loaded):
        self.model = model
        self.loaded = loaded
        self._pool = pool
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._pool._release(self.model)


class ModelPool:
    """The models of one server; see the module docstring."""

    def __init__(
        self,
        budget: int,
        loader: Loader | None = None,
        *,
        wait_s: float = DEFAULT_WAIT_S,
        retry_after: int = RETRY_AFTER_S,
    ):
        self.budget = budget
        self.loader = loader
        self.wait_s = wait_s
        self.retry_after = retry_after
        self.peak_held = 0  # the most bytes ever held and reserved together
        self.evictions = 0
        self._cond = threading.Condition()
        self._slots: dict[str, _Slot] = {}
        self._names: dict[str, str] = {}  # a name, alias or location -> the model's name
        self._default: str | None = None
        self._tick = itertools.count(1)
        self._closed: str | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="mlx-kvq-load")

    @classmethod
    def holding(cls, name: str, loaded: Loaded) -> ModelPool:
        """A pool of one model, resident, that loads nothing else (an app over
        one engine)."""
        pool = cls(0)
        pool.declare(ModelEntry(name, name))
        pool.adopt(name, loaded, Footprint(0, 0))
        return pool

    # ------------------------------------------------------------ models
    def declare(self, entry: ModelEntry) -> None:
        """Add a model (the first is the default); ValueError when one of its
        names is already another model's."""
        with self._cond:
            self._add(entry)

    def _add(self, entry: ModelEntry) -> None:
        names = (entry.name, *entry.aliases)
        if DEFAULT_MODEL_ALIAS in names:
            raise ValueError(
                f"'{DEFAULT_MODEL_ALIAS}' names the default model; it cannot be declared"
            )
        for name in names:
            other = self._names.get(name)
            if other is not None:
                raise ValueError(
                    f"the name '{name}' is given to two models: '{other}' and '{entry.name}'"
                )
        self._slots[entry.name] = _Slot(entry)
        if self._default is None:
            self._default = entry.name
        for name in names:
            self._names[name] = entry.name
        for key in name_keys(entry.location):  # the first model from a place is its model
            self._names.setdefault(key, entry.name)

    def adopt(self, name: str, loaded: Loaded, footprint: Footprint) -> None:
        """`name`, loaded at startup, is resident (its engine may still warm up)."""
        with self._cond:
            slot = self._slots[name]
            slot.loaded, slot.footprint, slot.state = loaded, footprint, ModelState.READY
            slot.loads += 1
            slot.used = next(self._tick)
            self.peak_held = max(self.peak_held, self._held())

    @property
    def default(self) -> str:
        """The default model's name (what `default_model` reaches)."""
        assert self._default is not None, "no model declared"
        return self._default

    def lookup(self, name: str, hub: bool = True) -> str | None:
        """The model `name` reaches, by its name: a declared name or alias,
        `default_model`, where a model loads from (any spelling of the path),
        or an undeclared model the loader finds there (a repo id only when
        `hub`); None when no model goes by it."""
        known = self.known(name)
        if known is not None:
            return known
        entry = None if self.loader is None else self.loader.named(name, hub)
        if entry is None:
            return None
        with self._cond:
            if entry.name not in self._slots:
                self._add(entry)
            return entry.name

    def known(self, name: str) -> str | None:
        """The model `name` reaches among those the pool has (`lookup`
        without adding a model the loader finds)."""
        if name == DEFAULT_MODEL_ALIAS:
            return self.default
        keys = name_keys(name)
        with self._cond:
            return next((self._names[k] for k in keys if k in self._names), None)

    def names(self) -> list[str]:
        """Every model's name, the default first."""
        with self._cond:
            return list(self._slots)

    def views(self) -> list[ModelView]:
        """Every model as it is now, the default first."""
        with self._cond:
            return [self._view(s) for s in self._slots.values()]

    def view(self, name: str) -> ModelView:
        """Model `name` as it is now (KeyError: a name no model goes by)."""
        with self._cond:
            return self._view(self._slots[name])

    def _view(self, s: _Slot) -> ModelView:
        e = s.entry
        return ModelView(
            e.name, e.location, e.aliases, s.state, s.reason, e.pinned, e.declared,
            e.name == self._default, s.footprint, s.leases, s.loads, s.evictions,
            s.load_seconds, s.loaded,
        )  # fmt: skip

    def held(self) -> int:
        """Bytes the resident and loading models hold or have reserved."""
        with self._cond:
            return self._held()

    def _held(self) -> int:
        return sum(s.footprint.total for s in self._slots.values() if s.footprint is not None)

    # ------------------------------------------------------------ requests
    def claim(self, name: str) -> Lease | Future:
        """A lease on model `name` (as `lookup` returns it) when it is resident,
        else the future of its load (started now unless one is under way),
        which ends when it is ready or raises `ModelUnavailable`; claim again
        then. Raises `ModelUnavailable` when the pool is closed."""
        with self._cond:
            if self._closed is not None:
                raise ModelUnavailable(name, Refusal.SHUTTING_DOWN, self._closed, self.retry_after)
            slot = self._slots.get(name)
            if slot is None:  # a name a request made up, forgotten since its load failed
                raise ModelUnavailable(
                    name, Refusal.NOT_FOUND, f"model '{name}' could not be loaded"
                )
            if slot.state is ModelState.READY and slot.loaded is not None:
                slot.leases += 1
                slot.used = next(self._tick)
                return Lease(self, name, slot.loaded)
            if slot.loading is None:
                if self.loader is None:
                    raise ModelUnavailable(
                        name, Refusal.NOT_LOADABLE, f"model '{name}' is not loaded and this "
                        "server loads no model on request",
                    )  # fmt: skip
                slot.loading = Future()
                slot.loading.set_running_or_notify_cancel()  # no waiter can cancel the load
                if slot.state is not ModelState.EVICTING:
                    slot.state = ModelState.LOADING
                self._executor.submit(self._load, slot)
            return slot.loading

    def preload(self, name: str) -> Future | None:
        """Start loading `name` unless it is resident (pinned models, at startup)."""
        ticket = self.claim(name)
        if isinstance(ticket, Lease):
            ticket.release()
            return None
        return ticket

    def _release(self, name: str) -> None:
        with self._cond:
            slot = self._slots[name]
            slot.leases -= 1
            slot.used = next(self._tick)
            self._cond.notify_all()

    # ------------------------------------------------------------ loading
    def _load(self, slot: _Slot) -> None:
        """The loader thread's work for one model: bring it in, then settle its future."""
        t0 = time.monotonic()
        name = slot.entry.name
        try:
            if self._closed is not None:
                raise ModelUnavailable(name, Refusal.SHUTTING_DOWN, self._closed, self.retry_after)
            loaded = self._bring_in(slot)
        except ModelUnavailable as e:
            log.warning("model '%s' not loaded: %s", name, e.message)
            self._settle(slot, None, e, 0.0)
        except Exception as e:  # noqa: BLE001 - whatever it was, it fails this model only
            log.exception("loading model '%s' failed", name)
            error = ModelUnavailable(
                name, Refusal.NOT_LOADABLE,
                f"model '{name}' could not be loaded: {type(e).__name__}: {e}",
            )  # fmt: skip
            self._settle(slot, None, error, 0.0)
        else:
            seconds = time.monotonic() - t0
            log.info("model '%s' ready in %.2fs", name, seconds)
            self._settle(slot, loaded, None, seconds)

    def _bring_in(self, slot: _Slot) -> Loaded:
        entry = slot.entry
        name = entry.name
        assert self.loader is not None
        log.info("loading model '%s' from %s", name, entry.location)
        try:
            prepared = self.loader.prepare(entry)
        except FileNotFoundError as e:
            raise ModelUnavailable(name, Refusal.NOT_FOUND, f"model '{name}': {e}") from None
        except ValueError as e:
            raise ModelUnavailable(
                name, Refusal.NOT_LOADABLE, f"model '{name}' cannot be served: {e}"
            ) from None
        try:
            self._make_room(slot, prepared.footprint)
        except BaseException:
            prepared.discard()
            raise
        try:
            loaded = prepared.finish()
        except BaseException as e:
            prepared.discard()
            self._unreserve(slot)
            if isinstance(e, ValueError | FileNotFoundError):
                raise ModelUnavailable(
                    name, Refusal.NOT_LOADABLE, f"model '{name}' cannot be served: {e}"
                ) from None
            raise
        state = self._warmed_up(loaded.engine)
        if state.status is not Status.READY:
            loaded.engine.stop(timeout=None)  # MLX aborts an exit mid-evaluation
            self._unreserve(slot)
            if self._closed is not None:
                raise ModelUnavailable(name, Refusal.SHUTTING_DOWN, self._closed, self.retry_after)
            raise ModelUnavailable(
                name, Refusal.NOT_LOADABLE, f"model '{name}' failed its warm-up: {state.reason}"
            )
        return loaded

    def _warmed_up(self, engine: Engine) -> ReadinessState:
        """The engine's state once its warm-up ended (or the pool closed meanwhile)."""
        while not engine.readiness.ready_event.wait(READY_POLL_S):
            if self._closed is not None:
                engine.drain(self._closed)
                break
        return engine.state()

    def _settle(
        self, slot: _Slot, loaded: Loaded | None, error: ModelUnavailable | None, seconds: float
    ) -> None:
        with self._cond:
            future, slot.loading = slot.loading, None
            if loaded is not None:
                slot.loaded, slot.state, slot.reason = loaded, ModelState.READY, None
                slot.loads += 1
                slot.load_seconds = seconds
                slot.used = next(self._tick)
            else:  # no room now, or shutting down: not a failure of the model
                transient = error is not None and error.refusal in _TRANSIENT
                slot.state = ModelState.AVAILABLE if transient else ModelState.FAILED
                slot.reason = error.message if error is not None else None
                if not transient and not slot.entry.declared:
                    self._forget(slot)  # a name a request made up is not a model to list
            self._cond.notify_all()
        if future is not None:
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    def _forget(self, slot: _Slot) -> None:
        name = slot.entry.name
        del self._slots[name]
        for key in [k for k, v in self._names.items() if v == name]:
            del self._names[key]

    def _unreserve(self, slot: _Slot) -> None:
        with self._cond:
            slot.footprint = None
            self._cond.notify_all()

    def _make_room(self, slot: _Slot, need: Footprint) -> None:
        """Reserve `need` for `slot`, evicting idle unpinned models (least
        recently used first), waiting up to `wait_s` for one to become idle."""
        name = slot.entry.name
        deadline = time.monotonic() + self.wait_s
        while True:
            with self._cond:
                if self._closed is not None:
                    raise ModelUnavailable(
                        name, Refusal.SHUTTING_DOWN, self._closed, self.retry_after
                    )
                pinned = sum(
                    s.footprint.total for s in self._slots.values()
                    if s.entry.pinned and s.footprint is not None and s is not slot
                )  # fmt: skip
                if need.total > self.budget - pinned:
                    held = f", {format_bytes(pinned)} of it held by pinned models" if pinned else ""
                    raise ModelUnavailable(
                        name, Refusal.TOO_LARGE,
                        f"model '{name}' needs {need.describe()}, more than the memory budget "
                        f"of {format_bytes(self.budget)}{held} can ever give it; raise "
                        "--models-memory or give it a smaller --kv-cache-memory",
                    )  # fmt: skip
                if need.total <= self.budget - self._held():
                    slot.footprint = need
                    self.peak_held = max(self.peak_held, self._held())
                    return
                victim = self._victim(slot)
                if victim is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ModelUnavailable(
                            name, Refusal.BUSY, self._busy_message(name, need), self.retry_after
                        )
                    self._cond.wait(left)
                    continue
                victim.state = ModelState.EVICTING
                loaded = victim.loaded
            self._evict(victim, loaded, name)

    def _busy_message(self, name: str, need: Footprint) -> str:
        using = ", ".join(
            f"'{s.entry.name}' ({s.leases} request{'s' if s.leases != 1 else ''})"
            for s in self._slots.values()
            if s.footprint is not None and s.leases
        )
        return (
            f"model '{name}' needs {need.describe()} and the memory budget of "
            f"{format_bytes(self.budget)} is held by models in use ({using or 'loading'}) for "
            f"longer than {self.wait_s:g}s; retry later"
        )

    def _victim(self, loading: _Slot) -> _Slot | None:
        """The idle, unpinned resident model used least recently (None: none)."""
        idle = [
            s for s in self._slots.values()
            if s is not loading and s.state is ModelState.READY and s.loaded is not None
            and not s.entry.pinned and s.leases == 0
        ]  # fmt: skip
        return min(idle, key=lambda s: s.used, default=None)

    def _evict(self, slot: _Slot, loaded: Loaded | None, for_whom: str) -> None:
        """Stop `slot`'s engine and let its memory go (outside the lock)."""
        name = slot.entry.name
        log.info("evicting model '%s' to make room for '%s'", name, for_whom)
        if loaded is not None:
            loaded.engine.drain(f"model '{name}' was unloaded to make room for '{for_whom}'")
            loaded.engine.stop()
        with self._cond:
            slot.loaded = None
            slot.footprint = None
            slot.evictions += 1
            self.evictions += 1
            slot.state = ModelState.LOADING if slot.loading is not None else ModelState.AVAILABLE
            self._cond.notify_all()
        del loaded
        gc.collect()
        mx.clear_cache()

    # ------------------------------------------------------------ the end
    def drain(self, reason: str) -> None:
        """Every resident engine refuses new requests; those in flight run to the end."""
        for view in self.views():
            if view.loaded is not None:
                view.loaded.engine.drain(reason)

    def close(self, reason: str) -> None:
        """No more loads: later claims, and loads queued or under way (at their
        next step), fail with 503."""
        with self._cond:
            if self._closed is None:
                self._closed = reason
            self._cond.notify_all()
        self._executor.shutdown(wait=False)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop every resident engine (what runs is answered with an error)."""
        for view in self.views():
            if view.loaded is not None:
                view.loaded.engine.stop(timeout)


__all__ = [
    "DEFAULT_MODEL_ALIAS",
    "DEFAULT_WAIT_S",
    "Footprint",
    "Lease",
    "Loaded",
    "Loader",
    "ModelEntry",
    "ModelPool",
    "ModelState",
    "ModelUnavailable",
    "ModelView",
    "Prepared",
    "Refusal",
]

"""`ModelPool`: names, loads on request (one per model however many ask),
the one memory budget, eviction of idle unpinned models least recently used
first, and refusals that name the model. Engines and loads are stand-ins
here (tests/test_server_models.py runs real ones behind HTTP)."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import Future

import pytest

from mlx_kvq.engine import Readiness
from mlx_kvq.residency import (
    DEFAULT_MODEL_ALIAS,
    Footprint,
    Lease,
    Loaded,
    ModelEntry,
    ModelPool,
    ModelState,
    ModelUnavailable,
    Refusal,
)

MiB = 1 << 20


class StandInEngine:
    """What the pool asks of an engine: readiness, drain, stop."""

    def __init__(self, failure: str | None = None):
        self.readiness = Readiness()
        if failure is None:
            self.readiness.set_ready({})
        else:
            self.readiness.set_failed(failure)
        self.drained: str | None = None
        self.stopped = False

    def state(self):
        return self.readiness.get()

    def drain(self, reason: str) -> None:
        self.drained = reason

    def stop(self, timeout: float | None = 10.0) -> None:
        self.stopped = True


class StandInLoader:
    """Models of known sizes; `gates[name]` holds a load until set, `refuse`
    names models whose load is refused, `warmup_fails` whose warm-up fails."""

    def __init__(self, sizes: dict[str, int], *, refuse=(), warmup_fails=()):
        self.sizes = sizes
        self.refuse = set(refuse)
        self.warmup_fails = set(warmup_fails)
        self.gates: dict[str, threading.Event] = {}
        self.prepared: Counter[str] = Counter()
        self.engines: dict[str, list[StandInEngine]] = {}

    def named(self, name: str, hub: bool):
        if name.startswith("/undeclared/"):
            return ModelEntry(name, name, declared=False)
        return None

    def prepare(self, entry: ModelEntry):
        self.prepared[entry.name] += 1
        if entry.name in self.refuse:
            raise ValueError("config.json names model_type 'nonesuch', which mlx-lm lacks")
        loader = self

        class Prepared:
            footprint = Footprint(self.sizes.get(entry.name, 10 * MiB), 0)

            def finish(self) -> Loaded:
                gate = loader.gates.get(entry.name)
                if gate is not None:
                    assert gate.wait(30)
                failure = "boom" if entry.name in loader.warmup_fails else None
                engine = StandInEngine(failure)
                loader.engines.setdefault(entry.name, []).append(engine)
                return Loaded(engine, None)

            def discard(self) -> None:
                pass

        return Prepared()


def pool_of(sizes: dict[str, int], budget: int, *, pinned=(), wait_s: float = 0.0, **kw):
    loader = StandInLoader(sizes, **kw)
    pool = ModelPool(budget, loader, wait_s=wait_s)
    for name in sizes:
        pool.declare(ModelEntry(name, f"/models/{name}", pinned=name in pinned))
    return pool, loader


def lease(pool: ModelPool, name: str) -> Lease:
    """Claim `name`, waiting for its load."""
    for _ in range(3):
        ticket = pool.claim(name)
        if isinstance(ticket, Lease):
            return ticket
        ticket.result(30)
    raise AssertionError(f"{name} never became resident")


def use(pool: ModelPool, name: str) -> None:
    lease(pool, name).release()


def resident(pool: ModelPool) -> list[str]:
    return [v.name for v in pool.views() if v.state is ModelState.READY]


def test_a_load_that_does_not_fit_evicts_the_least_recently_used_idle_model():
    pool, loader = pool_of({"a": 40 * MiB, "b": 40 * MiB, "c": 40 * MiB}, 100 * MiB)
    use(pool, "a")
    use(pool, "b")
    use(pool, "a")  # b is now the least recently used
    assert resident(pool) == ["a", "b"] and pool.held() == 80 * MiB
    use(pool, "c")
    assert resident(pool) == ["a", "c"]
    b = pool.view("b")
    assert (b.state, b.evictions, b.footprint, b.loaded) == (ModelState.AVAILABLE, 1, None, None)
    assert (
        loader.engines["b"][0].stopped and "to make room for 'c'" in loader.engines["b"][0].drained
    )
    assert pool.evictions == 1 and pool.peak_held == 80 * MiB <= pool.budget
    use(pool, "b")  # back on request: a is least recently used now
    assert resident(pool) == ["b", "c"] and pool.view("b").loads == 2
    assert loader.prepared == {"a": 1, "b": 2, "c": 1}


def test_leased_and_pinned_models_stay_and_no_room_is_503_naming_the_model():
    pool, loader = pool_of(
        {"a": 50 * MiB, "b": 30 * MiB, "c": 40 * MiB, "d": 60 * MiB}, 100 * MiB, pinned=["a"]
    )
    use(pool, "a")
    held = lease(pool, "b")  # a request in flight on b
    with pytest.raises(ModelUnavailable) as e:
        pool.claim("c").result(30)
    assert (e.value.status, e.value.refusal, e.value.model) == (503, Refusal.BUSY, "c")
    assert "'c'" in e.value.message and "'b' (1 request)" in e.value.message
    assert e.value.retry_after == pool.retry_after > 0
    assert pool.view("c").state is ModelState.AVAILABLE and resident(pool) == ["a", "b"]
    with pytest.raises(ModelUnavailable) as e:  # beside pinned a, d can never fit
        pool.claim("d").result(30)
    assert (e.value.status, e.value.refusal) == (400, Refusal.TOO_LARGE)
    assert "'d'" in e.value.message and "held by pinned models" in e.value.message
    held.release()
    use(pool, "c")  # b is idle now: evicted, a (pinned) stays
    assert resident(pool) == ["a", "c"] and pool.peak_held <= pool.budget


def test_a_load_waits_for_a_model_to_become_idle():
    pool, _ = pool_of({"a": 60 * MiB, "b": 60 * MiB}, 100 * MiB, wait_s=30.0)
    held = lease(pool, "a")
    load = pool.claim("b")
    assert isinstance(load, Future) and not load.done()
    held.release()  # the waiting load evicts a now
    load.result(30)
    assert resident(pool) == ["b"] and pool.view("a").evictions == 1


def test_concurrent_claims_share_one_load():
    pool, loader = pool_of({"a": MiB, "b": MiB}, 100 * MiB)
    loader.gates["b"] = threading.Event()
    tickets = []
    threads = [threading.Thread(target=lambda: tickets.append(pool.claim("b"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(t) for t in tickets}) == 1 and pool.view("b").state is ModelState.LOADING
    assert not tickets[0].cancel()  # a waiter that leaves cannot cancel the others' load
    loader.gates["b"].set()
    tickets[0].result(30)
    leases = [lease(pool, "b") for _ in range(8)]
    assert pool.view("b").requests == 8 and loader.prepared["b"] == 1
    for held in leases:
        held.release()
        held.release()  # only the first release counts
    assert pool.view("b").requests == 0


def test_a_refused_load_names_the_model_leaves_the_others_and_is_tried_again():
    pool, loader = pool_of({"a": MiB, "bad": MiB, "cold": MiB}, 100 * MiB, refuse=["bad"],
                           warmup_fails=["cold"])  # fmt: skip
    use(pool, "a")
    for _ in range(2):
        with pytest.raises(ModelUnavailable) as e:
            pool.claim("bad").result(30)
        assert (e.value.status, e.value.refusal.value) == (400, "model_not_loadable")
        assert "model 'bad' cannot be served" in e.value.message and "nonesuch" in e.value.message
    assert loader.prepared["bad"] == 2 and pool.view("bad").state is ModelState.FAILED
    with pytest.raises(ModelUnavailable) as e:
        pool.claim("cold").result(30)
    assert e.value.message == "model 'cold' failed its warm-up: boom"
    assert loader.engines["cold"][0].stopped and pool.view("cold").footprint is None
    assert resident(pool) == ["a"] and pool.held() == MiB
    use(pool, "a")


def test_names_aliases_paths_and_undeclared_models():
    pool, _ = pool_of({"a": MiB}, 100 * MiB)
    pool.declare(ModelEntry("b", "/models/b", aliases=("claude-haiku",)))
    assert pool.lookup(DEFAULT_MODEL_ALIAS) == "a" == pool.default
    assert pool.lookup("claude-haiku") == pool.lookup("/models/b") == "b"
    assert pool.lookup("gpt-4o") is None
    assert pool.lookup("/undeclared/x") == "/undeclared/x"
    assert not pool.view("/undeclared/x").declared
    pool.loader.refuse.add("/undeclared/x")
    with pytest.raises(ModelUnavailable):
        pool.claim("/undeclared/x").result(30)
    assert pool.names() == ["a", "b"]  # a name a request made up that fails is not kept
    with pytest.raises(ValueError, match="'claude-haiku' is given to two models"):
        pool.declare(ModelEntry("c", "/models/c", aliases=("claude-haiku",)))
    with pytest.raises(ValueError, match="default_model"):
        pool.declare(ModelEntry(DEFAULT_MODEL_ALIAS, "/models/d"))


def test_a_closed_pool_refuses_with_503():
    pool, _ = pool_of({"a": MiB, "b": MiB}, 100 * MiB)
    use(pool, "a")
    pool.close("server is shutting down")
    for name in ("a", "b"):
        with pytest.raises(ModelUnavailable) as e:
            pool.claim(name)
        assert (e.value.status, e.value.refusal) == (503, Refusal.SHUTTING_DOWN)

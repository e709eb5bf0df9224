"""The memory accounting: what each sequence and the prompt cache hold, what is free.

With a KV budget, every admitted sequence holds a shape in the `Ledger`
(`budget.py`): its prompt, and the tokens it may reach before it next grows.
A sequence is admitted with its prompt and a small decode reserve
(`DECODE_RESERVE` tokens, never its `max_tokens`); as it decodes it grows,
another reserve at a time, when the bound of every rank still fits the
budget. The prompt cache holds what the sequences leave free and yields
first: its byte cap is the room the sequences leave (`room`), and in a
group every rank evicts alike, charging entries by their bound. After every
step the bytes the caches really hold are measured against the budget and
the bound (`Ledger.check`).

The scheduler asks `Memory` (admit, grow, release) and never sees bytes;
a paged layout replaces this module's pricing, not the scheduler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .budget import CostModel, Ledger, Shape, Verdict
from .prompt_cache import PromptCache
from .requests import Segment

log = logging.getLogger("mlx_kvq.engine")

DECODE_RESERVE = 32  # tokens a sequence is admitted with, and grows by, beyond what it holds


@dataclass(frozen=True)
class Need:
    """What one sequence asks of memory, in tokens."""

    request_id: int
    prompt: int  # its prompt (for a resumed sequence: the prompt and its tokens so far)
    context: int  # tokens its caches hold now
    step: int  # tokens the next step adds at most
    limit: int  # the most tokens it can reach (prompt + max_tokens)
    keep: int = 0  # rewound tokens it holds besides (the speculative lane)


class Memory(Protocol):
    """What the scheduler asks of the memory accounting."""

    def admit(self, need: Need) -> bool:
        """Book a new (or resumed) sequence's prompt and decode reserve if it fits."""

    def grow(self, need: Need) -> bool:
        """Make sure a running sequence holds its next step; False when that cannot fit."""

    def release(self, request_id: int, after_step: bool = False) -> None:
        """Free a sequence's share (`after_step`: once the next step has run)."""

    def prompt_done(self, request_id: int) -> None:
        """The sequence's prompt is processed."""

    def to_batch(self, request_id: int) -> None:
        """The lane's sequence moves into the batch (its draft caches are freed)."""


class KVMemory:
    """`Memory` over a `Ledger` (None: no budget, everything fits) and the prompt cache."""

    def __init__(
        self,
        ledger: Ledger | None,
        prompt_cache: PromptCache,
        *,
        prompt_cache_bytes: int | None = None,
        draft_cost: CostModel | None = None,
        live_bytes: Callable[[], int] = lambda: 0,
        cached_bytes: Callable[[], int] | None = None,
        lane_cost: CostModel | None = None,
        between_steps: Callable[[], None] = lambda: None,
        shared_prefix: Callable[[int], tuple[tuple[int, ...], int] | None] | None = None,
        reserve: int = DECODE_RESERVE,
    ):
        self.ledger = ledger
        self.prompt_cache = prompt_cache
        self.prompt_cache_bytes = prompt_cache_bytes
        self.draft_cost = draft_cost
        self.live_bytes = live_bytes
        self.lane_cost = lane_cost  # the model's caches on the lane, when priced apart
        # before measuring: give back storage nothing holds (the paged layout's pools)
        self.between_steps = between_steps
        # The paged layout: the prompt-cache prefix (key, whole blocks of tokens) a
        # waiting request will map by reference. Its blocks are priced once, however
        # many sequences map them, and each sequence for its own tokens only.
        self.shared_prefix = shared_prefix
        self._credit: dict[int, tuple[tuple[int, ...], int]] = {}
        self._pins: dict[tuple[int, ...], int] = {}
        # what the prompt cache holds beyond the live sequences (the paged
        # layout: its own caches, and pool blocks no live sequence refers to)
        self.cached_bytes = cached_bytes or (lambda: prompt_cache.nbytes)
        self.reserve = max(1, reserve)
        self.serving = False  # live sequences exist to cap the prompt cache by (mlx-lm's rule)

    # ------------------------------------------------------------ sequences
    def _shape(self, need: Need, total: int) -> tuple[Shape, int | None]:
        """The ledger's shape for `need` reaching `total` tokens (less a prefix it
        maps by reference), and the bytes its draft model's caches hold on the
        lane (None in the batch)."""
        shared = self._credit.get(need.request_id, ((), 0))[1]
        shape = Shape(need.prompt + need.keep, total + need.keep, shared)
        if not need.keep or self.draft_cost is None:
            return shape, None
        extra = self.draft_cost.bound([shape])
        if self.lane_cost is not None:
            # the lane runs the model's caches in their own layout, not in blocks
            batch = self.ledger.share.cost.bound([shape])
            extra += max(0, self.lane_cost.bound([shape]) - batch)
        return shape, extra

    def first_shape(self, need: Need) -> Shape:
        """What a sequence is admitted with: its prompt and the decode reserve."""
        return self._shape(need, self._first_total(need))[0]

    def _first_total(self, need: Need) -> int:
        return max(need.prompt + need.step, min(need.limit, need.prompt + self.reserve))

    @staticmethod
    def _pin_id(key: tuple[int, ...]) -> int:
        """The ledger's extras entry of a pinned prefix (never a request id)."""
        return -1 - (hash(key) & 0x7FFFFFFFFFFF)

    def admit(self, need: Need) -> bool:
        if self.ledger is None:
            return True
        prefix = None
        if not need.keep and self.shared_prefix is not None and not self.group:
            prefix = self.shared_prefix(need.request_id)
        pin = 0
        if prefix is not None:
            key, tokens = prefix
            self._credit[need.request_id] = prefix
            if key not in self._pins:
                pin = self.ledger.share.cost.bound([Shape(tokens, tokens)], [])
        shape, extra = self._shape(need, self._first_total(need))
        if not self.ledger.fits(shape, (extra or 0) + pin):
            self._credit.pop(need.request_id, None)
            return False
        self.ledger.reserve(need.request_id, shape, extra or 0)
        if prefix is not None:
            self._pins[prefix[0]] = self._pins.get(prefix[0], 0) + 1
            if pin:
                self.ledger.extras[self._pin_id(prefix[0])] = pin
        return True

    def grow(self, need: Need) -> bool:
        if self.ledger is None:
            return True
        held = self.ledger.shapes.get(need.request_id)
        if held is None:
            return True
        want = need.context + need.step
        if want + need.keep <= held.total:
            return True
        for total in dict.fromkeys((max(want, min(need.limit, need.context + self.reserve)), want)):
            shape, extra = self._shape(need, total)
            if self.ledger.grow(need.request_id, shape.total, extra):
                return True
        return False

    def release(self, request_id: int, after_step: bool = False) -> None:
        if self.ledger is not None:
            self.ledger.release(request_id, after_step)
        self.release_credit(request_id)

    def release_credit(self, request_id: int) -> None:
        """Drop a sequence's prefix credit (and the prefix's pin with its last user)."""
        prefix = self._credit.pop(request_id, None)
        if prefix is not None:
            self._pins[prefix[0]] -= 1
            if not self._pins[prefix[0]]:
                del self._pins[prefix[0]]
                if self.ledger is not None:
                    self.ledger.extras.pop(self._pin_id(prefix[0]), None)

    def prompt_done(self, request_id: int) -> None:
        if self.ledger is not None:
            self.ledger.prompt_done(request_id)

    def to_batch(self, request_id: int) -> None:
        if self.ledger is not None:
            self.ledger.drop_extra(request_id)
            self.ledger.prompting.add(request_id)

    def verdict(self, need: Need) -> Verdict | None:
        """Whether a request's prompt and decode reserve fit the budget even
        alone (None without a budget)."""
        if self.ledger is None:
            return None
        return self.ledger.verdict(self.first_shape(need))

    def clear(self) -> None:
        if self.ledger is not None:
            self.ledger.clear()
        self._credit.clear()
        self._pins.clear()

    # ------------------------------------------------------------ the prompt cache
    @property
    def group(self) -> bool:
        return self.ledger is not None and len(self.ledger.shares) > 1

    def cache_budget(self) -> int | None:
        """Prompt-cache byte cap left once live sequences are counted: mlx-lm's
        rule for --prompt-cache-bytes, and the room the KV budget leaves next to
        what the sequences hold (one process)."""
        caps = []
        if self.prompt_cache_bytes is not None and self.serving:
            caps.append(self.prompt_cache_bytes - self.live_bytes())
        if self.ledger is not None and not self.group:
            # a pinned prefix is priced in the ledger and held by its entry: once
            pinned = sum(self.ledger.extras.get(self._pin_id(k), 0) for k in self._pins)
            caps.append(self.ledger.room() + pinned)
        return min(caps) if caps else None

    def mapped(self, request_id: int, tokens: int) -> None:
        """The tokens a sequence really mapped by reference when it was inserted:
        if fewer than it was admitted with (its entry went in between), it is
        priced for what it holds (measured against the budget as ever)."""
        prefix = self._credit.get(request_id)
        if prefix is None or tokens >= prefix[1] or self.ledger is None:
            return
        self.release_credit(request_id)
        held = self.ledger.shapes.get(request_id)
        if held is not None:
            self.ledger.shapes[request_id] = Shape(held.prompt, held.total)

    def store_prompt(
        self, tokens: list[int], cache: list, segment: Segment = Segment.ANSWER
    ) -> bool:
        """Keep a sequence's cache in the prompt cache within the byte caps and
        the room the KV budget leaves; in a group, only once every rank has
        room for it by its bound (evicting the oldest entries first)."""
        if self.group and not self.yield_group(len(tokens)):
            return False
        stored = self.prompt_cache.insert(list(tokens), cache, self.cache_budget(), segment)
        self.measure()
        return stored

    def trim_prompt_cache(self) -> None:
        budget = self.cache_budget()
        if budget is not None:
            self.prompt_cache.trim_to(budget)
        if self.group:
            self.yield_group()

    def yield_group(self, extra_tokens: int | None = None) -> bool:
        """In a group, evict (oldest first) until every rank's prompt cache fits
        its room, with an entry of `extra_tokens` tokens added when given;
        entries are charged by their bound on each rank: measured bytes differ
        between ranks, and every rank must evict alike. False when the extra
        entry does not fit even with the prompt cache empty."""
        ledger = self.ledger
        shares = ledger.shares
        rooms = [ledger.room(r) for r in range(len(shares))]
        extra = [0 if extra_tokens is None else s.cost.entry_bytes(extra_tokens) for s in shares]
        if any(e > room for e, room in zip(extra, rooms, strict=True)):
            return False
        while len(self.prompt_cache):
            counts = self.prompt_cache.token_counts()
            if all(
                e + sum(s.cost.entry_bytes(n) for n in counts) <= room
                for s, e, room in zip(shares, extra, rooms, strict=True)
            ):
                break
            self.prompt_cache.evict_oldest()
        return True

    # ------------------------------------------------------------ measuring
    def settle(self) -> None:
        """After a step: free the shares of rows the step took out, let the
        prompt cache yield to what is left, and measure."""
        if self.ledger is None:
            return
        self.ledger.settle()
        self.trim_prompt_cache()
        self.measure()

    def measure(self) -> None:
        """Measure what the caches hold (live sequences and prompt cache: their
        `nbytes`) against the budget and the bound of the admitted sequences.
        Called wherever the bytes held can grow: after a step, after admitting
        requests (a reused prompt-cache entry is copied) and after a prompt
        cache insertion."""
        self.between_steps()
        if self.ledger is None or not self.serving:
            return
        live = self.live_bytes()
        held = self.cached_bytes()
        if not self.ledger.check(live, held):
            log.error(
                "KV budget exceeded: live %d + prompt cache %d bytes, budget %d, "
                "bound of the admitted sequences %d",
                live, held, self.ledger.budget, self.ledger.reserved(),
            )  # fmt: skip

    def figures(self) -> dict[str, Any]:
        """The numbers `/status` and `/metrics` show."""
        b = self.ledger
        return {
            "budget": b.budget, "reserved": b.reserved(), "live": b.last_live,
            "prompt_cache": self.cached_bytes(), "peak_held": b.peak_held,
            "overruns": b.overruns, "bound_misses": b.bound_misses, "admitted": len(b.shapes),
        }  # fmt: skip


__all__ = ["DECODE_RESERVE", "KVMemory", "Memory", "Need"]

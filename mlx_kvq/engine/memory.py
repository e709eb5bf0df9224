"""The memory accounting: what each sequence and the prompt cache hold, what is free.

With a KV budget, every admitted sequence holds a shape in the `Ledger`
(`budget.py`): its prompt, and the tokens it may reach before it next grows.
A sequence is admitted with its prompt and a small decode reserve
(`DECODE_RESERVE` tokens, never its `max_tokens`); as it decodes it grows,
another reserve at a time, when every rank still fits the budget.

The paged layout's slots are counted by their pools (`caches.Pages`), the
one truth about blocks: an admitted request is promised the blocks its
shape holds at most, claims the blocks of the prompt-cache entry it will
start from (that entry's own tables, never blocks found by hash: they are
held once, however many sequences map them, so no price for them), and the
budget asks the pools how many blocks are live and promised. The entry is
kept until the sequence has copied it (a system prompt, while sequences
that started from it run), and what it holds apart from them is counted
with them (`Ledger.kept`). When a sequence starts from less than its
admission counted on, it is priced again from what it found, and does not
run if that does not fit (`starts_from`). Slots that cannot page are
priced by the shapes.

The prompt cache holds what the sequences leave free and yields first: its
byte cap is the room the sequences leave (`room`, and what it keeps for
them), counted as the bytes it alone holds (its own caches, and the blocks
no live sequence refers to), and in a group every rank evicts alike,
charging entries by their bound. A decoding row that is preempted or ends
leaves the batch before the next step: the blocks only it refers to count
as free at once (`Pages.leave`). The pools' storage may grow to what the
budget leaves them (`Pages.limit`).
After every step the bytes the caches really hold are measured against the
budget and the bound (`Ledger.check`).

The scheduler asks `Memory` (admit, grow, release) and never sees bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mlx_kvq.caches import Pages, blocks_kept, keep_in_prompt_cache

from .budget import CostModel, Ledger, Shape, Verdict
from .disk import DiskTier
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
    tokens: Sequence[int] = ()  # what it starts from (when admitted: its prefix may be held)


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

    def covered(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` a sequence starting now finds cached."""


class KVMemory:
    """`Memory` over a `Ledger` (None: no budget, everything fits), the block
    pools of the paged layout (None: none) and the prompt cache."""

    def __init__(
        self,
        ledger: Ledger | None,
        prompt_cache: PromptCache,
        *,
        pages: Pages | None = None,
        prompt_cache_bytes: int | None = None,
        draft_cost: CostModel | None = None,
        live_bytes: Callable[[], int] = lambda: 0,
        lane_cost: CostModel | None = None,
        reserve: int = DECODE_RESERVE,
    ):
        self.ledger = ledger
        self.prompt_cache = prompt_cache
        self.pages = pages
        if ledger is not None:
            ledger.pages = pages
        self.prompt_cache_bytes = prompt_cache_bytes
        self.draft_cost = draft_cost
        self.live_bytes = live_bytes
        self.lane_cost = lane_cost  # the model's caches on the lane, when priced apart
        self.reserve = max(1, reserve)
        self.serving = False  # live sequences exist to cap the prompt cache by (mlx-lm's rule)
        self.disk: DiskTier | None = None  # the prompt cache's disk tier (`build` sets it)
        self.counted: dict[int, int] = {}  # cached prompt tokens an admission was priced with
        if pages is not None:
            prompt_cache.held_bytes = self._prompt_cache_holds
        if ledger is not None:
            ledger.kept = prompt_cache.kept_nbytes  # entries kept for the sequences

    # ------------------------------------------------------------ sequences
    def _shape(self, need: Need, total: int) -> tuple[Shape, int | None]:
        """The ledger's shape for `need` reaching `total` tokens, and the bytes
        its draft model's caches (and, paged, its own caches in their own
        layout) hold on the lane (None in the batch)."""
        shape = Shape(need.prompt + need.keep, total + need.keep)
        if not need.keep or self.draft_cost is None:
            return shape, None
        extra = self.draft_cost.bound([shape])
        if self.lane_cost is not None:
            # the lane runs the model's caches in their own layout, not in blocks
            padded = self.ledger.share.cost.padded_bound([shape], [shape])
            extra += max(0, self.lane_cost.bound([shape]) - padded)
        return shape, extra

    def first_shape(self, need: Need) -> Shape:
        """What a sequence is admitted with: its prompt and the decode reserve."""
        return self._shape(need, self._first_total(need))[0]

    def _first_total(self, need: Need) -> int:
        return max(need.prompt + need.step, min(need.limit, need.prompt + self.reserve))

    def _promise(
        self, request_id: int, shape: Shape, prompting: bool, copies: int = 0, cached: int = 0
    ) -> None:
        """The blocks `shape` holds at most, per pool (starting from `cached`
        tokens), and `copies` more each (a shared block partly filled, copied
        before it is written)."""
        blocks = self.ledger.share.cost.promise(shape, prompting, cached)
        self.pages.promise(request_id, {k: n + copies for k, n in blocks.items()})

    def admit(self, need: Need) -> bool:
        if self.disk is not None and need.tokens:
            self.disk.restore(need.request_id, need.tokens)  # a longer prefix from disk, if any
        if self.ledger is None:
            return True
        found = None
        if need.tokens and not self.group:
            found = self.prompt_cache.peek(list(need.tokens))
        if found is not None and self._admit(need, found):
            return True
        return self._admit(need, None)

    def _admit(self, need: Need, found: tuple | None) -> bool:
        """Admit `need` starting from the prompt-cache entry `found` (key,
        tokens covered, caches; None: from nothing) if that fits: the entry is
        kept until the sequence has copied it, and what it holds apart from
        the sequences is counted with them (`Ledger.kept`)."""
        shape, extra = self._shape(need, self._first_total(need))
        paged = self.pages is not None and not need.keep
        cached = 0 if found is None else found[1]
        if paged:
            self._price_from(need, shape, cached, None if found is None else found[2])
        if found is not None:
            self.prompt_cache.pin(found[0], need.request_id)
        if not self.ledger.fits(shape, extra or 0):
            if paged:
                self.pages.close(need.request_id)
            self.prompt_cache.unpin(need.request_id)
            return False
        self.ledger.reserve(need.request_id, shape, extra or 0)
        if paged and cached:
            self.counted[need.request_id] = cached
        return True

    def _price_from(self, need: Need, shape: Shape, cached: int, caches: list | None) -> None:
        """Promise a sequence in its prompt the blocks `shape` holds, starting
        from `caches` (a prompt-cache entry, or the copy it fetched) for its
        first `cached` tokens: it claims the blocks of that entry a copy cut
        there keeps (those it maps: the entry's own tables, whole or not,
        never blocks found by hash), and a partly filled last one is copied
        before it is written."""
        if cached and caches is not None:
            self.pages.claim_blocks(need.request_id, blocks_kept(caches, self.pages, cached))
        else:
            self.pages.unclaim(need.request_id)
        copies = int(cached % self.pages.block_size != 0)
        self._promise(need.request_id, shape, True, copies, cached)

    def starts_from(self, need: Need, cached: int, cache: list | None = None) -> bool:
        """An admitted sequence starts from `cache` (its copy from the prompt
        cache), `cached` prompt tokens: the entry it pinned is kept for it no
        longer (a system prompt it maps in the batch, while others do too).
        Where its admission counted on mapping more (a shorter entry serves
        it now), it is priced again from `cached`: False when that no longer
        fits the budget (it must not run; the caller releases it)."""
        maps = self.pages is not None and not need.keep and not self.group
        self.prompt_cache.copied(need.request_id, cached if maps else 0)
        counted = self.counted.pop(need.request_id, 0)
        shape = None if self.ledger is None else self.ledger.shapes.get(need.request_id)
        if cached >= counted or shape is None or self.pages is None:
            return True
        self._price_from(need, shape, cached, cache)
        return all(self.ledger.reserved(r) <= s.budget for r, s in enumerate(self.ledger.shares))

    def grow(self, need: Need) -> bool:
        if self.ledger is None:
            return True
        held = self.ledger.shapes.get(need.request_id)
        if held is None:
            return True
        want = need.context + need.step
        if want + need.keep <= held.total:
            return True
        paged = self.pages is not None and not need.keep
        before = self.pages.promised(need.request_id) if paged else None
        prompting = need.request_id in self.ledger.prompting
        for total in dict.fromkeys((max(want, min(need.limit, need.context + self.reserve)), want)):
            shape, extra = self._shape(need, total)
            if paged:
                self._promise(need.request_id, shape, prompting)
            if self.ledger.grow(need.request_id, shape.total, extra):
                return True
        if paged:
            self.pages.promise(need.request_id, before)
        return False

    def release(self, request_id: int, after_step: bool = False) -> None:
        self.counted.pop(request_id, None)
        self.prompt_cache.unpin(request_id)
        if self.ledger is not None:
            self.ledger.release(request_id, after_step)
        if self.pages is not None:
            self.pages.close(request_id)
            if not after_step:  # its rows leave before the next step: what they alone hold is free
                self.pages.leave(request_id)

    def inserted(self, request_id: int) -> None:
        """Its tables hold its prefix now: what it claimed goes back."""
        if self.pages is not None:
            self.pages.unclaim(request_id)

    def prompt_done(self, request_id: int) -> None:
        if self.ledger is None:
            return
        self.ledger.prompt_done(request_id)
        shape = self.ledger.shapes.get(request_id)
        if self.pages is not None and shape is not None and self.pages.promised(request_id):
            self._promise(request_id, shape, False)  # no prompt chunk in its windows any more

    def to_batch(self, request_id: int) -> None:
        if self.ledger is None:
            return
        self.ledger.drop_extra(request_id)
        self.ledger.prompting.add(request_id)
        shape = self.ledger.shapes.get(request_id)
        if self.pages is not None and shape is not None:
            self._promise(request_id, shape, True)  # its caches go into the pools

    def covered(self, tokens: Sequence[int]) -> int:
        found = self.prompt_cache.peek(list(tokens))
        return 0 if found is None else found[1]

    def verdict(self, need: Need) -> Verdict | None:
        """Whether a request's prompt and decode reserve fit the budget even
        alone (None without a budget)."""
        if self.ledger is None:
            return None
        return self.ledger.verdict(self.first_shape(need))

    def clear(self) -> None:
        if self.ledger is not None:
            for request_id in list(self.ledger.shapes):
                self.release(request_id)
            self.ledger.clear()

    # ------------------------------------------------------------ the prompt cache
    @property
    def group(self) -> bool:
        return self.ledger is not None and len(self.ledger.shares) > 1

    def _prompt_cache_holds(self) -> int:
        """Bytes the prompt cache alone holds: its own caches, and the blocks
        only its entries refer to."""
        own = self.prompt_cache.storage_nbytes()
        return own + sum(p.allocator.cached * p.block_bytes for p in self.pages.pools.values())

    def cache_budget(self) -> int | None:
        """Prompt-cache byte cap left once live sequences are counted: mlx-lm's
        rule for --prompt-cache-bytes, and the room the KV budget leaves next to
        what the sequences hold (one process)."""
        caps = []
        if self.prompt_cache_bytes is not None and self.serving:
            caps.append(self.prompt_cache_bytes - self.live_bytes())
        if self.ledger is not None and not self.group:
            # the room left beside the sequences and what it keeps for them
            caps.append(self.ledger.room() + self.prompt_cache.kept_nbytes())
        return min(caps) if caps else None

    def store_prompt(
        self, tokens: list[int], cache: list, segment: Segment = Segment.ANSWER
    ) -> bool:
        """Keep a sequence's cache in the prompt cache within the byte caps and
        the room the KV budget leaves; in a group, only once every rank has
        room for it by its bound (evicting the oldest entries first)."""
        if self.group and not self.yield_group(len(tokens)):
            return False
        keep_in_prompt_cache(cache, list(tokens))  # no longer live: what it frees is room
        stored = self.prompt_cache.insert(list(tokens), cache, self.cache_budget(), segment)
        if self.disk is not None:
            self.disk.keep(tokens, cache, segment)  # written through, stored in memory or not
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
            if not self.prompt_cache.evict_oldest():  # what is left is kept for sequences
                break
        return True

    # ------------------------------------------------------------ measuring
    def settle(self) -> None:
        """After a step: free the shares of rows the step took out, let the
        prompt cache yield to what is left, and measure."""
        if self.pages is not None:
            self.pages.settle()
        if self.ledger is None:
            return
        self.ledger.settle()
        self.trim_prompt_cache()
        self.measure()

    def cached_bytes(self) -> int:
        """What the prompt cache holds beyond the live sequences: its entries'
        own caches and, paged, the pools' storage no live sequence refers to
        (blocks only entries refer to, and free blocks)."""
        if self.pages is None:
            return self.prompt_cache.nbytes
        live = sum(p.allocator.live * p.block_bytes for p in self.pages.pools.values())
        return self.prompt_cache.storage_nbytes() + self.pages.nbytes - live

    def _between_steps(self) -> None:
        """The pools may grow to what the budget leaves them, and give back free
        storage (all of it when they hold more than that)."""
        pages = self.pages
        if pages is None:
            return
        if self.ledger is not None:
            own = self.prompt_cache.storage_nbytes()
            pages.limit = self.ledger.budget - self.ledger.padded() - own
        pages.compact(everything=pages.limit is not None and pages.nbytes > pages.limit)

    def measure(self) -> None:
        """Measure what the caches hold (live sequences and prompt cache)
        against the budget and the bound of the admitted sequences. Called
        wherever the bytes held can grow: after a step, after admitting
        requests (a reused prompt-cache entry is copied) and after a prompt
        cache insertion."""
        self._between_steps()
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

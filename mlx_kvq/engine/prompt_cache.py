"""A prompt cache bounded by entry count and by bytes actually held.

Finished sequences leave their (quantized) KV caches here, keyed by the
tokens the cache covers. A new request reuses the entry sharing the longest
prefix with its prompt: directly when the entry is a prefix of the prompt,
or trimmed back when the prompt diverges inside the entry (only caches that
can trim, e.g. a window that has not wrapped yet).

Entries are tagged with the `Segment` they hold (a system prompt, a prompt
prefix, a prompt with its answer) and evicted in mlx-lm's server's order
(`LRUPromptCache.CacheOrder`: answers first while they are at least as
many as the prefixes, then prefixes while at least as many as the system
prompts, least recently used first within a kind), so the system prompt a
new conversation starts with outlives the answers of old ones. As in
mlx-lm, an entry being inserted takes its place in that order first: it
is refused rather than evicting an entry that order keeps longer.

An entry an admitted request counts on starting from is pinned until the
request has taken its copy (`pin`, `copied`): it is not evicted meanwhile.
A system prompt that live sequences started from (mapping it whole) is kept
as long as two of them run: it is the prefix they share, and a preempted
one resumes from it instead of computing it again. What the kept entries
hold, or may come to hold, apart from the live sequences is counted by the
KV budget (`kept_nbytes`).

Both caps are checked on the one insert path and whenever the byte budget
shrinks, and bytes are the caches' own `nbytes`, measured on insert. With
the paged layout, entries hold blocks of the pools (their tables): an
entry's blocks are the prompt cache's (`keep_in_prompt_cache`), and what it
holds against its caps is measured by `held_bytes` (its own caches and the
blocks no live sequence refers to, each once).
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

from mlx_kvq.caches import apart_bytes, cached_only_bytes, exact_trim_limit, keep_in_prompt_cache

from .requests import Segment


def cache_nbytes(cache: list[Any]) -> int:
    """Bytes the per-layer caches of one sequence hold."""
    return sum(int(c.nbytes) for c in cache)


def storage_nbytes(cache: list[Any]) -> int:
    """Bytes of the caches that hold their own storage (leaves of a block pool,
    `shares_storage`, are counted with their pool, but for what they hold
    beside it, `own_nbytes`)."""
    total = 0
    for c in cache:
        if getattr(c, "shares_storage", False):
            total += c.own_nbytes
            continue
        members = getattr(c, "caches", None)
        total += storage_nbytes(members) if isinstance(members, (list, tuple)) else int(c.nbytes)
    return total


def own_copy(cache: list[Any]) -> None:
    """Give each cache compact arrays of its own, in place.

    A cache extracted from a batch may hold slices that keep the whole batch
    buffer alive while reporting only the slice's bytes; copying through the
    cache's `state` makes `nbytes` the memory really held.
    """
    for c in cache:
        if getattr(c, "shares_storage", False):  # blocks of a pool: nothing to compact
            continue
        try:
            c.state = tree_map(lambda x: mx.array(x) if isinstance(x, mx.array) else x, c.state)
        except AttributeError:  # a cache without a state setter keeps its arrays
            continue
    mx.eval([c.state for c in cache])


def _trims_exactly(cache: list[Any], n: int) -> bool:
    """Whether cutting `n` tokens off `cache` leaves what computing the
    shorter prefix would (a split layer's quantized body cannot give back its
    exact tokens: reusing it would change the answer, `exact_trim_limit`)."""
    limit = exact_trim_limit(cache)
    return limit is None or n <= limit


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class _Entry:
    cache: list[Any]
    nbytes: int
    segment: Segment


_EVICTION_ORDER = (Segment.ANSWER, Segment.CONTEXT, Segment.SYSTEM)


@dataclass(frozen=True)
class PromptCacheStats:
    entries: int
    nbytes: int
    max_entries: int
    max_bytes: int | None
    hits: int
    misses: int
    evictions: int
    rejected: int
    by_segment: tuple[tuple[str, int, int], ...] = ()  # (segment, entries, bytes)


class PromptCache:
    """LRU of per-sequence caches keyed by token tuples.

    `max_entries == 0` disables caching. `max_bytes=None` means no byte cap.
    Only the engine thread mutates it; the lock makes `stats()` consistent
    when read from the HTTP thread.
    """

    def __init__(self, max_entries: int = 10, max_bytes: int | None = None):
        self.max_entries = max(0, max_entries)
        self.max_bytes = max_bytes
        # what the entries really hold (paged: blocks live sequences share are theirs)
        self.held_bytes: Callable[[], int] | None = None
        self._entries: dict[tuple[int, ...], _Entry] = {}
        # each kind's keys, least recently used first (mlx-lm's `CacheOrder`)
        self._order: dict[Segment, dict[tuple[int, ...], None]] = {s: {} for s in _EVICTION_ORDER}
        # request id -> the entry it pinned, and whether it has copied it
        self._pins: dict[int, tuple[tuple[int, ...], bool]] = {}
        self._nbytes = 0
        self._lock = threading.RLock()  # `held_bytes` may read the entries
        self._hits = self._misses = self._evictions = self._rejected = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes if self.held_bytes is None else self.held_bytes()

    def stats(self) -> PromptCacheStats:
        with self._lock:
            by_segment = tuple(
                (s.value, sum(1 for e in self._entries.values() if e.segment is s),
                 sum(e.nbytes for e in self._entries.values() if e.segment is s))
                for s in Segment
            )  # fmt: skip
            return PromptCacheStats(
                len(self._entries), self.nbytes, self.max_entries, self.max_bytes,
                self._hits, self._misses, self._evictions, self._rejected, by_segment,
            )  # fmt: skip

    def _best(self, tokens: list[int]) -> tuple[tuple[int, ...] | None, int, int]:
        """(key, tokens it covers, tokens to trim) of the best entry for `tokens`;
        call with the lock held."""
        best_key, best_len, best_trim = None, 0, 0
        for key, entry in self._entries.items():
            shared = common_prefix(key, tokens)
            if shared == len(key) and shared < len(tokens):
                use, trim = shared, 0
            elif can_trim_prompt_cache(entry.cache):
                use = min(shared, len(tokens) - 1)
                trim = len(key) - use
                if not _trims_exactly(entry.cache, trim):
                    continue
            else:
                continue
            if use > best_len:
                best_key, best_len, best_trim = key, use, trim
        return best_key, best_len, best_trim

    def _use(self, key: tuple[int, ...]) -> _Entry:
        """Mark an entry as just used (the last of its kind to be evicted)."""
        entry = self._entries[key]
        self._order[entry.segment].pop(key, None)
        self._order[entry.segment][key] = None
        return entry

    def _victim(self, new: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
        """The next key in eviction order (mlx-lm's `CacheOrder.pop`: a kind
        goes first while it has at least as many keys as the next kind), of
        the entries not kept and `new` (being inserted); None when every
        entry is kept."""
        kept = self._kept()
        kinds = [
            [k for k in self._order[s] if (k in self._entries or k == new) and k not in kept]
            for s in _EVICTION_ORDER
        ]
        for a, b in itertools.pairwise(kinds):
            if a and len(a) >= len(b):
                return a[0]
        return next((k[0] for k in reversed(kinds) if k), None)

    # ------------------------------------------------------------ pins
    def pin(self, key: tuple[int, ...], owner: int) -> None:
        """Keep the entry `key` until `owner` (an admitted request) has copied it."""
        with self._lock:
            if key in self._entries:
                self._pins[owner] = (key, False)

    def copied(self, owner: int, mapped: int = 0) -> None:
        """`owner` has its copy of the entry it pinned, which maps `mapped`
        tokens of it by reference (0: none, or not in the batch): the pin goes,
        unless it mapped a system prompt whole (then it keeps it while another
        live sequence does too)."""
        with self._lock:
            pin = self._pins.pop(owner, None)
            entry = None if pin is None else self._entries.get(pin[0])
            if entry is not None and entry.segment is Segment.SYSTEM and mapped == len(pin[0]):
                self._pins[owner] = (pin[0], True)

    def unpin(self, owner: int) -> None:
        with self._lock:
            self._pins.pop(owner, None)

    def _kept(self) -> set[tuple[int, ...]]:
        """Keys never evicted now: pinned by a request yet to copy them, or by
        two live sequences that started from them."""
        started = Counter(k for k, done in self._pins.values() if done)
        return {k for k, done in self._pins.values() if not done or started[k] > 1}

    def kept_nbytes(self) -> int:
        """Bytes the kept entries hold, or may come to hold, apart from the live
        sequences, each entry once: their own caches, and their blocks but the
        whole full-attention blocks the sequences mapping them hold too
        (`apart_bytes`)."""
        with self._lock:
            entries = [self._entries[k] for k in self._kept() if k in self._entries]
            return sum(storage_nbytes(e.cache) + apart_bytes(e.cache) for e in entries)

    def touch(self, tokens: list[int]) -> None:
        """Mark the entry `fetch(tokens)` would use as just used, so that
        evictions before the fetch take it last of its kind."""
        with self._lock:
            key = self._best(tokens)[0]
            if key is not None:
                self._use(key)

    def peek(self, tokens: list[int]) -> tuple[tuple[int, ...], int, list[Any]] | None:
        """The entry `fetch(tokens)` would use: its key, the tokens it covers for
        `tokens`, and its caches (not copied; None when none matches)."""
        with self._lock:
            key, n, _ = self._best(tokens)
            return None if key is None else (key, n, self._entries[key].cache)

    def fetch(self, tokens: list[int]) -> tuple[list[Any] | None, int]:
        """A private copy of the best cache for `tokens` and how many tokens it covers.

        At least one prompt token is always left uncovered: the model must
        see the last prompt token to produce the first new one. A copy cut
        back to a shorter prefix is compacted: it holds only what it covers.
        """
        with self._lock:
            best_key, best_len, best_trim = self._best(tokens)
            if best_key is None:
                self._misses += 1
                return None, 0
            cache = copy.deepcopy(self._use(best_key).cache)
        if best_trim:
            if trim_prompt_cache(cache, best_trim) != best_trim:
                with self._lock:
                    self._misses += 1
                return None, 0
            own_copy(cache)
        with self._lock:
            self._hits += 1
        return cache, best_len

    def insert(
        self,
        tokens: list[int],
        cache: list[Any],
        budget: int | None = None,
        segment: Segment = Segment.ANSWER,
    ) -> bool:
        """Store `cache` (covering `tokens`) as `segment`; False if it alone
        exceeds the byte cap.

        `budget` further lowers the byte cap for this call (bytes live
        sequences already hold), as mlx-lm's server does.
        """
        if self.max_entries == 0 or not tokens:
            return False
        key = tuple(tokens)
        cap = self._cap(budget)
        keep_in_prompt_cache(cache, list(key))  # its blocks are the prompt cache's now
        own = storage_nbytes(cache)  # what its own copy holds at most
        need = own + cached_only_bytes(cache)  # with the blocks only the prompt cache holds

        def with_it() -> int:
            return self._nbytes + need if self.held_bytes is None else self.nbytes + own

        with self._lock:
            if cap is not None and need > cap:
                self._rejected += 1
                self._evict(cap)
                return False
            if key in self._entries:
                if key in self._kept():  # requests count on it: it stays as it is
                    return True
                self._drop(key)
            # bytes first: the copy below never puts the cache over its cap. The
            # entry takes its place in the eviction order first (mlx-lm's): it
            # is refused rather than evicting what that order keeps longer (the
            # entry count is kept after the insertion, in the same order).
            self._order[segment][key] = None
            while cap is not None and with_it() > cap:
                victim = self._victim(key)
                if victim is None or victim == key:
                    del self._order[segment][key]
                    self._rejected += 1
                    return False
                self._evict_key(victim)
        own_copy(cache)
        nbytes = cache_nbytes(cache)
        with self._lock:
            if can_trim_prompt_cache(cache):
                # A trimmable longer cache serves every prefix it trims back to
                # exactly: drop those (not one a request is about to copy).
                kept = self._kept()
                for k in [k for k in self._entries if len(k) < len(key) and key[: len(k)] == k]:
                    if k not in kept and _trims_exactly(cache, len(key) - len(k)):
                        self._drop(k)
            self._entries[key] = _Entry(cache, nbytes, segment)
            self._nbytes += nbytes
            self._evict(cap)
        return True

    def storage_nbytes(self) -> int:
        """Bytes the entries hold outside block pools (see `storage_nbytes`)."""
        with self._lock:
            return sum(storage_nbytes(e.cache) for e in self._entries.values())

    def keys(self) -> list[tuple[int, ...]]:
        """The token sequences the entries cover."""
        with self._lock:
            return list(self._entries)

    def token_counts(self) -> list[int]:
        """How many tokens each entry covers."""
        with self._lock:
            return [len(k) for k in self._entries]

    def evict_oldest(self) -> bool:
        """Evict the next entry in eviction order; False when there is none
        (or every entry is kept)."""
        with self._lock:
            key = self._victim()
            if key is None:
                return False
            self._evict_key(key)
            return True

    def trim_to(self, budget: int | None) -> None:
        """Evict until within the caps, with the byte cap lowered to `budget`."""
        with self._lock:
            self._evict(self._cap(budget))

    def _cap(self, budget: int | None) -> int | None:
        caps = [c for c in (self.max_bytes, budget) if c is not None]
        return max(0, min(caps)) if caps else None

    def _drop(self, key: tuple[int, ...]) -> None:
        entry = self._entries.pop(key)
        self._nbytes -= entry.nbytes
        self._order[entry.segment].pop(key, None)

    def _evict(self, cap: int | None) -> None:
        """Evict in order until within the caps (kept entries stay)."""
        while self._entries and (
            len(self._entries) > self.max_entries or (cap is not None and self.nbytes > cap)
        ):
            key = self._victim()
            if key is None:
                return
            self._evict_key(key)

    def _evict_key(self, key: tuple[int, ...]) -> None:
        self._drop(key)
        self._evictions += 1

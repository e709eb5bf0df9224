"""Paged sliding windows: a row keeps only the blocks its next query sees.

A window row holds at most `window - 1` tokens before what it writes (plus
the rest of a block): before a write it returns the blocks no query of that
write sees, and right after it (the write's view holds its own copy of the
tables and of the pool's arrays) the blocks the next query will not see, so
a prompt chunk's blocks do not wait for the next step. KV-shared layers
(gemma3n) read their owner's cache after the write for the same queries:
until the rows change or the pool hands one of those blocks out again, they
get the last write's view.
"""

from __future__ import annotations

from .base import KVQPagedSequence, PagedBatch
from .blocks import BlockTable
from .pool import BlockPool


class KVQPagedWindowCache(PagedBatch):
    """A batch of sliding-window rows over one pool; see the module docstring."""

    kind = "sliding"
    bounded = True

    def __init__(self, pool: BlockPool, window: int):
        super().__init__(pool, window)
        self._seen: tuple | None = None  # (pool generation, the last write's view rows)

    @property
    def max_size(self) -> int:
        return self.window

    def _sync(self) -> None:
        super()._sync()
        self._seen = None

    def _keep(self) -> None:
        for i, t in enumerate(self.tables):
            end = t.length if self._limits is None else min(t.length, self._limits[i])
            if t.drop_before(end - self.window + 1):
                self._row_changed(i)

    def _written(self, view) -> None:
        k = view[0]
        self._seen = (self.pool.generation, k.tables, k.bases, k.ends)

    def _kept(self, table: BlockTable) -> BlockTable:
        """Only what its next token sees (a row holds a whole prompt chunk until
        its next step)."""
        table.drop_before(table.length - self.window + 1)
        return table

    def keys_and_values(self):
        if self._seen is not None and self._seen[0] == self.pool.generation:
            return self.pool.view(*self._seen[1:], self.window)
        return super().keys_and_values()

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_):
        if window_size is not None and window_size < self.window:
            raise NotImplementedError(
                f"a mask window ({window_size}) narrower than the cache's ({self.window})"
            )
        return super().make_mask(N, return_array)


class KVQPagedWindowSequence(KVQPagedSequence, windowed=True):
    """One sliding-window sequence's table."""

    kind = "sliding"
    bounded = True
    batch_form = KVQPagedWindowCache

    @property
    def max_size(self) -> int:
        return self.window

    def is_trimmable(self) -> bool:
        return True

    def exact_trim(self) -> int | None:
        """How many tokens it trims back to what a decode to the shorter length
        holds: those past the `window - 1` its next query needs, which a row
        keeps to the start of a block (any, before a block was dropped)."""
        t = self.table
        return None if t.base == 0 else max(0, t.length - t.base - (self.window - 1))


KVQPagedWindowCache.sequence_form = KVQPagedWindowSequence

__all__ = ["KVQPagedWindowCache", "KVQPagedWindowSequence"]

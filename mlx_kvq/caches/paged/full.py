"""Paged full attention: every row keeps all its tokens."""

from __future__ import annotations

from .base import KVQPagedSequence, PagedBatch


class KVQPagedFullCache(PagedBatch):
    """A batch of full-attention rows over one pool (see `base.PagedBatch`)."""

    kind = "full"

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_):
        if window_size is not None and self.window is None:
            raise NotImplementedError("a windowed mask over a full-attention paged cache")
        return super().make_mask(N, return_array)


class KVQPagedFullSequence(KVQPagedSequence, windowed=False):
    """One full-attention sequence's table."""

    kind = "full"
    batch_form = KVQPagedFullCache


KVQPagedFullCache.sequence_form = KVQPagedFullSequence

__all__ = ["KVQPagedFullCache", "KVQPagedFullSequence"]

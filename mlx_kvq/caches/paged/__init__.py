"""Paged K/V: per-layer pools of fixed-size blocks, and the caches that map them.

By job: `blocks.py` (which blocks are free, their reference counts, and each
sequence's `BlockTable`), `storage.py` (one layer's K/V, block by block),
`pool.py` (the two together, one per paged layer, and a model's `Pages`),
`base.py` (what the cache forms share, and the batch mlx-lm's
`BatchGenerator` drives), `full.py` and `window.py` (the full-attention and
sliding-window forms: what a row keeps), `split.py` (the split layout's
full-attention form: whole quantized blocks, each row's exact tail beside), `convert.py` (one sequence's caches
into the pools and back; it reads the registry, which declares these forms,
so the package leaves it out).
"""

from .base import KVQPagedSequence, PagedBatch, PagedCache
from .blocks import BlockAllocator, BlockTable, PoolStats
from .full import KVQPagedFullCache, KVQPagedFullSequence
from .pool import BlockPool, Pages, PagesStats
from .split import (
    KVQPagedSplitCache,
    KVQPagedSplitSequence,
    exact_tokens_held,
    tail_slots,
)
from .storage import BlockStorage, SplitBlockStorage, split_refusal
from .window import KVQPagedWindowCache, KVQPagedWindowSequence

__all__ = [
    "BlockAllocator",
    "BlockPool",
    "BlockStorage",
    "BlockTable",
    "KVQPagedFullCache",
    "KVQPagedFullSequence",
    "KVQPagedSequence",
    "KVQPagedSplitCache",
    "KVQPagedSplitSequence",
    "KVQPagedWindowCache",
    "KVQPagedWindowSequence",
    "PagedBatch",
    "PagedCache",
    "Pages",
    "PagesStats",
    "PoolStats",
    "SplitBlockStorage",
    "exact_tokens_held",
    "tail_slots",
    "split_refusal",
]

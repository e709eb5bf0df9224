"""Cache storage per layout, and a report of what live caches hold."""

from __future__ import annotations

from ..split import least_trim
from .base import DEQUANTIZED, PACKED, KVQCache
from .chunked import KVQChunkedCache
from .deepseek_v41 import KVQDeepseekV41Cache
from .full import KVQBatchFullCache, KVQFullCache
from .indexer import KVQBatchIndexerCache, KVQIndexerCache
from .paged import (
    BlockPool,
    KVQPagedFullCache,
    KVQPagedSequence,
    KVQPagedSplitCache,
    KVQPagedSplitSequence,
    KVQPagedWindowCache,
    PagedCache,
    Pages,
    PagesStats,
)
from .paged.blocks import CACHE, blocks_held
from .paged.convert import (
    apart_bytes,
    blocks_kept,
    cached_only_bytes,
    keep_in_prompt_cache,
    mapped_blocks,
    page_caches,
    paged_block_size,
    pages_slot,
    split_unpaged,
    unpage_caches,
)
from .paged.split import exact_tokens_held, tail_slots
from .registry import (
    PROMPT_FILE_CLASSES,
    REGISTRY,
    is_twin,
    leaves,
    lookup,
    paging_refusal,
    quantize_cache,
    register_for_prompt_files,
    report_leaves,
)
from .split import (
    KVQSplitBatchCache,
    KVQSplitBatchWindowCache,
    KVQSplitCache,
    KVQSplitChunkedCache,
    KVQSplitWindowCache,
)
from .window import KVQBatchWindowCache, KVQWindowCache

__all__ = [
    "BlockPool",
    "KVQPagedFullCache",
    "KVQPagedSequence",
    "KVQPagedSplitCache",
    "KVQPagedSplitSequence",
    "KVQPagedWindowCache",
    "PagedCache",
    "Pages",
    "PagesStats",
    "CACHE",
    "blocks_held",
    "exact_tokens_held",
    "tail_slots",
    "apart_bytes",
    "blocks_kept",
    "cached_only_bytes",
    "keep_in_prompt_cache",
    "mapped_blocks",
    "page_caches",
    "pages_slot",
    "paged_block_size",
    "split_unpaged",
    "paging_refusal",
    "unpage_caches",
    "DEQUANTIZED",
    "PACKED",
    "PROMPT_FILE_CLASSES",
    "REGISTRY",
    "KVQBatchFullCache",
    "KVQBatchIndexerCache",
    "KVQBatchWindowCache",
    "KVQCache",
    "KVQChunkedCache",
    "KVQFullCache",
    "KVQIndexerCache",
    "KVQDeepseekV41Cache",
    "KVQWindowCache",
    "KVQSplitBatchCache",
    "KVQSplitBatchWindowCache",
    "KVQSplitCache",
    "KVQSplitChunkedCache",
    "KVQSplitWindowCache",
    "cache_report",
    "exact_trim_limit",
    "is_twin",
    "leaves",
    "report_leaves",
    "lookup",
    "quantize_cache",
    "register_for_prompt_files",
]


def _entry(c) -> dict:
    kind = lookup(c)
    name = kind.name if kind else type(c).__name__
    nbytes = c.nbytes if not c.empty() else 0
    if isinstance(c, (KVQCache, PagedCache, KVQSplitBatchCache)):
        return {"kind": name, "quantized": c.quantized, "nbytes": nbytes, "tokens": int(c.size())}
    tokens = c.size() if hasattr(c, "size") else 0
    return {"kind": name, "quantized": False, "nbytes": nbytes, "tokens": int(tokens)}


def exact_trim_limit(caches: list) -> int | None:
    """The most tokens every layer of `caches` trims back to exactly what a
    decode to the shorter length would hold (None: no limit beyond
    `is_trimmable`): a split layer's body cannot give back exact tokens."""
    ours = (KVQCache, PagedCache, KVQSplitBatchCache)
    return least_trim(
        leaf.exact_trim() for c in caches for leaf in report_leaves(c) if isinstance(leaf, ours)
    )


def cache_report(caches: list) -> list[dict]:
    """One entry per cache slot: kind, quantized, bytes held, tokens held.

    A container slot (`CacheList`, deepseek_v41's layer cache) reports each
    member; recurrent state reports kind "state" with `quantized` False (it
    is not a KV cache).
    """
    return [_entry(leaf) for c in caches for leaf in report_leaves(c)]

"""Cache storage per layout, and a report of what live caches hold."""

from __future__ import annotations

from .base import DEQUANTIZED, PACKED, KVQCache
from .chunked import KVQChunkedCache
from .full import KVQBatchFullCache, KVQFullCache
from .indexer import KVQBatchIndexerCache, KVQIndexerCache
from .layer import KVQLayerCache
from .paged import (
    BlockPool,
    KVQPagedFullCache,
    KVQPagedSequence,
    KVQPagedWindowCache,
    PagedCache,
    Pages,
    PagesStats,
)
from .registry import (
    PROMPT_FILE_CLASSES,
    REGISTRY,
    is_twin,
    leaves,
    lookup,
    mapped_blocks,
    page_caches,
    pages_slot,
    paging_refusal,
    quantize_cache,
    register_for_prompt_files,
    report_leaves,
    unpage_caches,
)
from .split import (
    KVQSplitBatchCache,
    KVQSplitBatchWindowCache,
    KVQSplitCache,
    KVQSplitChunkedCache,
    KVQSplitWindowCache,
)
from .window import KVQBatchWindowCache, KVQWindowCache

# mlx-lm's prompt files must resolve our classes by name: registered whenever
# the caches are imported, so `import mlx_kvq` alone stays light. (The caches
# hand attention packed K/V that only mlx-kvq's attention reads: importing
# `mlx_kvq.attention`, which the planner does, installs that redirect.)
register_for_prompt_files()

__all__ = [
    "BlockPool",
    "KVQPagedFullCache",
    "KVQPagedSequence",
    "KVQPagedWindowCache",
    "PagedCache",
    "Pages",
    "PagesStats",
    "mapped_blocks",
    "page_caches",
    "pages_slot",
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
    "KVQLayerCache",
    "KVQWindowCache",
    "KVQSplitBatchCache",
    "KVQSplitBatchWindowCache",
    "KVQSplitCache",
    "KVQSplitChunkedCache",
    "KVQSplitWindowCache",
    "cache_report",
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


def cache_report(caches: list) -> list[dict]:
    """One entry per cache slot: kind, quantized, bytes held, tokens held.

    A container slot (`CacheList`, deepseek_v41's layer cache) reports each
    member; recurrent state reports kind "state" with `quantized` False (it
    is not a KV cache).
    """
    return [_entry(leaf) for c in caches for leaf in report_leaves(c)]

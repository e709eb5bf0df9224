"""One sequence's caches into block pools and back, and what they refer to.

Which kinds page is declared in the registry (`CacheKind.paged`); here a
cache of such a kind is written into new blocks of its slot's pool (or, a
paged cache already, kept), and paged caches are turned back into caches of
their own layout for code that runs one sequence outside the batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from mlx_lm.models import cache as mlx_cache

from ...config import PAGED_BLOCK_SIZE, QuantSpec, is_split
from ..base import PACKED
from ..full import KVQFullCache
from ..registry import leaves, lookup
from ..split import KVQSplitCache
from ..window import KVQWindowCache
from .base import KVQPagedSequence
from .blocks import CACHE, Account, chain_hashes
from .pool import Pages
from .split import KVQPagedSplitSequence
from .storage import split_refusal


def pages_slot(cache) -> bool:
    """Whether `cache` (one leaf) goes into a block pool: a kind declared
    `paged`, handing attention packed K/V (attention reads `PagedKV`), stored
    in its final form from the first token (`--quantized-kv-start` 0), with
    no sink tokens and no rewind (speculative decoding keeps its own caches)."""
    kind = lookup(cache)
    if kind is None or not kind.paged:
        return False
    if isinstance(cache, KVQPagedSequence):
        return True
    return (
        cache.hand_out == PACKED
        and cache.start == 0
        and getattr(cache, "keep", 0) == 0
        and not getattr(cache, "rewind", 0)
    )


def _page_leaf(cache, key: tuple[int, int | None], pages: Pages, account: Account):
    if isinstance(cache, KVQPagedSequence):
        cache.table.hold_for(account)
        return cache
    if not pages_slot(cache):
        return cache
    kind = lookup(cache)
    window = kind.window(cache)
    if is_split(cache.key_spec, cache.value_spec):
        if split_unpaged(kind.name, window, cache.key_spec, cache.value_spec, pages.block_size):
            return cache  # kept padded, for the reason the layout reports
        pool = pages.pool(key, cache.key_spec, cache.value_spec)
        paged = KVQPagedSplitSequence(pool)
        paged.table.hold_for(account)
        if cache.offset:
            paged.write(*cache.store.dequantize())
        return paged
    pool = pages.pool(key, cache.key_spec, cache.value_spec, window)
    paged = KVQPagedSequence(pool, window)
    paged.table.hold_for(account)
    held = cache.held()
    if held is not None:
        paged.hold(*held, cache.offset)
    return paged


def page_caches(caches: list, pages: Pages, account: Account = None) -> list:
    """One sequence's caches with every pageable slot in `pages`' pools (tokens
    a cache of another layout holds are written into new blocks), its blocks
    held for `account` (the request)."""
    out = []
    for slot, c in enumerate(caches):
        if type(c) is mlx_cache.CacheList:
            members = [_page_leaf(m, (slot, i), pages, account) for i, m in enumerate(c.caches)]
            out.append(mlx_cache.CacheList(*members))
        else:
            out.append(_page_leaf(c, (slot, None), pages, account))
    return out


def _paged_leaves(caches: list) -> list[KVQPagedSequence]:
    return [leaf for c in caches for leaf in leaves(c) if isinstance(leaf, KVQPagedSequence)]


def keep_in_prompt_cache(caches: list, tokens: list[int]) -> None:
    """One sequence's caches become a prompt-cache entry covering `tokens`:
    their blocks are the prompt cache's (it yields them first), and their full
    blocks are found by the tokens they hold (`Pages.match`)."""
    paged = _paged_leaves(caches)
    if not paged:
        return
    hashes = chain_hashes(tokens, paged[0].pool.block_size)
    for leaf in paged:
        leaf.table.hold_for(CACHE)
        blocks, first = leaf.table.full_blocks()
        leaf.pool.allocator.register(blocks, hashes[first : first + len(blocks)])


def cached_only_bytes(caches: list) -> int:
    """Bytes of the blocks `caches` refer to that only the prompt cache holds
    (each once)."""
    blocks: dict[int, tuple] = {}
    for leaf in _paged_leaves(caches):
        a = leaf.pool.allocator
        ids = {b for b in leaf.table.ids if a.refs[b] == a.cache_refs[b]}
        pool, held = blocks.get(id(leaf.pool), (leaf.pool, set()))
        blocks[id(leaf.pool)] = (pool, held | ids)
    return sum(len(ids) * pool.block_bytes for pool, ids in blocks.values())


def apart_bytes(caches: list) -> int:
    """Bytes of the blocks of `caches` (a prompt-cache entry) that the prompt
    cache holds, or may come to hold, apart from the sequences that started
    from it, each once: all but the whole full-attention blocks something
    besides the prompt cache refers to (a window's blocks are dropped as its
    rows move on; a partly filled block is copied before it is written)."""
    blocks: dict[int, tuple] = {}
    for leaf in _paged_leaves(caches):
        a, t = leaf.pool.allocator, leaf.table
        whole = 0 if leaf.window is not None else (t.length - t.base) // leaf.pool.block_size
        ids = {b for i, b in enumerate(t.ids) if i >= whole or a.refs[b] == a.cache_refs[b]}
        pool, held = blocks.get(id(leaf.pool), (leaf.pool, set()))
        blocks[id(leaf.pool)] = (pool, held | ids)
    return sum(len(ids) * pool.block_bytes for pool, ids in blocks.values())


def blocks_kept(caches: list, pages: Pages, tokens: int) -> dict:
    """The pool blocks of `caches`' paged leaves (a prompt-cache entry) that a
    copy cut back to its first `tokens` tokens still holds, per pool key:
    those starting before `tokens` (a window's are the ones its table kept;
    a split row's blocks end before its exact tail, which is cut first)."""
    out: dict = {}
    for leaf in _paged_leaves(caches):
        t = leaf.table
        n = max(0, -(-(tokens - t.base) // leaf.pool.block_size))
        out[pages.key_of(leaf.pool)] = t.ids[:n]
    return out


def paged_block_size(layers: Iterable[tuple[str, int | None, QuantSpec, QuantSpec]]) -> int:
    """The block size the paged layout takes by default for layers given as
    (kind, window, key spec, value spec): PAGED_BLOCK_SIZE tokens, or the
    least multiple of it that is whole key groups of every split-layout
    full-attention layer with keys per channel (such a block is quantized
    once, in whole groups: `split_refusal`)."""
    size = PAGED_BLOCK_SIZE
    for kind, window, k, v in layers:
        if kind == "full" and window is None and is_split(k, v) and k.per_channel:
            size = math.lcm(size, k.group_size)
    return size


def split_unpaged(kind: str, window, key_spec, value_spec, block_size: int) -> str | None:
    """Why a layer (of `kind`) in the split layout keeps padded rows under
    paging in blocks of `block_size` tokens (None: it pages, or it is not
    in the split layout)."""
    if not is_split(key_spec, value_spec):
        return None
    if window is not None or kind != "full":
        return f"{kind} attention has no paged form"
    return split_refusal(block_size, key_spec, value_spec)


def _unpage_leaf(cache):
    if not isinstance(cache, KVQPagedSequence):
        return cache
    k, v = cache.key_spec, cache.value_spec
    if isinstance(cache, KVQPagedSplitSequence):
        # its exact tokens, and its blocks dequantized: quantized again in the
        # padded form's groups (which start after the sinks)
        out = KVQSplitCache(k, v)
        if cache.offset:
            out.update_and_fetch(*cache.held())
        return out
    if cache.table.length == 0:
        if cache.window is None:
            return KVQFullCache(k, v)
        return KVQWindowCache(cache.window, k, v)
    keys, values = cache.held()
    base = cache.table.base
    if cache.window is None:
        return KVQFullCache.holding(keys, values, k, v, None)
    return KVQWindowCache.holding(cache.window, keys, values, base + keys.length, k, v, None)


def unpage_caches(caches: list) -> list:
    """One sequence's caches in their own layout again (copies of their blocks),
    for code that runs one sequence outside the batch (speculative decoding)."""
    out = []
    for c in caches:
        if type(c) is mlx_cache.CacheList:
            out.append(mlx_cache.CacheList(*(_unpage_leaf(m) for m in c.caches)))
        else:
            out.append(_unpage_leaf(c))
    return out


def mapped_blocks(caches: list) -> int:
    """Pool blocks one sequence's caches refer to (0 for other layouts)."""
    return sum(
        len(leaf.table.ids)
        for c in caches
        for leaf in leaves(c)
        if isinstance(leaf, KVQPagedSequence)
    )


__all__ = [
    "apart_bytes",
    "blocks_kept",
    "cached_only_bytes",
    "keep_in_prompt_cache",
    "mapped_blocks",
    "page_caches",
    "pages_slot",
    "split_unpaged",
    "unpage_caches",
]

"""One sequence's caches into block pools and back, and what they refer to.

Which kinds page is declared in the registry (`CacheKind.paged`); here a
cache of such a kind is written into new blocks of its slot's pool (or, a
paged cache already, kept), and paged caches are turned back into caches of
their own layout for code that runs one sequence outside the batch.
"""

from __future__ import annotations

from mlx_lm.models import cache as mlx_cache

from ..base import PACKED
from ..full import KVQFullCache
from ..registry import leaves, lookup
from ..window import KVQWindowCache
from .base import KVQPagedSequence, PagedCache
from .pool import BlockPool, Pages


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


def _page_leaf(cache, key: tuple[int, int | None], pages: Pages):
    if isinstance(cache, KVQPagedSequence) or not pages_slot(cache):
        return cache
    pool = pages.pool(key, cache.key_spec, cache.value_spec)
    window = lookup(cache).window(cache)
    held = cache.held()
    if held is None:
        return KVQPagedSequence(pool, window)
    return KVQPagedSequence.holding(pool, window, *held, cache.offset)


def page_caches(caches: list, pages: Pages) -> list:
    """One sequence's caches with every pageable slot in `pages`' pools (tokens
    a cache of another layout holds are written into new blocks)."""
    out = []
    for slot, c in enumerate(caches):
        if type(c) is mlx_cache.CacheList:
            members = [_page_leaf(m, (slot, i), pages) for i, m in enumerate(c.caches)]
            out.append(mlx_cache.CacheList(*members))
        else:
            out.append(_page_leaf(c, (slot, None), pages))
    return out


def _unpage_leaf(cache):
    if not isinstance(cache, KVQPagedSequence):
        return cache
    k, v = cache.key_spec, cache.value_spec
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


def held_bytes(caches: list) -> int:
    """Bytes of the pool blocks `caches` (and their members) refer to, each once."""
    blocks: dict[int, set[int]] = {}
    pools: dict[int, BlockPool] = {}
    for c in caches:
        for leaf in leaves(c):
            if isinstance(leaf, PagedCache):
                pools[id(leaf.pool)] = leaf.pool
                blocks.setdefault(id(leaf.pool), set()).update(leaf.blocks())
    return sum(len(ids) * pools[k].block_bytes for k, ids in blocks.items())


__all__ = ["held_bytes", "mapped_blocks", "page_caches", "pages_slot", "unpage_caches"]

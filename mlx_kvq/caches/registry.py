"""Which cache kind maps to which quantized cache: the only place that decides.

A cache type is supported because it is *declared* here, never because it
happens to have some method. Lookups are by exact type: a subclass of
`KVCache` with its own behaviour is unknown until someone declares it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from ..config import QuantSpec, is_split
from ..mlx_lm_internals import batch_cursor
from ..model_facts import FACTS, OwnCache, facts
from ..quant import Store
from .base import PACKED, KVQCache, on_first_cache
from .chunked import KVQChunkedCache
from .deepseek_v41 import (
    KVQCompressedRows,
    KVQDeepseekV41Cache,
    KVQIndexRows,
    KVQWindowRows,
    PendingRows,
)
from .full import KVQBatchFullCache, KVQFullCache
from .indexer import KVQBatchIndexerCache, KVQIndexerCache
from .paged import (
    KVQPagedFullCache,
    KVQPagedFullSequence,
    KVQPagedSplitCache,
    KVQPagedSplitSequence,
    KVQPagedWindowCache,
    KVQPagedWindowSequence,
)
from .split import (
    KVQSplitBatchCache,
    KVQSplitBatchWindowCache,
    KVQSplitCache,
    KVQSplitChunkedCache,
    KVQSplitWindowCache,
)
from .window import KVQBatchWindowCache, KVQWindowCache

Converter = Callable[[object, QuantSpec, QuantSpec, int, str], KVQCache]


@dataclass(frozen=True)
class CacheKind:
    """A declared cache layout.

    `convert` builds the quantized twin of a (possibly filled) cache of this
    type; None means the cache holds no key/value tensors (recurrent state).
    """

    name: str
    convert: Converter | None
    window: Callable[[object], int | None] = lambda c: None
    one_sequence: bool = False  # its batch form holds one sequence
    # Its K/V can live in block pools (caches/paged/). Kinds that hold
    # little or whose layout attention does not read through block tables
    # keep their own layout: MLA hand-outs and indexers, chunked attention
    # (llama4's chunk-local mask), deepseek_v41's layer cache, recurrent state,
    # and the split layout's sliding windows and chunked attention (its paged
    # form, paged/split.py, is full attention's: blocks never change once full).
    paged: bool = False
    # The twin in the split layout (exact sinks and residual, per-channel keys:
    # caches/split.py), for specs that ask for it; None: this kind has none,
    # and the plan gives it per-token keys with nothing exact (and says so).
    split: Converter | None = None


def _own(x):
    """A distinct array object: the twin must not alias the original's arrays,
    which both sides update in place (slice writes, mlx-lm's `+=`/`-=`)."""
    return None if x is None else mx.array(x)


def _batch_full(c: mlx_cache.BatchKVCache, k: QuantSpec, v: QuantSpec, start: int, hand_out: str):
    q = KVQBatchFullCache(c.left_padding.tolist(), k, v, start, hand_out)
    cursor = batch_cursor(c)
    q.offset, q.left_padding, q._idx = _own(c.offset), _own(c.left_padding), cursor.idx
    q._right_padding = _own(cursor.right_padding)  # prepare() .. finalize()
    if c.keys is not None:
        q.dtype = c.keys.dtype
        specs = (k, v) if cursor.idx >= start else q._storage_specs()
        q.keys = Store.encode(_own(c.keys), specs[0])
        q.values = Store.encode(_own(c.values), specs[1])
    return q


def _batch_window(
    c: mlx_cache.BatchRotatingKVCache, k: QuantSpec, v: QuantSpec, start: int, hand_out: str
):
    q = KVQBatchWindowCache(c.max_size, c.left_padding.tolist(), k, v, start, hand_out)
    q.offset, q.left_padding = _own(c.offset), _own(c.left_padding)
    cursor = batch_cursor(c)
    q._idx, q._offset, q.rotated = cursor.idx, cursor.offset, c.rotated
    q._lengths = _own(cursor.lengths)
    if c.keys is not None:
        q.dtype = c.keys.dtype
        specs = (k, v) if cursor.offset >= start else q._storage_specs()
        q.keys = Store.encode(_own(c.keys), specs[0])
        q.values = Store.encode(_own(c.values), specs[1])
    return q


def _same(c, *_):
    return c


REGISTRY: dict[type, CacheKind] = {
    mlx_cache.KVCache: CacheKind("full", KVQFullCache.from_cache, split=KVQSplitCache.from_cache),
    mlx_cache.ConcatenateKVCache: CacheKind(
        "full", KVQFullCache.from_cache, split=KVQSplitCache.from_cache
    ),
    mlx_cache.RotatingKVCache: CacheKind(
        "sliding",
        KVQWindowCache.from_cache,
        lambda c: c.max_size,
        split=KVQSplitWindowCache.from_cache,
    ),
    mlx_cache.ChunkedKVCache: CacheKind(
        "chunked",
        KVQChunkedCache.from_cache,
        lambda c: c.chunk_size,
        split=KVQSplitChunkedCache.from_cache,
    ),
    mlx_cache.BatchKVCache: CacheKind("full", _batch_full),
    mlx_cache.BatchRotatingKVCache: CacheKind("sliding", _batch_window, lambda c: c.max_size),
    mlx_cache.ArraysCache: CacheKind("state", None),
    KVQFullCache: CacheKind("full", _same, paged=True),
    KVQWindowCache: CacheKind("sliding", _same, lambda c: c.max_size, paged=True),
    KVQPagedFullSequence: CacheKind("full", _same, paged=True),
    KVQPagedWindowSequence: CacheKind("sliding", _same, lambda c: c.window, paged=True),
    KVQPagedFullCache: CacheKind("full", _same, paged=True),
    KVQPagedWindowCache: CacheKind("sliding", _same, lambda c: c.window, paged=True),
    KVQChunkedCache: CacheKind("chunked", _same, lambda c: c.chunk_size),
    KVQBatchFullCache: CacheKind("full", _same),
    KVQBatchWindowCache: CacheKind("sliding", _same, lambda c: c.max_size),
    KVQIndexerCache: CacheKind("indexer", _same),
    KVQBatchIndexerCache: CacheKind("indexer", _same),
    KVQWindowRows: CacheKind("sliding", _same, lambda c: c.max_rows),
    KVQCompressedRows: CacheKind("compressed", _same),
    KVQIndexRows: CacheKind("indexer", _same),
    PendingRows: CacheKind("state", None),
    KVQDeepseekV41Cache: CacheKind("layer", _same, lambda c: c.window_size, one_sequence=True),
    KVQSplitCache: CacheKind("full", _same, paged=True, split=_same),
    KVQPagedSplitSequence: CacheKind("full", _same, paged=True, split=_same),
    KVQPagedSplitCache: CacheKind("full", _same, paged=True, split=_same),
    KVQSplitWindowCache: CacheKind("sliding", _same, lambda c: c.max_size, split=_same),
    KVQSplitChunkedCache: CacheKind("chunked", _same, lambda c: c.chunk_size, split=_same),
    KVQSplitBatchCache: CacheKind("full", _same, split=_same),
    KVQSplitBatchWindowCache: CacheKind("sliding", _same, lambda c: c.max_size, split=_same),
}


def _own_kind(own: OwnCache) -> CacheKind:
    return CacheKind("layer", None, lambda c: getattr(c, own.window_attribute), one_sequence=True)


# Model-specific cache classes (`model_facts.OwnCache`), by qualified name (no
# model module is imported for this). Their fields are planned one by one (see plan.py).
BY_NAME: dict[str, CacheKind] = {
    f.own_cache.qualname: _own_kind(f.own_cache) for f in FACTS.values() if f.own_cache
}

# Our own caches: already what a plan builds.
TWINS = frozenset(cls for cls, kind in REGISTRY.items() if kind.convert is _same)

# Containers: their members are looked up one by one.
CONTAINERS = (mlx_cache.CacheList, KVQDeepseekV41Cache)


def lookup(cache) -> CacheKind | None:
    """The declared kind of `cache`, by exact type (None if undeclared)."""
    kind = REGISTRY.get(type(cache))
    if kind is None:
        kind = BY_NAME.get(f"{type(cache).__module__}.{type(cache).__qualname__}")
    return kind


def leaves(cache) -> list:
    """The caches a slot holds: a container's members (recursively), else itself."""
    if type(cache) in CONTAINERS:
        return [leaf for c in cache.caches for leaf in leaves(c)]
    return [cache]


def report_leaves(cache) -> list:
    """What a report lists for a slot: its leaves, with the report views of
    deepseek_v41's open compression group (`PendingRows`), which are no caches."""
    if type(cache) is KVQDeepseekV41Cache:
        return list(cache.report_members)
    if type(cache) in CONTAINERS:
        return [leaf for c in cache.caches for leaf in report_leaves(c)]
    return [cache]


def is_twin(cache) -> bool:
    """True for a cache mlx-kvq made (a declared quantized twin)."""
    return type(cache) in TWINS


def quantize_cache(
    cache, key_spec: QuantSpec, value_spec: QuantSpec, start: int = 0, hand_out: str = PACKED
):
    """The quantized twin of one cache slot (containers recursively).

    Raises `TypeError` for a type nobody declared.
    """
    if type(cache) is mlx_cache.CacheList:
        members = [quantize_cache(c, key_spec, value_spec, start, hand_out) for c in cache.caches]
        return mlx_cache.CacheList(*members)
    kind = lookup(cache)
    if kind is None:
        raise TypeError(
            f"cache type {type(cache).__module__}.{type(cache).__name__} is not declared"
        )
    if kind.convert is None:
        return cache
    if is_split(key_spec, value_spec):
        if kind.split is None:
            raise TypeError(f"cache kind {kind.name} has no split layout (see plan.py)")
        return kind.split(cache, key_spec, value_spec, start, hand_out)
    return kind.convert(cache, key_spec, value_spec, start, hand_out)


# The classes a prompt file may name, by name: mlx-lm's caches and ours. A file
# naming anything else is refused (mlx-lm resolves names in its module's globals,
# where `mx` and every imported function live too).
PROMPT_FILE_CLASSES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        mlx_cache.KVCache,
        mlx_cache.RotatingKVCache,
        mlx_cache.QuantizedKVCache,
        mlx_cache.ChunkedKVCache,
        mlx_cache.ConcatenateKVCache,
        mlx_cache.ArraysCache,
        mlx_cache.CacheList,
        mlx_cache.BatchKVCache,
        mlx_cache.BatchRotatingKVCache,
        KVQFullCache,
        KVQWindowCache,
        KVQChunkedCache,
        KVQBatchFullCache,
        KVQBatchWindowCache,
        KVQIndexerCache,
        KVQBatchIndexerCache,
        KVQDeepseekV41Cache,
        KVQSplitCache,
        KVQSplitWindowCache,
        KVQSplitChunkedCache,
        KVQSplitBatchCache,
        KVQSplitBatchWindowCache,
    )
}


def register_for_prompt_files() -> None:
    """Make our classes resolvable where mlx-lm's `load_prompt_cache` looks
    them up (`globals()` of `mlx_lm.models.cache`): done when the process
    makes its first mlx-kvq cache, or loads a prompt file, never at import."""
    for name, cls in PROMPT_FILE_CLASSES.items():
        if cls.__module__.startswith("mlx_kvq.") and getattr(mlx_cache, name, None) is not cls:
            setattr(mlx_cache, name, cls)


on_first_cache(register_for_prompt_files)


# -- the paged layout -------------------------------------------------------------
def paging_refusal(model_type: str) -> str | None:
    """Why a model keeps the padded layout (None: its pageable layers page):
    paged attention derives masks from positions, so a model whose attention
    takes mask arrays laid out for a padded batch cannot page (`model_facts`)."""
    return facts(model_type).unpaged

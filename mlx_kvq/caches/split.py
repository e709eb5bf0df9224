"""The split layout's caches: full attention, sliding windows, chunked attention.

Each keeps one `SplitStore` (`mlx_kvq/split.py`): unquantized sinks, a
quantized body (per-channel keys, KIVI, when the key spec says so) and an
unquantized tail of the newest tokens. The tokens it holds are always one run
in token order (the head, then positions `[first, offset)`), so masks are
plain causal masks over that run: a window needs no ring, and drops whole
groups from the front of its body once no query can see them (it holds at
most its window, a group and the residual).

- `KVQSplitCache`: full attention (the twin of `KVCache`);
- `KVQSplitWindowCache`: a sliding window of `max_size` tokens, `keep` sinks
  always visible (the twin of `RotatingKVCache`);
- `KVQSplitChunkedCache`: llama4's chunked attention (the twin of
  `ChunkedKVCache`): `start_position` is its first held position, which the
  model's chunk mask reads;
- `KVQSplitBatchCache`: the batch form of the first two, one row each
  (attention receives `SplitRows`, masks from positions).
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import ChunkedKVCache, KVCache, RotatingKVCache, create_attention_mask

from ..config import QuantSpec
from ..mlx_lm_internals import BaseCache
from ..quant import Reread, SplitRows
from ..split import GROW, SplitStore, least_trim
from .base import DEQUANTIZED, DTYPES, PACKED, KVQCache


class SplitCache(KVQCache):
    """What the split caches share: the store, hand-out, bytes and prompt files."""

    grow: int | None = GROW  # body capacity step (None: exactly what it holds)
    sinks_of_kind = True  # full attention keeps the spec's sinks

    def _init_split(self, key_spec: QuantSpec, value_spec: QuantSpec, start: int,
                    hand_out: str, sinks: int | None = None) -> None:  # fmt: skip
        self._init_specs(key_spec, value_spec, start, hand_out)
        self.store = SplitStore(key_spec, value_spec, self.grow, start, sinks)
        self.offset = 0
        self.dtype = None

    @property
    def quantized(self) -> bool:
        return self.store.split_made and (self.key_spec.quantized or self.value_spec.quantized)

    limit: int | None = None  # a right-padded prompt's end: what follows is padding

    def _write(self, keys: mx.array, values: mx.array) -> Reread | None:
        self._remember_dtype(keys)
        reread = self.store.append(keys, values, self.limit)
        self.offset += keys.shape[2]
        return reread

    @property
    def _end(self) -> int:
        """Where the real tokens end (padding after a right-padded prompt excluded)."""
        return self.offset if self.limit is None else min(self.offset, self.limit)

    def fetch_row(self):
        """(keys, values) `SplitKV` and (head, first, end) positions, for a batch."""
        k, v = self.store.fetch()
        return k, v, (self.store.head_len, self.store.first, self.offset)

    def keys_and_values(self):
        if self.hand_out == DEQUANTIZED:
            return self.store.dequantize(self.dtype)
        return self.store.fetch()

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        reread = self._write(keys, values)
        if reread is None or self.kind != "full" or self.hand_out == DEQUANTIZED:
            return self.keys_and_values()
        # its queries read what a decode would have: a row of `SplitRows`
        k, v, (head, first, end) = self.fetch_row()
        return (
            SplitRows((k,), (head,), (first,), (end,), rereads=(reread,)),
            SplitRows((v,), (head,), (first,), (end,), rereads=(reread,)),
        )

    def empty(self) -> bool:
        return self.store.held == 0

    def exact_trim(self) -> int | None:
        return self.store.exact_trim()

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    def size(self) -> int:
        return self.store.held

    def describe(self) -> str:
        extra = []
        if self.store.sinks:
            extra.append(f"{self.store.sinks} sinks")
        if self.store.residual:
            extra.append(f"last {self.store.residual} exact")
        return super().describe() + "".join(f", {e}" for e in extra)

    # -- prompt files ---------------------------------------------------------
    def _meta(self) -> list:
        k, v = self.key_spec, self.value_spec
        return [
            k.bits or 0, k.group_size, k.rotation, int(k.per_channel), k.sinks, k.residual,
            v.bits or 0, v.group_size, v.rotation, v.sinks, v.residual,
            self.start, self.hand_out, self.store.sinks,
            "none" if self.dtype is None else str(self.dtype).split(".")[-1],
        ]  # fmt: skip

    def _set_meta(self, meta: list) -> None:
        kb, kg, kr, kc, ks, kres, vb, vg, vr, vs, vres, start, hand_out, sinks, dtype = meta
        if hand_out not in (PACKED, DEQUANTIZED):
            raise ValueError(f"unknown hand-out {hand_out!r} (expected {PACKED} or {DEQUANTIZED})")
        if dtype != "none" and dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
        k = QuantSpec(int(kb) or None, int(kg), kr, bool(int(kc)), int(ks), int(kres))
        v = QuantSpec(int(vb) or None, int(vg), vr, False, int(vs), int(vres))
        self._init_split(k, v, int(start), hand_out, int(sinks))
        self.dtype = None if dtype == "none" else DTYPES[dtype]
        self.store.dtype = self.dtype

    def _split_state(self) -> list:
        return [self.store.to_state(), self.offset, self._meta()]

    def _set_split_state(self, v) -> list:
        store, offset, meta, *rest = v
        self._set_meta(meta)
        self.store.set_state(store)
        self.store.dtype = self.dtype
        self.offset = int(offset)
        if self.offset != self.store.offset:
            raise ValueError(
                f"offset {self.offset} does not match the {self.store.offset} tokens the file holds"
            )
        return rest


class KVQSplitCache(SplitCache):
    """Full attention in the split layout: holds every token, in order."""

    kind = "full"

    def __init__(self, key_spec: QuantSpec, value_spec: QuantSpec, start: int = 0,
                 hand_out: str = PACKED):  # fmt: skip
        self._init_split(key_spec, value_spec, start, hand_out)

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = self.store.trim(min(n, self.offset))
        self.offset -= n
        return n

    @property
    def state(self):
        return self._split_state()

    @state.setter
    def state(self, v):
        self._set_split_state(v)

    @classmethod
    def merge(cls, caches: list[KVQSplitCache]) -> KVQSplitBatchCache:
        return KVQSplitBatchCache.merge(caches)

    @classmethod
    def from_cache(cls, cache: KVCache, key_spec: QuantSpec, value_spec: QuantSpec,
                   start: int = 0, hand_out: str = PACKED) -> KVQSplitCache:  # fmt: skip
        """The twin of a filled `KVCache`, same position."""
        q = cls(key_spec, value_spec, start, hand_out)
        if cache.keys is not None and cache.offset > 0:
            q._write(cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :])
        return q


class KVQSplitWindowCache(SplitCache):
    """A sliding window in the split layout: each query sees the `keep` sinks
    and the last `max_size - keep` positions up to its own. Whole body units no
    query can see any more are dropped before each write (a `set_rewind(n)`
    window keeps `n` more, so that `trim(n)` restores what it saw)."""

    kind = "sliding"
    bounded = True
    grow = None

    def __init__(self, max_size: int, key_spec: QuantSpec, value_spec: QuantSpec, keep: int = 0,
                 start: int = 0, hand_out: str = PACKED):  # fmt: skip
        if max_size <= keep:
            raise ValueError(
                f"sliding window max_size ({max_size}) must be larger than keep ({keep}), "
                "the sink tokens it always holds"
            )
        self.max_size = max_size
        self.keep = keep
        self.rewind = 0
        self._init_split(key_spec, value_spec, start, hand_out, keep)

    @property
    def window(self) -> int:
        """Positions each query sees besides the sinks (its own included)."""
        return self.max_size - self.keep

    def _drop_point(self) -> int:
        """The first position the next write's queries (at `offset` on) can see."""
        return self._end - self.window + 1 - self.rewind

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.store.drop_before(self._drop_point())
        return super().update_and_fetch(keys, values)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        """The mask of the next write of `N` tokens over what the cache will
        hand out then: the sinks, then the run `[first, offset + N)`."""
        window = self.window if window_size is None else window_size - self.keep
        s = self.store
        head = min(self.keep, self.offset + N) if s.head_len < self.keep else s.head_len
        first = max(head, s.first) + s.droppable(self._drop_point())
        pos = mx.concatenate([mx.arange(head), mx.arange(first, self.offset + N)])
        q = mx.arange(self.offset, self.offset + N)[:, None]
        visible = (pos[None] <= q) & ((pos[None] > q - window) | (mx.arange(pos.size) < head))
        hidden_by_window = first < self.offset + N - window  # some held key is out of the window
        if N == 1:
            return visible if hidden_by_window else None
        if return_array or hidden_by_window:
            return visible
        return "causal"

    def is_trimmable(self) -> bool:
        return self.rewind > 0 or self.store.dropped == 0

    def trim(self, n: int) -> int:
        n = self.store.trim(min(n, self.offset))
        self.offset -= n
        return n

    def set_rewind(self, n: int) -> None:
        """Keep `n` more tokens than the window, so that `trim(m)`, m <= n, rewinds exactly."""
        if n < 0:
            raise ValueError(f"rewind must be >= 0, got {n}")
        self.rewind = n

    @classmethod
    def merge(cls, caches: list[KVQSplitWindowCache]) -> KVQSplitBatchCache:
        return KVQSplitBatchCache.merge(caches)

    @property
    def state(self):
        return self._split_state() + [self.max_size, self.keep]

    @state.setter
    def state(self, v):
        max_size, keep = self._set_split_state(v)
        self.max_size, self.keep, self.rewind = int(max_size), int(keep), 0

    @classmethod
    def from_cache(cls, cache: RotatingKVCache, key_spec: QuantSpec, value_spec: QuantSpec,
                   start: int = 0, hand_out: str = PACKED) -> KVQSplitWindowCache:  # fmt: skip
        """The twin of a filled `RotatingKVCache`: its sinks and its window's tokens."""
        from .window import KVQWindowCache

        q = cls(cache.max_size, key_spec, value_spec, cache.keep, start, hand_out)
        if cache.keys is None or cache.offset == 0:
            return q
        raw = QuantSpec(None, key_spec.group_size)
        held = KVQWindowCache.from_cache(cache, raw, raw).held()
        keys, values = (s.dequantize() for s in held)
        q._remember_dtype(keys)
        n = keys.shape[2]
        head = min(cache.keep, n)
        if head:
            q.store.append(keys[..., :head, :], values[..., :head, :])
        q.store.dropped = cache.offset - n
        if n > head:
            q.store.append(keys[..., head:, :], values[..., head:, :])
        q.offset = cache.offset
        return q


class KVQSplitChunkedCache(SplitCache):
    """llama4's chunked attention in the split layout: holds at most the last
    `chunk_size` tokens (and the rest of the oldest group), from
    `start_position` on, which the model's chunk mask starts from."""

    kind = "chunked"
    bounded = True
    grow = None

    def __init__(self, chunk_size: int, key_spec: QuantSpec, value_spec: QuantSpec,
                 start: int = 0, hand_out: str = PACKED):  # fmt: skip
        self.chunk_size = chunk_size
        self._init_split(key_spec, value_spec, start, hand_out, 0)

    @property
    def start_position(self) -> int:
        return self.store.first

    def maybe_trim_front(self) -> None:
        self.store.drop_before(self.offset - self.chunk_size)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = self.store.trim(min(n, self.store.held))
        self.offset -= n
        return n

    @property
    def state(self):
        return self._split_state() + [self.chunk_size]

    @state.setter
    def state(self, v):
        (chunk,) = self._set_split_state(v)
        self.chunk_size = int(chunk)

    @classmethod
    def from_cache(cls, cache: ChunkedKVCache, key_spec: QuantSpec, value_spec: QuantSpec,
                   start: int = 0, hand_out: str = PACKED) -> KVQSplitChunkedCache:  # fmt: skip
        q = cls(cache.chunk_size, key_spec, value_spec, start, hand_out)
        if cache.keys is not None and cache.offset > cache.start_position:
            end = cache.offset - cache.start_position
            q._remember_dtype(cache.keys)
            q.store.dropped = cache.start_position
            q.store.append(cache.keys[..., :end, :], cache.values[..., :end, :])
            q.offset = cache.offset
        return q


class KVQSplitBatchCache(BaseCache):
    """A batch of split-layout rows (full attention or sliding windows): each
    row is its own one-sequence cache, with nothing padded (mlx-lm's
    `BatchGenerator` drives it: `merge`, `extend`, `filter`, `extract`,
    `prepare`/`finalize` for right-padded prompts). Attention receives
    `SplitRows`, whose masks come from positions, as paged K/V do."""

    kind = "full"
    bounded = False

    def __init__(self, rows: list[SplitCache]):
        self.rows = rows
        self.max_size = rows[0].max_size if self.bounded and rows else None

    @property
    def offset(self) -> mx.array:
        return mx.array([r.offset for r in self.rows], dtype=mx.int32)

    @property
    def key_spec(self) -> QuantSpec:
        return self.rows[0].key_spec

    @property
    def value_spec(self) -> QuantSpec:
        return self.rows[0].value_spec

    @property
    def start(self) -> int:
        return self.rows[0].start

    @property
    def hand_out(self) -> str:
        return self.rows[0].hand_out

    @property
    def quantized(self) -> bool:
        return any(r.quantized for r in self.rows)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[0] != len(self.rows):
            raise ValueError(f"split batch has {len(self.rows)} rows, got {keys.shape[0]}")
        rereads = []
        for b, r in enumerate(self.rows):
            if isinstance(r, KVQSplitWindowCache):
                r.store.drop_before(r._drop_point())
            rereads.append(r._write(keys[b : b + 1], values[b : b + 1]))
        return self.keys_and_values(tuple(rereads) if any(rereads) else ())

    def keys_and_values(self, rereads: tuple = ()):
        if self.hand_out == DEQUANTIZED:
            raise NotImplementedError(
                "split-layout batches hand attention packed rows; this model needs arrays "
                "(serve it with --kv-residual 0 --kv-sinks 0 --kv-key-scales token)"
            )
        ks, vs, heads, firsts, ends = [], [], [], [], []
        for r in self.rows:
            k, v, (h, f, e) = r.fetch_row()
            ks.append(k)
            vs.append(v)
            heads.append(h)
            firsts.append(f)
            ends.append(e)
        window = self.rows[0].window if self.bounded and self.rows else None
        return (
            SplitRows(tuple(ks), tuple(heads), tuple(firsts), tuple(ends), window, rereads),
            SplitRows(tuple(vs), tuple(heads), tuple(firsts), tuple(ends), window, rereads),
        )

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None, **_):
        """ "causal" (or None for one token): attention derives each row's mask
        from positions (`SplitRows`)."""
        if return_array:
            raise NotImplementedError(
                "split-layout batches derive masks from positions; this model asks for mask "
                "arrays (serve it with --kv-residual 0 --kv-sinks 0 --kv-key-scales token)"
            )
        return "causal" if N > 1 else None

    # -- BatchGenerator's calls -----------------------------------------------
    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        if left_padding is not None and max(left_padding) > 0:
            raise ValueError("split-layout batches take no left padding")
        if right_padding is not None and max(right_padding) > 0:
            for r, n in zip(self.rows, lengths, strict=True):
                r.limit = r.offset + int(n)

    def finalize(self) -> None:
        for r in self.rows:
            if r.limit is not None:
                r.trim(r.offset - r.limit)
                r.limit = None

    def size(self) -> int:
        return max((r.size() for r in self.rows), default=0)

    def empty(self) -> bool:
        return all(r.empty() for r in self.rows)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rows)

    def is_trimmable(self) -> bool:
        return all(r.is_trimmable() for r in self.rows)

    def exact_trim(self) -> int | None:
        return least_trim(r.exact_trim() for r in self.rows)

    def trim(self, n: int) -> int:
        return min((r.trim(n) for r in self.rows), default=0)

    def filter(self, batch_indices) -> None:
        if isinstance(batch_indices, mx.array):
            batch_indices = batch_indices.tolist()
        self.rows = [self.rows[int(i)] for i in batch_indices]

    def extend(self, other: KVQSplitBatchCache) -> None:
        self.rows = self.rows + other.rows
        other.rows = []

    def extract(self, idx: int) -> SplitCache:
        return copy.deepcopy(self.rows[idx])

    @classmethod
    def merge(cls, caches: list[SplitCache]) -> KVQSplitBatchCache:
        kinds = sorted({type(c).__name__ for c in caches})
        if len(kinds) != 1:
            raise ValueError(f"a split batch merges caches of one kind, got {kinds}")
        rows = [copy.deepcopy(c) for c in caches]
        if isinstance(caches[0], KVQSplitWindowCache):
            if len({c.max_size for c in caches}) != 1:
                raise ValueError("a split window batch merges windows of one size")
            return KVQSplitBatchWindowCache(rows)
        return KVQSplitBatchCache(rows)

    def describe(self) -> str:
        return self.rows[0].describe() if self.rows else "split batch (empty)"

    @property
    def state(self):
        return [[r.state for r in self.rows], [type(r).__name__ for r in self.rows]]

    @state.setter
    def state(self, v):
        states, names = v
        classes = {c.__name__: c for c in (KVQSplitCache, KVQSplitWindowCache)}
        rows = []
        for st, name in zip(states, names, strict=True):
            if name not in classes:
                raise ValueError(f"unknown split row class {name!r}")
            r = classes[name].__new__(classes[name])
            r.state = st
            rows.append(r)
        self.rows = rows


class KVQSplitBatchWindowCache(KVQSplitBatchCache):
    """A batch of split-layout sliding windows (see `KVQSplitBatchCache`)."""

    kind = "sliding"
    bounded = True

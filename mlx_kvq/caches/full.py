"""Full attention, one sequence: the quantized twin of mlx-lm's `KVCache`."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, create_attention_mask

from ..config import QuantSpec
from ..quant import Store, dynamic_roll
from .base import PACKED, KVQCache
from .batch import BatchKVQCache, merge_stores


class KVQFullCache(KVQCache):
    """Grows in 256-token steps like `KVCache`; stores keys and values quantized."""

    kind = "full"

    def __init__(
        self,
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        start: int = 0,
        hand_out: str = PACKED,
    ):
        self._init_specs(key_spec, value_spec, start, hand_out)
        self.offset = 0
        self.dtype = None

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._remember_dtype(keys)
        k, v = self._encode(keys, values)
        prev, n = self.offset, keys.shape[2]
        self._make_room(prev, k, v)
        self.offset += n
        self._keys[..., prev : self.offset, :] = k
        self._values[..., prev : self.offset, :] = v
        return self.keys_and_values()

    def keys_and_values(self):
        k, v = self._keys, self._values
        if self.offset < k.length:
            k, v = k[..., : self.offset, :], v[..., : self.offset, :]
        return self._hand_out(k, v)

    def size(self) -> int:
        return self.offset

    def held(self) -> tuple[Store, Store] | None:
        """The stores of the tokens held (None when empty)."""
        if self._keys is None or self.offset == 0:
            return None
        return self._keys[..., : self.offset, :], self._values[..., : self.offset, :]

    @classmethod
    def holding(
        cls, keys: Store, values: Store, key_spec: QuantSpec, value_spec: QuantSpec, dtype
    ) -> KVQFullCache:
        """A cache holding `keys`/`values` (1, H, n, D), the first n tokens."""
        q = cls(key_spec, value_spec)
        q.dtype = dtype
        q._keys, q._values = keys, values
        q.offset = keys.length
        return q

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    @property
    def state(self):
        return [self._store_state(self.offset), self.offset, self._spec_state()]

    @state.setter
    def state(self, v):
        stores, offset, meta = v
        self._set_spec_state(meta)
        self._set_store_state(stores)
        held = 0 if self._keys is None else self._keys.length
        if not 0 <= int(offset) <= held:
            raise ValueError(f"offset {int(offset)} outside the {held} rows the file holds")
        self.offset = int(offset)

    @classmethod
    def merge(cls, caches):
        return KVQBatchFullCache.merge(caches)

    @classmethod
    def from_cache(
        cls,
        cache: KVCache,
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        start: int = 0,
        hand_out: str = PACKED,
    ) -> KVQFullCache:
        """The quantized twin of a filled `KVCache`, same position."""
        q = cls(key_spec, value_spec, start, hand_out)
        if cache.keys is not None and cache.offset > 0:
            q.update_and_fetch(
                cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
            )
            q._maybe_convert()
        return q


class KVQBatchFullCache(BatchKVQCache):
    """Left-padded batch of full-attention caches."""

    kind = "full"
    single = KVQFullCache  # what `extract` returns

    def __init__(
        self,
        left_padding: list[int],
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        start: int = 0,
        hand_out: str = PACKED,
    ):
        self._init_specs(key_spec, value_spec, start, hand_out)
        self._init_batch(left_padding)
        self._right_padding = None

    @property
    def _token_count(self) -> int:
        return self._idx

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._remember_dtype(keys)
        k, v = self._encode(keys, values)
        prev, n = self._idx, keys.shape[2]
        self._make_room(prev, k, v)
        self.offset = self.offset + n
        self._idx += n
        self._keys[..., prev : self._idx, :] = k
        self._values[..., prev : self._idx, :] = v
        return self.keys_and_values()

    def keys_and_values(self):
        return self._hand_out(self._keys[..., : self._idx, :], self._values[..., : self._idx, :])

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        self._add_left_padding(left_padding)
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        if self._right_padding is not None:
            pad = self._right_padding
            self._keys = self._keys.map(lambda a: dynamic_roll(a, pad[:, None], axis=2))
            self._values = self._values.map(lambda a: dynamic_roll(a, pad[:, None], axis=2))
            self.offset = self.offset - pad
            self.left_padding = self.left_padding + pad
            self._right_padding = None

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def size(self) -> int:
        return self._idx

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def filter(self, batch_indices) -> None:
        # Cut the padding no kept row needs before taking the rows: the row
        # gather then copies only what is kept (a slice taken after it would be
        # a view that keeps the whole gathered buffer alive, unseen by nbytes).
        min_left = min(self.left_padding[mx.array(batch_indices)].tolist())
        if min_left > 0:
            if self._keys is not None:
                self._keys = self._keys[..., min_left:, :]
                self._values = self._values[..., min_left:, :]
            self._idx -= min_left
            self.left_padding = self.left_padding - min_left
        self._filter_rows(batch_indices)

    def extend(self, other: KVQBatchFullCache) -> None:
        self._extend_stores(other)

    def extract(self, idx: int) -> KVQFullCache:
        cache = self.single(self.key_spec, self.value_spec, self.start, self.hand_out)
        cache.dtype = self.dtype
        pad = self.left_padding.tolist()[idx]
        cache._keys = self._keys[idx : idx + 1, :, pad : self._idx].map(mx.contiguous)
        cache._values = self._values[idx : idx + 1, :, pad : self._idx].map(mx.contiguous)
        cache.offset = cache._keys.length
        return cache

    @classmethod
    def merge(cls, caches: list[KVQFullCache]) -> KVQBatchFullCache:
        c0 = caches[0]
        lengths = [c.size() for c in caches]
        if max(lengths) == 0:
            return cls([0] * len(caches), c0.key_spec, c0.value_spec, c0.start, c0.hand_out)
        keys, values, padding = merge_stores(
            caches, lengths, lambda c, n: (c._keys[..., :n, :], c._values[..., :n, :])
        )
        cache = cls(padding, c0.key_spec, c0.value_spec, c0.start, c0.hand_out)
        cache._keys, cache._values = keys, values
        cache.offset = cache.offset + keys.length
        cache._idx = keys.length
        cache.dtype = next(c.dtype for c in caches if c.dtype is not None)
        return cache

    @property
    def state(self):
        return self._state_common()

    @state.setter
    def state(self, v):
        self._set_state_common(v)
        self._right_padding = None

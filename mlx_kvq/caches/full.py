"""Full attention, one sequence: the quantized twin of mlx-lm's `KVCache`."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache, create_attention_mask

from ..config import QuantSpec
from .base import PACKED, KVQCache


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
        self.keys[..., prev : self.offset, :] = k
        self.values[..., prev : self.offset, :] = v
        return self.keys_and_values()

    def keys_and_values(self):
        k, v = self.keys, self.values
        if self.offset < k.length:
            k, v = k[..., : self.offset, :], v[..., : self.offset, :]
        return self._hand_out(k, v)

    def size(self) -> int:
        return self.offset

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
        return [self._store_state(), self.offset, self._spec_state()]

    @state.setter
    def state(self, v):
        stores, offset, meta = v
        self._set_spec_state(meta)
        self._set_store_state(stores)
        self.offset = int(offset)

    @classmethod
    def merge(cls, caches):
        from .batch import KVQBatchFullCache

        return KVQBatchFullCache.merge(caches)

    @classmethod
    def from_cache(
        cls, cache: KVCache, key_spec: QuantSpec, value_spec: QuantSpec, start: int = 0,
        hand_out: str = PACKED,
    ) -> KVQFullCache:
        """The quantized twin of a filled `KVCache`, same position."""
        q = cls(key_spec, value_spec, start, hand_out)
        if cache.keys is not None and cache.offset > 0:
            q.update_and_fetch(cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :])
            q._maybe_convert()
        return q

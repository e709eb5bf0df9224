"""Chunked attention (llama4): the quantized twin of `ChunkedKVCache`.

The model calls `maybe_trim_front()` before each forward pass and builds its
own chunk mask from `start_position`, so this cache only has to keep at most
`chunk_size` tokens in front of the new ones.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ChunkedKVCache

from ..config import QuantSpec
from .base import PACKED, KVQCache


class KVQChunkedCache(KVQCache):
    kind = "chunked"
    bounded = True

    def __init__(
        self,
        chunk_size: int,
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        start: int = 0,
        hand_out: str = PACKED,
    ):
        self._init_specs(key_spec, value_spec, start, hand_out)
        self.chunk_size = chunk_size
        self.offset = 0
        self.start_position = 0
        self.dtype = None

    def maybe_trim_front(self) -> None:
        if self._keys is None:
            return
        valid = self.offset - self.start_position
        if valid > self.chunk_size:
            trim = valid - self.chunk_size
            self.start_position += trim
            self._keys = self._keys[..., trim:valid, :]
            self._values = self._values[..., trim:valid, :]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._remember_dtype(keys)
        k, v = self._encode(keys, values)
        prev, n = self.offset - self.start_position, keys.shape[2]
        self._make_room(prev, k, v)
        self.offset += n
        end = self.offset - self.start_position
        self._keys[..., prev:end, :] = k
        self._values[..., prev:end, :] = v
        return self.keys_and_values()

    def keys_and_values(self):
        end = self.offset - self.start_position
        return self._hand_out(self._keys[..., :end, :], self._values[..., :end, :])

    def size(self) -> int:
        return self.offset - self.start_position

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset - self.start_position, n)
        self.offset -= n
        return n

    @property
    def state(self):
        return [
            self._store_state(),
            self.offset,
            self.chunk_size,
            self.start_position,
            self._spec_state(),
        ]

    @state.setter
    def state(self, v):
        stores, offset, chunk, start_position, meta = v
        self._set_spec_state(meta)
        self._set_store_state(stores)
        self.offset, self.chunk_size, self.start_position = (
            int(offset),
            int(chunk),
            int(start_position),
        )

    @classmethod
    def from_cache(
        cls,
        cache: ChunkedKVCache,
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        start: int = 0,
        hand_out: str = PACKED,
    ) -> KVQChunkedCache:
        q = cls(cache.chunk_size, key_spec, value_spec, start, hand_out)
        q.start_position = cache.start_position
        q.offset = cache.start_position
        if cache.keys is not None and cache.offset > cache.start_position:
            end = cache.offset - cache.start_position
            q.update_and_fetch(cache.keys[..., :end, :], cache.values[..., :end, :])
            q._maybe_convert()
        return q

"""Batch forms of the full and sliding-window caches, for continuous batching.

They follow mlx-lm's `BatchKVCache` / `BatchRotatingKVCache` conventions
(left padding, `prepare`/`finalize` for right-padded prompts, `merge`,
`extract`, `filter`, `extend`), so mlx-lm's `BatchGenerator` drives them
unchanged, and they store keys and values through `Store`, so a batch stays
quantized and a batched window stays bounded by `max_size` slots.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from ..config import QuantSpec
from ..quant import Store, dynamic_roll
from .base import PACKED, KVQCache
from .full import KVQFullCache
from .window import KVQWindowCache


def _merge_stores(caches: list, lengths: list[int], fetch) -> tuple[Store, Store, list[int]]:
    """Right-align each cache's tokens in one left-padded batch store."""
    max_length = max(lengths)
    padding = [max_length - n for n in lengths]
    filled = [c for c in caches if c.keys is not None]
    # Per tensor: keys and values convert independently (key_bits=None keeps
    # keys raw while values are quantized).
    quantize_k = any(c.keys.quantized for c in filled)
    quantize_v = any(c.values.quantized for c in filled)
    template = filled[0]
    kspec, vspec = template.key_spec, template.value_spec

    def conv_k(s: Store) -> Store:
        return s.quantize(kspec) if quantize_k else s

    def conv_v(s: Store) -> Store:
        return s.quantize(vspec) if quantize_v else s

    k0 = conv_k(template.keys)
    v0 = conv_v(template.values)
    keys = k0.zeros(max_length, batch=len(caches))
    values = v0.zeros(max_length, batch=len(caches))
    for i, (p, n, c) in enumerate(zip(padding, lengths, caches, strict=True)):
        if c.keys is None or n == 0:
            continue
        k, v = fetch(c, n)
        keys[i : i + 1, :, p : p + n] = conv_k(k)
        values[i : i + 1, :, p : p + n] = conv_v(v)
    return keys, values, padding


def _pad_pair(c, max_idx: int, max_size: int, template: Store, other_t: Store):
    """Pad one side of an `extend` so both are right-justified at `max_idx`."""
    k, v = c.keys, c.values
    if k is None:
        b = c.offset.shape[0]
        k, v = template.zeros(0, batch=b), other_t.zeros(0, batch=b)
    left = max_idx - c._idx
    right = max_size - k.length - left
    if right < 0:
        k, v = k[..., :right, :], v[..., :right, :]
        right = 0
    if left or right:
        widths = [(0, 0), (0, 0), (left, right), (0, 0)]
        k, v = k.map(lambda a: mx.pad(a, widths)), v.map(lambda a: mx.pad(a, widths))
    return k, v, c.offset, c.left_padding + left


class _BatchBase(KVQCache):
    def _init_batch(self, left_padding: list[int]) -> None:
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self.dtype = None

    def _align_modes(self, other: _BatchBase) -> None:
        """Before joining two batches, store both the same way."""
        if self.keys is None or other.keys is None:
            return
        if self.keys.quantized != other.keys.quantized or self.values.quantized != other.values.quantized:
            for c in (self, other):
                c.keys = c.keys.quantize(c.key_spec)
                c.values = c.values.quantize(c.value_spec)

    def _add_left_padding(self, left_padding) -> None:
        if left_padding is None:
            return
        if self.keys is not None:
            raise ValueError("Left padding can only be added to an empty batch cache")
        left_padding = mx.array(left_padding)
        self.left_padding = self.left_padding + left_padding
        self.offset = self.offset - left_padding

    def _filter_rows(self, batch_indices) -> None:
        if self.keys is not None:
            self.keys = self.keys[batch_indices]
            self.values = self.values[batch_indices]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]

    def _extend_stores(self, other: _BatchBase) -> bool:
        """Concatenate rows; returns False when both sides were empty."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return False
        self._align_modes(other)
        kt = (self.keys or other.keys)
        vt = (self.values or other.values)
        max_idx = max(self._idx, other._idx)
        max_size = max(c.keys.length for c in (self, other) if c.keys is not None)
        a = _pad_pair(self, max_idx, max_size, kt, vt)
        b = _pad_pair(other, max_idx, max_size, kt, vt)
        self.keys = Store.concat([a[0], b[0]], axis=0)
        self.values = Store.concat([a[1], b[1]], axis=0)
        self.offset = mx.concatenate([a[2], b[2]])
        self.left_padding = mx.concatenate([a[3], b[3]])
        self._idx = max_idx
        self.dtype = self.dtype or other.dtype
        return True

    def _state_common(self) -> list:
        return [self._store_state(), self.offset, self.left_padding, self._idx, self._spec_state()]

    def _set_state_common(self, v) -> list:
        stores, self.offset, self.left_padding, idx, meta, *rest = v
        self._set_spec_state(meta)
        self._set_store_state(stores)
        self._idx = int(idx)
        return rest


class KVQBatchFullCache(_BatchBase):
    """Left-padded batch of full-attention caches."""

    kind = "full"

    def __init__(
        self, left_padding: list[int], key_spec: QuantSpec, value_spec: QuantSpec,
        start: int = 0, hand_out: str = PACKED,
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
        self.keys[..., prev : self._idx, :] = k
        self.values[..., prev : self._idx, :] = v
        return self.keys_and_values()

    def keys_and_values(self):
        return self._hand_out(self.keys[..., : self._idx, :], self.values[..., : self._idx, :])

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        self._add_left_padding(left_padding)
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        if self._right_padding is not None:
            pad = self._right_padding
            self.keys = self.keys.map(lambda a: dynamic_roll(a, pad[:, None], axis=2))
            self.values = self.values.map(lambda a: dynamic_roll(a, pad[:, None], axis=2))
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
        self._filter_rows(batch_indices)
        min_left = min(self.left_padding.tolist())
        if min_left > 0:
            if self.keys is not None:
                self.keys = self.keys[..., min_left:, :]
                self.values = self.values[..., min_left:, :]
            self._idx -= min_left
            self.left_padding = self.left_padding - min_left

    def extend(self, other: KVQBatchFullCache) -> None:
        self._extend_stores(other)

    def extract(self, idx: int) -> KVQFullCache:
        cache = KVQFullCache(self.key_spec, self.value_spec, self.start, self.hand_out)
        cache.dtype = self.dtype
        pad = self.left_padding.tolist()[idx]
        cache.keys = self.keys[idx : idx + 1, :, pad : self._idx].map(mx.contiguous)
        cache.values = self.values[idx : idx + 1, :, pad : self._idx].map(mx.contiguous)
        cache.offset = cache.keys.length
        return cache

    @classmethod
    def merge(cls, caches: list[KVQFullCache]) -> KVQBatchFullCache:
        c0 = caches[0]
        lengths = [c.size() for c in caches]
        if max(lengths) == 0:
            return cls([0] * len(caches), c0.key_spec, c0.value_spec, c0.start, c0.hand_out)
        keys, values, padding = _merge_stores(
            caches, lengths, lambda c, n: (c.keys[..., :n, :], c.values[..., :n, :])
        )
        cache = cls(padding, c0.key_spec, c0.value_spec, c0.start, c0.hand_out)
        cache.keys, cache.values = keys, values
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


class KVQBatchWindowCache(_BatchBase):
    """Left-padded batch of sliding-window rings; bounded by `max_size` slots."""

    kind = "sliding"

    def __init__(
        self, max_size: int, left_padding: list[int], key_spec: QuantSpec, value_spec: QuantSpec,
        start: int = 0, hand_out: str = PACKED,
    ):
        self._init_specs(key_spec, value_spec, start, hand_out)
        self._init_batch(left_padding)
        self.max_size = max_size
        self.keep = 0
        self._offset = 0
        self.rotated = False
        self._lengths = None

    @property
    def _token_count(self) -> int:
        return self._offset

    def _roll_rows(self, shifts: mx.array) -> None:
        self.keys = self.keys.map(lambda a: dynamic_roll(a, shifts[:, None], axis=2))
        self.values = self.values.map(lambda a: dynamic_roll(a, shifts[:, None], axis=2))

    def _temporal_order(self) -> None:
        if self.rotated:
            self.keys = self.keys.map(lambda a: mx.roll(a, -self._idx, axis=2))
            self.values = self.values.map(lambda a: mx.roll(a, -self._idx, axis=2))
            self._idx = self.keys.length
            self.rotated = False

    def _update_concat(self, k: Store, v: Store) -> None:
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self._temporal_order()
            if self.keys.length > self._idx:
                self.keys = self.keys[..., : self._idx, :]
                self.values = self.values[..., : self._idx, :]
            if self._lengths is not None:
                roll = mx.maximum(0, self.offset - self._lengths)
                self._roll_rows(roll)
                self.left_padding = self.left_padding + roll
                self.offset = self.offset - roll
            trim_size = self._idx - self.max_size + 1
            if trim_size > 0:
                self.left_padding = self.left_padding - trim_size
                self.keys = self.keys[..., trim_size:, :]
                self.values = self.values[..., trim_size:, :]
            self.keys = Store.concat([self.keys, k])
            self.values = Store.concat([self.values, v])
        n = k.length
        self.offset = self.offset + n
        self._offset += n
        self._idx = self.keys.length

    def _update_in_place(self, k: Store, v: Store) -> None:
        if self._lengths is not None:
            raise RuntimeError("finalize() must be called before decoding with a batch window cache")
        prev = self._offset
        if self.keys is None or (prev >= self.keys.length and self.keys.length < self.max_size):
            self._append_room(k, v, min(self.step, self.max_size - prev))
            self._idx = prev
        trim_size = self.keys.length - self.max_size
        if trim_size > 0:
            self.keys = self.keys[..., trim_size:, :]
            self.values = self.values[..., trim_size:, :]
            self._idx = self.max_size
            self.left_padding = self.left_padding - trim_size
        if self._idx == self.max_size:
            self.rotated = True
            self._idx = 0
        if self.rotated:
            self.left_padding = self.left_padding - 1
        self.keys[..., self._idx : self._idx + 1, :] = k
        self.values[..., self._idx : self._idx + 1, :] = v
        self._offset += 1
        self.offset = self.offset + 1
        self._idx += 1

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._remember_dtype(keys)
        k, v = self._encode(keys, values)
        if keys.shape[2] == 1:
            self._update_in_place(k, v)
        else:
            self._update_concat(k, v)
        return self.keys_and_values()

    def keys_and_values(self):
        k, v = self.keys, self.values
        if self._offset < k.length:
            k, v = k[..., : self._offset, :], v[..., : self._offset, :]
        return self._hand_out(k, v)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        self._add_left_padding(left_padding)
        if right_padding is not None and max(right_padding) > 0:
            self._lengths = mx.array(lengths) + self.offset

    def finalize(self) -> None:
        if self._lengths is not None:
            roll = mx.maximum(0, self.offset - self._lengths)
            self._roll_rows(roll)
            self.left_padding = self.left_padding + roll
            self.offset = self.offset - roll
            self._lengths = None

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        left_padding = self.left_padding
        window_size = window_size or self.max_size
        offset = min(self.max_size - 1, self._offset)
        rinds = mx.arange(offset + N)
        linds = mx.arange(offset, offset + N) if offset else rinds
        linds, rinds = linds[:, None], rinds[None]
        mask = (linds >= rinds) & (linds < rinds + window_size)
        if (trim_size := self._idx - self.max_size + int(N > 1)) > 0:
            left_padding = left_padding - trim_size
        rotated = N == 1 and (self.rotated or self._idx >= self.max_size)
        if rotated:
            left_padding = left_padding - 1
        mask = mask & (rinds >= mx.expand_dims(left_padding, (1, 2, 3)))
        if rotated:
            idx = 0 if self._idx >= self.max_size else self._idx
            mask = mx.roll(mask, shift=idx + 1, axis=-1)
        return mask

    def size(self) -> int:
        return min(self._offset, self.max_size)

    def is_trimmable(self) -> bool:
        return self._offset < self.max_size

    def trim(self, n: int) -> int:
        n = min(self._offset, n)
        self._offset -= n
        self._idx -= n
        self.offset = self.offset - n
        return n

    def filter(self, batch_indices) -> None:
        self._filter_rows(batch_indices)

    def extend(self, other: KVQBatchWindowCache) -> None:
        if self.keys is not None and other.keys is not None and (
            self.rotated != other.rotated or self._idx != other._idx
        ):
            self._temporal_order()
            other._temporal_order()
        if self._extend_stores(other):
            self._offset = max(self._offset, other._offset)

    def extract(self, idx: int) -> KVQWindowCache:
        mx.eval(self.left_padding, self.offset)
        cache = KVQWindowCache(self.max_size, self.key_spec, self.value_spec, 0, self.start, self.hand_out)
        cache.dtype = self.dtype
        pad = max(0, self.left_padding.tolist()[idx])
        k, v = self.keys[idx : idx + 1], self.values[idx : idx + 1]
        end = self._idx
        if self.rotated:
            k = k.map(lambda a: mx.roll(a, -self._idx, axis=2))
            v = v.map(lambda a: mx.roll(a, -self._idx, axis=2))
            end = self.max_size
        cache.keys = k[:, :, pad:end].map(mx.contiguous)
        cache.values = v[:, :, pad:end].map(mx.contiguous)
        cache.offset = self.offset.tolist()[idx]
        cache._idx = cache.keys.length
        return cache

    @classmethod
    def merge(cls, caches: list[KVQWindowCache]) -> KVQBatchWindowCache:
        c0 = caches[0]
        if any(c.max_size != c0.max_size for c in caches):
            raise ValueError("batch window caches can only merge caches with the same max_size")
        if any(c.keep for c in caches):
            raise ValueError(
                "batched sliding-window caches do not keep sink tokens (keep > 0); "
                "mlx-lm's batch rotating cache drops them, and mlx-kvq refuses rather than drop"
            )
        offsets = [c.offset for c in caches]
        lengths = [c.size() for c in caches]
        if max(lengths) == 0:
            return cls(c0.max_size, [0] * len(caches), c0.key_spec, c0.value_spec, c0.start, c0.hand_out)

        def fetch(c: KVQWindowCache, n: int):
            return c._temporal_order(c.keys)[..., -n:, :], c._temporal_order(c.values)[..., -n:, :]

        keys, values, padding = _merge_stores(caches, lengths, fetch)
        cache = cls(c0.max_size, padding, c0.key_spec, c0.value_spec, c0.start, c0.hand_out)
        cache.keys, cache.values = keys, values
        cache.offset = mx.array(offsets)
        cache._idx = keys.length
        cache._offset = keys.length
        cache.dtype = next(c.dtype for c in caches if c.dtype is not None)
        return cache

    @property
    def state(self):
        return self._state_common() + [self.max_size, self._offset, self.rotated]

    @state.setter
    def state(self, v):
        max_size, offset, rotated = self._set_state_common(v)
        self.max_size, self._offset, self.rotated = int(max_size), int(offset), bool(rotated)
        self.keep = 0
        self._lengths = None

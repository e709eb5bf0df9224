"""What the batch forms of the full and sliding-window caches share.

The batch forms (`KVQBatchFullCache` in full.py, `KVQBatchWindowCache` in
window.py, each beside its single-sequence cache as in mlx-lm's cache.py)
follow mlx-lm's `BatchKVCache` / `BatchRotatingKVCache` conventions
(left padding, `prepare`/`finalize` for right-padded prompts, `merge`,
`extract`, `filter`, `extend`), so mlx-lm's `BatchGenerator` drives them
unchanged, and they store keys and values through `Store`, so a batch stays
quantized and a batched window stays bounded by `max_size` slots.
"""

from __future__ import annotations

import mlx.core as mx

from ..quant import Store
from .base import KVQCache


def merge_stores(caches: list, lengths: list[int], fetch) -> tuple[Store, Store, list[int]]:
    """Right-align each cache's tokens in one left-padded batch store."""
    max_length = max(lengths)
    padding = [max_length - n for n in lengths]
    filled = [c for c in caches if c._keys is not None]
    # Per tensor: keys and values convert independently (key_bits=None keeps
    # keys raw while values are quantized).
    quantize_k = any(c._keys.quantized for c in filled)
    quantize_v = any(c._values.quantized for c in filled)
    template = filled[0]
    kspec, vspec = template.key_spec, template.value_spec

    def conv_k(s: Store) -> Store:
        return s.quantize(kspec) if quantize_k else s

    def conv_v(s: Store) -> Store:
        return s.quantize(vspec) if quantize_v else s

    k0 = conv_k(template._keys)
    v0 = conv_v(template._values)
    keys = k0.zeros(max_length, batch=len(caches))
    values = v0.zeros(max_length, batch=len(caches))
    for i, (p, n, c) in enumerate(zip(padding, lengths, caches, strict=True)):
        if c._keys is None or n == 0:
            continue
        k, v = fetch(c, n)
        keys[i : i + 1, :, p : p + n] = conv_k(k)
        values[i : i + 1, :, p : p + n] = conv_v(v)
    return keys, values, padding


def pad_pair(c, max_idx: int, max_size: int, template: Store, other_t: Store):
    """Pad one side of an `extend` so both are right-justified at `max_idx`."""
    k, v = c._keys, c._values
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


class BatchKVQCache(KVQCache):
    def _init_batch(self, left_padding: list[int]) -> None:
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self.dtype = None

    def _align_modes(self, other: BatchKVQCache) -> None:
        """Before joining two batches, store both the same way."""
        if self._keys is None or other._keys is None:
            return
        if (
            self._keys.quantized != other._keys.quantized
            or self._values.quantized != other._values.quantized
        ):
            for c in (self, other):
                c._keys = c._keys.quantize(c.key_spec)
                c._values = c._values.quantize(c.value_spec)

    def _add_left_padding(self, left_padding) -> None:
        if left_padding is None:
            return
        if self._keys is not None:
            raise ValueError("Left padding can only be added to an empty batch cache")
        left_padding = mx.array(left_padding)
        self.left_padding = self.left_padding + left_padding
        self.offset = self.offset - left_padding

    def _filter_rows(self, batch_indices) -> None:
        if self._keys is not None:
            self._keys = self._keys[batch_indices]
            self._values = self._values[batch_indices]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]

    def _extend_stores(self, other: BatchKVQCache) -> bool:
        """Concatenate rows; returns False when both sides were empty."""
        if self._keys is None and other._keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return False
        self._align_modes(other)
        kt = self._keys or other._keys
        vt = self._values or other._values
        max_idx = max(self._idx, other._idx)
        max_size = max(c._keys.length for c in (self, other) if c._keys is not None)
        a = pad_pair(self, max_idx, max_size, kt, vt)
        b = pad_pair(other, max_idx, max_size, kt, vt)
        self._keys = Store.concat([a[0], b[0]], axis=0)
        self._values = Store.concat([a[1], b[1]], axis=0)
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

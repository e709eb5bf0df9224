"""Sliding window, one sequence: the quantized twin of `RotatingKVCache`.

The ring keeps `keep` sink tokens at the front and at most `max_size` slots,
so its bytes stay bounded however long the conversation runs. Multi-token
updates put the ring in temporal order and append (as mlx-lm does);
one-token updates write a slot in place, so decoding never reorders the ring.

A wrapped ring has overwritten its oldest tokens, so it cannot be trimmed
back, which speculative decoding needs after rejected drafts. `set_rewind(n)`
makes it keep the last `n` tokens it evicts (in their stored, quantized
form): `trim` then puts the ring back exactly as it was before the last `n`
tokens, and the window stays bounded (`max_size + n` slots at most).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import RotatingKVCache

from ..config import QuantSpec
from ..mlx_lm_internals import ring_index
from ..quant import Store, dynamic_roll
from .base import PACKED, KVQCache
from .batch import BatchKVQCache, merge_stores


class KVQWindowCache(KVQCache):
    kind = "sliding"
    bounded = True
    rewind = 0  # evicted tokens kept for `trim` (see `set_rewind`)
    _evicted: tuple[Store, Store] | None = None  # (keys, values), oldest first

    def __init__(
        self,
        max_size: int,
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        keep: int = 0,
        start: int = 0,
        hand_out: str = PACKED,
    ):
        if max_size <= keep:
            raise ValueError(
                f"sliding window max_size ({max_size}) must be larger than keep ({keep}), "
                "the sink tokens it always holds (windows made for --max-kv-size / "
                f"max_kv_size keep {keep}: use a max kv size above {keep})"
            )
        self._init_specs(key_spec, value_spec, start, hand_out)
        self.max_size = max_size
        self.keep = keep
        self.offset = 0
        self._idx = 0
        self.dtype = None

    # -- ring mechanics -----------------------------------------------------
    def _trim(self, trim_size: int, v: Store, append: Store | None = None) -> Store:
        parts = [v]
        if trim_size > 0:
            parts = [v[..., : self.keep, :], v[..., trim_size + self.keep :, :]]
        if append is not None:
            parts.append(append)
        return Store.concat(parts) if len(parts) > 1 else parts[0]

    def _temporal_order(self, v: Store) -> Store:
        """The ring in temporal order, unused tail sliced off."""
        if self._idx == v.length:
            return v
        if self._idx < self.offset:
            return Store.concat(
                [v[..., : self.keep, :], v[..., self._idx :, :], v[..., self.keep : self._idx, :]]
            )
        return v[..., : self._idx, :]

    def _update_concat(self, k: Store, v: Store) -> None:
        if self._keys is None:
            self._keys, self._values = k, v
        else:
            self._keys = self._temporal_order(self._keys)
            self._values = self._temporal_order(self._values)
            self._idx = self._keys.length
            trim_size = self._idx - self.max_size + 1
            self._remember_evicted(self.keep, trim_size)
            self._keys = self._trim(trim_size, self._keys, k)
            self._values = self._trim(trim_size, self._values, v)
        self.offset += k.length
        self._idx = self._keys.length

    def _update_in_place(self, k: Store, v: Store) -> None:
        prev = self.offset
        if self._keys is None or (prev >= self._keys.length and self._keys.length < self.max_size):
            self._append_room(k, v, min(self.step, self.max_size - prev))
            self._idx = prev
        trim_size = self._keys.length - self.max_size
        if trim_size > 0:
            self._remember_evicted(self.keep, trim_size)
            self._keys = self._trim(trim_size, self._keys)
            self._values = self._trim(trim_size, self._values)
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = self.keep
        if prev >= self.max_size:  # the ring is full: this slot holds the oldest token
            self._remember_evicted(self._idx, 1)
        self._keys[..., self._idx : self._idx + 1, :] = k
        self._values[..., self._idx : self._idx + 1, :] = v
        self.offset += 1
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
        k, v = self._keys, self._values
        if self.offset < k.length:
            k, v = k[..., : self.offset, :], v[..., : self.offset, :]
        return self._hand_out(k, v)

    def held(self) -> tuple[Store, Store] | None:
        """The stores of the tokens held, oldest first (None when empty)."""
        if self._keys is None or self.offset == 0:
            return None
        n = self.size()
        k, v = self._temporal_order(self._keys), self._temporal_order(self._values)
        return k[..., -n:, :], v[..., -n:, :]

    @classmethod
    def holding(
        cls,
        max_size: int,
        keys: Store,
        values: Store,
        offset: int,
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        dtype,
    ) -> KVQWindowCache:
        """A window holding the last tokens before `offset` (`keys`/`values`
        (1, H, n, D), oldest first; only the last `max_size` are kept)."""
        q = cls(max_size, key_spec, value_spec)
        q.dtype = dtype
        n = min(keys.length, max_size)
        q._keys, q._values = keys[..., -n:, :], values[..., -n:, :]
        q.offset, q._idx = offset, n
        return q

    # -- masks --------------------------------------------------------------
    def slot_positions(self) -> mx.array:
        """Absolute token position each returned slot will hold after a
        one-token update (the mask is made before the update)."""
        p = self.offset
        if p < self.max_size:
            return mx.arange(p + 1)
        w = self.keep if self._idx >= self.max_size else self._idx
        ring = self.max_size - self.keep
        j = mx.arange(self.max_size)
        pos = p - (w - j) % ring
        return mx.where(j < self.keep, j, pos)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False):
        if N > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + N > window_size or return_array:
                return create_causal_mask(N, offset, window_size=window_size)
            return "causal"
        if window_size is None or self.offset < window_size:
            return None
        if self.keep == 0 and self.max_size <= window_size:
            # Every slot is inside the window: no mask, as mlx-lm (sinks,
            # keep > 0, fall outside the window and still need one).
            return None
        return self.slot_positions() > self.offset - window_size

    # -- protocol -----------------------------------------------------------
    def size(self) -> int:
        return min(self.offset, self.max_size)

    def is_trimmable(self) -> bool:
        return self.rewind > 0 or self.offset < self.max_size

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        if self.rewind and n:
            self._rewind(n)
            return n
        self.offset -= n
        self._idx -= n
        return n

    @property
    def nbytes(self) -> int:
        held = super().nbytes
        if self._evicted is not None:
            held += self._evicted[0].nbytes + self._evicted[1].nbytes
        return held

    # -- rewinding ----------------------------------------------------------
    def set_rewind(self, n: int) -> None:
        """Keep the last `n` evicted tokens so that `trim(m)`, m <= n, rewinds
        exactly even after the ring wrapped; 0 stops and frees them."""
        if n < 0:
            raise ValueError(f"rewind must be >= 0, got {n}")
        self.rewind = n
        self._evicted = None

    def _remember_evicted(self, start: int, n: int) -> None:
        """Slots [start, start + n) are about to be dropped: keep them (oldest first)."""
        if not self.rewind or n <= 0:
            return
        k = self._keys[..., start : start + n, :].map(mx.contiguous)
        v = self._values[..., start : start + n, :].map(mx.contiguous)
        if self._evicted is not None:
            k = Store.concat([self._evicted[0], k])
            v = Store.concat([self._evicted[1], v])
        if k.length > self.rewind:
            k, v = k[..., -self.rewind :, :], v[..., -self.rewind :, :]
        self._evicted = (k, v)

    def _rewind(self, n: int) -> None:
        """Forget the last `n` tokens: the sinks, then the window refilled from
        the tokens it evicted, as it was before them. After the sinks it knows
        one run of tokens ending at `offset`: the evicted ones, then the held."""
        k, v = self._temporal_order(self._keys), self._temporal_order(self._values)
        sinks = min(self.keep, k.length)
        held = k.length - sinks
        have = 0 if self._evicted is None else self._evicted[0].length
        if n > held + have + sinks:
            raise RuntimeError(f"sliding window cannot rewind {n} tokens: it holds {k.length}")
        offset = self.offset - n
        kept_sinks = min(sinks, offset)
        held_kept = max(0, held - n)
        evicted_kept = max(0, have - max(0, n - held))
        pull = max(0, min(offset, self.max_size) - kept_sinks - held_kept)
        if pull > evicted_kept:
            raise RuntimeError(
                f"sliding window cannot rewind {n} tokens: it kept {have} evicted "
                f"tokens, too few (set_rewind({self.rewind}))"
            )
        ks, vs = [k[..., :kept_sinks, :]], [v[..., :kept_sinks, :]]
        if pull:
            ek, ev = self._evicted
            ks.append(ek[..., evicted_kept - pull : evicted_kept, :])
            vs.append(ev[..., evicted_kept - pull : evicted_kept, :])
        ks.append(k[..., sinks : sinks + held_kept, :])
        vs.append(v[..., sinks : sinks + held_kept, :])
        rest = evicted_kept - pull
        if rest:
            ek, ev = self._evicted
            self._evicted = (ek[..., :rest, :], ev[..., :rest, :])
        else:
            self._evicted = None
        self._keys, self._values = Store.concat(ks), Store.concat(vs)
        self.offset = offset
        self._idx = self._keys.length

    def _maybe_convert(self) -> None:
        super()._maybe_convert()
        if self._evicted is not None and self._token_count >= self.start:
            ek, ev = self._evicted
            self._evicted = (ek.quantize(self.key_spec), ev.quantize(self.value_spec))

    @property
    def state(self):
        return [
            self._store_state(), self.offset, self.keep, self.max_size, self._idx,
            self._spec_state(),
        ]  # fmt: skip

    @state.setter
    def state(self, v):
        stores, offset, keep, max_size, idx, meta = v
        self._set_spec_state(meta)
        self._set_store_state(stores)
        self.offset, self.keep, self.max_size, self._idx = (
            int(offset),
            int(keep),
            int(max_size),
            int(idx),
        )
        self._evicted = None

    @classmethod
    def merge(cls, caches):
        return KVQBatchWindowCache.merge(caches)

    @classmethod
    def from_cache(
        cls,
        cache: RotatingKVCache,
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        start: int = 0,
        hand_out: str = PACKED,
    ) -> KVQWindowCache:
        """The quantized twin of a filled `RotatingKVCache`: same offset, ring
        index and sink tokens, slot for slot."""
        q = cls(cache.max_size, key_spec, value_spec, cache.keep, start, hand_out)
        if cache.keys is not None:
            q.dtype = cache.keys.dtype
            q.offset, q._idx = 0, ring_index(cache)
            kspec, vspec = q._storage_specs() if cache.offset < start else (key_spec, value_spec)
            # Copies: raw storage must not alias the original's ring, which
            # both caches write in place.
            q._keys = Store.encode(mx.array(cache.keys), kspec)
            q._values = Store.encode(mx.array(cache.values), vspec)
            q.offset = cache.offset
        return q


class KVQBatchWindowCache(BatchKVQCache):
    """Left-padded batch of sliding-window rings; bounded by `max_size` slots."""

    kind = "sliding"
    bounded = True

    def __init__(
        self,
        max_size: int,
        left_padding: list[int],
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        start: int = 0,
        hand_out: str = PACKED,
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
        self._keys = self._keys.map(lambda a: dynamic_roll(a, shifts[:, None], axis=2))
        self._values = self._values.map(lambda a: dynamic_roll(a, shifts[:, None], axis=2))

    def _temporal_order(self) -> None:
        if self.rotated:
            self._keys = self._keys.map(lambda a: mx.roll(a, -self._idx, axis=2))
            self._values = self._values.map(lambda a: mx.roll(a, -self._idx, axis=2))
            self._idx = self._keys.length
            self.rotated = False

    def _update_concat(self, k: Store, v: Store) -> None:
        if self._keys is None:
            self._keys, self._values = k, v
        else:
            self._temporal_order()
            if self._keys.length > self._idx:
                self._keys = self._keys[..., : self._idx, :]
                self._values = self._values[..., : self._idx, :]
            if self._lengths is not None:
                roll = mx.maximum(0, self.offset - self._lengths)
                self._roll_rows(roll)
                self.left_padding = self.left_padding + roll
                self.offset = self.offset - roll
            trim_size = self._idx - self.max_size + 1
            if trim_size > 0:
                self.left_padding = self.left_padding - trim_size
                self._keys = self._keys[..., trim_size:, :]
                self._values = self._values[..., trim_size:, :]
            self._keys = Store.concat([self._keys, k])
            self._values = Store.concat([self._values, v])
        n = k.length
        self.offset = self.offset + n
        self._offset += n
        self._idx = self._keys.length

    def _update_in_place(self, k: Store, v: Store) -> None:
        if self._lengths is not None:
            raise RuntimeError(
                "finalize() must be called before decoding with a batch window cache"
            )
        prev = self._offset
        if self._keys is None or (prev >= self._keys.length and self._keys.length < self.max_size):
            self._append_room(k, v, min(self.step, self.max_size - prev))
            self._idx = prev
        trim_size = self._keys.length - self.max_size
        if trim_size > 0:
            self._keys = self._keys[..., trim_size:, :]
            self._values = self._values[..., trim_size:, :]
            self._idx = self.max_size
            self.left_padding = self.left_padding - trim_size
        if self._idx == self.max_size:
            self.rotated = True
            self._idx = 0
        if self.rotated:
            self.left_padding = self.left_padding - 1
        self._keys[..., self._idx : self._idx + 1, :] = k
        self._values[..., self._idx : self._idx + 1, :] = v
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
        k, v = self._keys, self._values
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
        # A chunk first puts a wrapped ring back in time order (every slot
        # used), then trims: count what it will trim from that, not from the
        # ring's write position (mlx-lm 0.32's BatchRotatingKVCache does the
        # latter and hides a padded row's oldest tokens still in the window).
        used = self._keys.length if N > 1 and self.rotated else self._idx
        if (trim_size := used - self.max_size + int(N > 1)) > 0:
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
        if self.rotated != other.rotated or self._idx != other._idx:
            self._temporal_order()
            other._temporal_order()
        if self._extend_stores(other):
            self._offset = max(self._offset, other._offset)

    def extract(self, idx: int) -> KVQWindowCache:
        mx.eval(self.left_padding, self.offset)
        cache = KVQWindowCache(
            self.max_size, self.key_spec, self.value_spec, 0, self.start, self.hand_out
        )
        cache.dtype = self.dtype
        pad = max(0, self.left_padding.tolist()[idx])
        k, v = self._keys[idx : idx + 1], self._values[idx : idx + 1]
        end = self._idx
        if self.rotated:
            k = k.map(lambda a: mx.roll(a, -self._idx, axis=2))
            v = v.map(lambda a: mx.roll(a, -self._idx, axis=2))
            end = self.max_size
        cache._keys = k[:, :, pad:end].map(mx.contiguous)
        cache._values = v[:, :, pad:end].map(mx.contiguous)
        cache.offset = self.offset.tolist()[idx]
        cache._idx = cache._keys.length
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
            return cls(
                c0.max_size, [0] * len(caches), c0.key_spec, c0.value_spec, c0.start, c0.hand_out
            )

        def fetch(c: KVQWindowCache, n: int):
            k, v = c._temporal_order(c._keys), c._temporal_order(c._values)
            return k[..., -n:, :], v[..., -n:, :]

        keys, values, padding = merge_stores(caches, lengths, fetch)
        cache = cls(c0.max_size, padding, c0.key_spec, c0.value_spec, c0.start, c0.hand_out)
        cache._keys, cache._values = keys, values
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

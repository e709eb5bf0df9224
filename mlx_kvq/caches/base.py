"""What every mlx-kvq cache shares: its specs, the switch from full precision
to quantized storage at `quantized_kv_start`, and what it hands the model.
"""

from __future__ import annotations

import copy

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from ..config import QuantSpec
from ..quant import QuantizedKV, Store

# Ways a cache can hand K/V to the model.
PACKED = "packed"  # QuantizedKV objects, for attention that takes them
DEQUANTIZED = "dequantized"  # plain arrays, for model code that needs arrays


class KVQCache(_BaseCache):
    """Base of the quantized caches: keys and values are `Store`s.

    Caches start raw and convert to quantized storage at the first update
    that finds `offset >= start` (mirroring mlx-lm's `quantized_kv_start`),
    so the same object serves the whole conversation.
    """

    kind = "full"
    bounded = False  # holds at most a fixed number of tokens (KVConfig.window_bits applies)
    step = 256

    def _init_specs(
        self, key_spec: QuantSpec, value_spec: QuantSpec, start: int = 0, hand_out: str = PACKED
    ) -> None:
        self.key_spec = key_spec
        self.value_spec = value_spec
        self.start = start
        self.hand_out = hand_out
        self.keys: Store | None = None
        self.values: Store | None = None

    def __deepcopy__(self, memo) -> KVQCache:
        """An independent copy (mlx-lm's prompt cache and BatchGenerator use
        `copy.deepcopy`). `mx.Dtype` cannot be deep-copied (nor pickled); it is
        immutable, so the copy shares it."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if not isinstance(value, mx.Dtype):
                value = copy.deepcopy(value, memo)
            setattr(new, name, value)
        return new

    # -- storage mode -------------------------------------------------------
    @property
    def _token_count(self) -> int:
        """Tokens seen so far, the number compared against `start`."""
        return self.offset

    @property
    def quantized(self) -> bool:
        """True once this cache stores quantized keys or values."""
        if self.keys is None:
            return self._token_count >= self.start and (
                self.key_spec.quantized or self.value_spec.quantized
            )
        return self.keys.quantized or self.values.quantized

    def _storage_specs(self) -> tuple[QuantSpec, QuantSpec]:
        if self._token_count >= self.start:
            return self.key_spec, self.value_spec
        raw = QuantSpec(None, self.key_spec.group_size)
        return raw, raw

    def _maybe_convert(self) -> None:
        if self.keys is not None and self._token_count >= self.start:
            self.keys = self.keys.quantize(self.key_spec)
            self.values = self.values.quantize(self.value_spec)

    def _encode(self, keys: mx.array, values: mx.array) -> tuple[Store, Store]:
        self._maybe_convert()
        kspec, vspec = self._storage_specs()
        if self.keys is not None:
            kspec, vspec = self.keys.spec, self.values.spec
        return Store.encode(keys, kspec), Store.encode(values, vspec)

    def _append_room(self, k: Store, v: Store, grow: int) -> None:
        """Extend the buffers by `grow` zero slots (or create them)."""
        if self.keys is None:
            self.keys, self.values = k.zeros(grow), v.zeros(grow)
        else:
            self.keys = Store.concat([self.keys, k.zeros(grow)])
            self.values = Store.concat([self.values, v.zeros(grow)])

    def _make_room(self, used: int, k: Store, v: Store) -> None:
        """Room for `k`'s tokens after `used` slots, growing in 256-token steps
        like mlx-lm's caches (a partly used last step is cut off first)."""
        n = k.length
        if self.keys is not None and used + n <= self.keys.length:
            return
        if self.keys is not None and used % self.step:
            self.keys, self.values = self.keys[..., :used, :], self.values[..., :used, :]
        self._append_room(k, v, (self.step + n - 1) // self.step * self.step)

    def _hand_out(self, keys: Store, values: Store):
        if self.hand_out == DEQUANTIZED:
            return keys.dequantize(self.dtype), values.dequantize(self.dtype)
        return keys.fetch(), values.fetch()

    # -- protocol -----------------------------------------------------------
    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def _spec_state(self) -> list:
        k, v = self.key_spec, self.value_spec
        return [
            k.bits or 0, k.group_size, k.rotation,
            v.bits or 0, v.group_size, v.rotation,
            self.start, self.hand_out,
            "none" if self.dtype is None else str(self.dtype).split(".")[-1],
        ]  # fmt: skip

    def _set_spec_state(self, meta: list) -> None:
        kb, kg, kr, vb, vg, vr, start, hand_out, dtype = meta
        self._init_specs(
            QuantSpec(int(kb) or None, int(kg), kr),
            QuantSpec(int(vb) or None, int(vg), vr),
            int(start),
            hand_out,
        )
        # An empty cache has no dtype yet ("none").
        self.dtype = None if dtype == "none" else getattr(mx, dtype)

    def _store_state(self) -> list:
        if self.keys is None:
            return [None] * 6
        return self.keys.to_state() + self.values.to_state()

    def _set_store_state(self, parts: list) -> None:
        self.keys = Store.from_state(parts[:3], self.key_spec)
        self.values = Store.from_state(parts[3:], self.value_spec)

    def _remember_dtype(self, keys: mx.array) -> None:
        if getattr(self, "dtype", None) is None:
            self.dtype = keys.dtype

    def describe(self) -> str:
        return f"{self.kind} K {self.key_spec.describe()} V {self.value_spec.describe()}"

    def keys_and_values(self):
        """Current K/V in the form attention receives (gemma3n shared layers)."""
        raise NotImplementedError


def is_quantized_kv(x) -> bool:
    return isinstance(x, QuantizedKV)

"""What every mlx-kvq cache shares: its specs, the switch from full precision
to quantized storage at `quantized_kv_start`, and what it hands the model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import mlx.core as mx

from ..config import QuantSpec
from ..mlx_lm_internals import BaseCache
from ..quant import Store

# Ways a cache can hand K/V to the model.
PACKED = "packed"  # QuantizedKV objects, for attention that takes them
DEQUANTIZED = "dequantized"  # plain arrays, for model code that needs arrays

# The dtypes a cache may record in a prompt file, by name (never looked up on `mx`).
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}

# What making the first mlx-kvq cache sets up outside the package, each once:
# importing the caches changes nothing (`registry.register_for_prompt_files`
# adds itself here).
_FIRST_CACHE: list[Callable[[], None]] = []


def on_first_cache(action: Callable[[], None]) -> None:
    """Run `action` once, when the process makes its first mlx-kvq cache."""
    _FIRST_CACHE.append(action)


def _first_cache() -> None:
    while _FIRST_CACHE:
        _FIRST_CACHE.pop()()


class KVQCache(BaseCache):
    """Base of the quantized caches: keys and values are `Store`s.

    Caches start raw and convert to quantized storage at the first update
    that finds `offset >= start` (mirroring mlx-lm's `quantized_kv_start`),
    so the same object serves the whole conversation.
    """

    kind = "full"
    bounded = False  # holds at most a fixed number of tokens (KVConfig.window_bits applies)
    step = 256

    def exact_trim(self) -> int | None:
        """The most tokens `trim` takes back leaving exactly what a decode to
        the shorter length would hold (None: whatever it can trim)."""
        return None

    def _init_specs(
        self, key_spec: QuantSpec, value_spec: QuantSpec, start: int = 0, hand_out: str = PACKED
    ) -> None:
        if _FIRST_CACHE:
            _first_cache()
        self.key_spec = key_spec
        self.value_spec = value_spec
        self.start = start
        self.hand_out = hand_out
        self._keys: Store | None = None
        self._values: Store | None = None

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

    # -- what model code sees ----------------------------------------------
    # Some model code reads `cache.keys` / `cache.values` and writes them back
    # with dependencies attached (`cache.keys = mx.depends(cache.keys, h)`:
    # mlx-lm's pipeline stages, sparse-attention indexers). The stores live in
    # `_keys` / `_values`; these properties are what such code gets and sets.
    @property
    def keys(self) -> Store | None:
        """The key `Store` (a sequence of its arrays, so `mx.depends` takes it)."""
        return self._keys

    @keys.setter
    def keys(self, value) -> None:
        self._keys = self._accept(value, self._keys, "keys")

    @property
    def values(self) -> Store | None:
        """The value `Store`."""
        return self._values

    @values.setter
    def values(self, value) -> None:
        self._values = self._accept(value, self._values, "values")

    @property
    def key_store(self) -> Store | None:
        """The key `Store`, whatever `keys` shows model code."""
        return self._keys

    @property
    def value_store(self) -> Store | None:
        """The value `Store`, whatever `values` shows model code."""
        return self._values

    def _accept(self, value, current: Store | None, name: str) -> Store | None:
        """A store assigned to `keys` / `values`: a `Store` (or None) as is;
        what `mx.depends` returns for a store (the list of its arrays), or an
        array shaped like its storage array (the one `keys` shows array-facing
        code), replaces those arrays with the same data plus dependencies."""
        if value is None or isinstance(value, Store):
            return value
        if current is not None:
            if isinstance(value, (list, tuple)) and len(value) == len(current.parts):
                return Store(value, current.spec)
            head = current.parts[0]
            if isinstance(value, mx.array) and value.shape == head.shape:
                if value.dtype == head.dtype:
                    return Store((value, *current.parts[1:]), current.spec)
        shown = getattr(value, "shape", type(value).__name__)
        raise TypeError(
            f"{type(self).__name__}.{name} takes a Store, or its own arrays back with "
            f"dependencies (mx.depends); got {shown}"
        )

    # -- storage mode -------------------------------------------------------
    @property
    def _token_count(self) -> int:
        """Tokens seen so far, the number compared against `start`."""
        return self.offset

    @property
    def quantized(self) -> bool:
        """True once this cache stores quantized keys or values."""
        if self._keys is None:
            return self._token_count >= self.start and (
                self.key_spec.quantized or self.value_spec.quantized
            )
        return self._keys.quantized or self._values.quantized

    def _storage_specs(self) -> tuple[QuantSpec, QuantSpec]:
        if self._token_count >= self.start:
            return self.key_spec, self.value_spec
        raw = QuantSpec(None, self.key_spec.group_size)
        return raw, raw

    def _maybe_convert(self) -> None:
        if self._keys is not None and self._token_count >= self.start:
            self._keys = self._keys.quantize(self.key_spec)
            self._values = self._values.quantize(self.value_spec)

    def _encode(self, keys: mx.array, values: mx.array) -> tuple[Store, Store]:
        self._maybe_convert()
        kspec, vspec = self._storage_specs()
        if self._keys is not None:
            kspec, vspec = self._keys.spec, self._values.spec
        return Store.encode(keys, kspec), Store.encode(values, vspec)

    def _append_room(self, k: Store, v: Store, grow: int) -> None:
        """Extend the buffers by `grow` zero slots (or create them)."""
        if self._keys is None:
            self._keys, self._values = k.zeros(grow), v.zeros(grow)
        else:
            self._keys = Store.concat([self._keys, k.zeros(grow)])
            self._values = Store.concat([self._values, v.zeros(grow)])

    def _make_room(self, used: int, k: Store, v: Store) -> None:
        """Room for `k`'s tokens after `used` slots, growing in 256-token steps
        like mlx-lm's caches (a partly used last step is cut off first)."""
        n = k.length
        if self._keys is not None and used + n <= self._keys.length:
            return
        if self._keys is not None and used % self.step:
            self._keys, self._values = self._keys[..., :used, :], self._values[..., :used, :]
        self._append_room(k, v, (self.step + n - 1) // self.step * self.step)

    def _hand_out(self, keys: Store, values: Store):
        if self.hand_out == DEQUANTIZED:
            return keys.dequantize(self.dtype), values.dequantize(self.dtype)
        return keys.fetch(), values.fetch()

    # -- protocol -----------------------------------------------------------
    def empty(self) -> bool:
        return self._keys is None

    @property
    def nbytes(self) -> int:
        if self._keys is None:
            return 0
        return self._keys.nbytes + self._values.nbytes

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
        if hand_out not in (PACKED, DEQUANTIZED):
            raise ValueError(f"unknown hand-out {hand_out!r} (expected {PACKED} or {DEQUANTIZED})")
        if int(start) < 0:
            raise ValueError(f"negative quantized_kv_start {int(start)}")
        self._init_specs(
            QuantSpec(int(kb) or None, int(kg), kr),
            QuantSpec(int(vb) or None, int(vg), vr),
            int(start),
            hand_out,
        )
        # An empty cache has no dtype yet ("none").
        if dtype != "none" and dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
        self.dtype = None if dtype == "none" else DTYPES[dtype]

    def _store_state(self, upto: int | None = None) -> list:
        """The stores' arrays; with `upto`, only the first `upto` slots (as
        mlx-lm's `KVCache.state` leaves out the unused tail of its buffer)."""
        if self._keys is None:
            return [None] * 6
        k, v = self._keys, self._values
        if upto is not None and upto < k.length:
            k, v = k[..., :upto, :], v[..., :upto, :]
        return k.to_state() + v.to_state()

    def _set_store_state(self, parts: list) -> None:
        self._keys = Store.from_state(parts[:3], self.key_spec)
        self._values = Store.from_state(parts[3:], self.value_spec)

    def _remember_dtype(self, keys: mx.array) -> None:
        if getattr(self, "dtype", None) is None:
            self.dtype = keys.dtype

    def describe(self) -> str:
        return f"{self.kind} K {self.key_spec.describe()} V {self.value_spec.describe()}"

    def keys_and_values(self):
        """Current K/V in the form attention receives (gemma3n shared layers)."""
        raise NotImplementedError

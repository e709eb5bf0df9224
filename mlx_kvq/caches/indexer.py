"""Sparse-attention indexer keys: stored quantized, keys only, read as arrays.

DeepSeek sparse attention (deepseek_v32, glm_moe_dsa) and minimax_m3_vl keep,
next to each layer's attention cache, a second cache of index keys
(`CacheList(KVCache(), KVCache())`, member 1). The indexer scores queries
against those keys with plain array operations, and the model code touches
that cache's arrays directly:

- `k, _ = cache.update_and_fetch(k, k)` (v32) or with zero-width values
  (minimax): only the keys are ever read;
- `cache.values = mx.zeros_like(cache.keys)` (v32): drops the copy of the
  keys it wrote as values;
- `attn_cache.keys = mx.depends(attn_cache.keys, (cache.keys, cache.values))`:
  keeps the index keys in the evaluated graph.

So these caches store the keys (quantized) and no values, hand the keys out
dequantized, and show model code arrays: `keys` is the key storage array
(packed words tied to their scales and biases, or the raw keys before
`quantized_kv_start`), `values` the empty value array. Assigning an array
shaped like `keys` to `values` (the zeros above) is accepted and keeps
nothing; anything else is refused.
"""

from __future__ import annotations

import mlx.core as mx

from ..config import QuantSpec
from ..quant import Store
from .base import DEQUANTIZED
from .full import KVQBatchFullCache, KVQFullCache


def storage_array(store: Store | None) -> mx.array | None:
    """One array standing for a store: its first array, depending on the rest
    (evaluating it evaluates the whole store)."""
    if store is None:
        return None
    head, *rest = store.parts
    return mx.depends(head, rest) if rest else head


class _KeysOnly:
    """What the single and batch indexer caches add to the full caches."""

    def _check_hand_out(self, hand_out: str) -> None:
        if hand_out != DEQUANTIZED:
            raise ValueError(
                f"{type(self).__name__} hands out dequantized keys (indexers score them "
                f"with array code); got hand_out={hand_out!r}"
            )

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store `keys`; `values` (a copy of the keys, or zero-width) is not kept."""
        return super().update_and_fetch(keys, keys[..., :0])

    @property
    def keys(self) -> mx.array | None:
        return storage_array(self._keys)

    @keys.setter
    def keys(self, value) -> None:
        self._keys = self._accept(value, self._keys, "keys")

    @property
    def values(self) -> mx.array | None:
        return None if self._values is None else self._values.parts[0]

    @values.setter
    def values(self, value) -> None:
        head = None if self._keys is None else self._keys.parts[0]
        if isinstance(value, mx.array) and head is not None and value.shape == head.shape:
            return  # the model dropping its copy of the keys: none is kept here
        self._values = self._accept(value, self._values, "values")


class KVQIndexerCache(_KeysOnly, KVQFullCache):
    """One sequence's index keys (grows like `KVCache`)."""

    kind = "indexer"

    def __init__(
        self,
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        start: int = 0,
        hand_out: str = DEQUANTIZED,
    ):
        self._check_hand_out(hand_out)
        super().__init__(key_spec, value_spec, start, hand_out)

    @classmethod
    def merge(cls, caches):
        return KVQBatchIndexerCache.merge(caches)


class KVQBatchIndexerCache(_KeysOnly, KVQBatchFullCache):
    """Left-padded batch of index keys."""

    kind = "indexer"
    single = KVQIndexerCache

    def __init__(
        self,
        left_padding: list[int],
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        start: int = 0,
        hand_out: str = DEQUANTIZED,
    ):
        self._check_hand_out(hand_out)
        super().__init__(left_padding, key_spec, value_spec, start, hand_out)

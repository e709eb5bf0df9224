"""deepseek_v41's per-layer cache (`LayerCache`), quantized field by field.

deepseek_v41 keeps, per decoder layer, a `LayerCache` whose fields the model
code reads and writes itself (mlx_lm/models/deepseek_v41.py):

- `window`: the last `window_size` KV rows of the layer (one row serves as
  key and value), grown by `update_window(kv)`, read as `cache.window`, and
  in pipeline stages rewritten as `cache.window = mx.depends(cache.window, x)`;
- `compress_kv`: one pooled KV row per `ratio` tokens, grown by
  `cache.compress_kv = concatenate([cache.compress_kv, new])`;
- `index_k`: the indexer's keys of those rows, grown the same way;
- `pending_kv`, `pending_gate`: float32 rows of the group still open (fewer
  than `ratio`): working state, not KV.

`KVQDeepseekV41Cache` keeps each KV field the plan declares in a quantized leaf,
shows the model dequantized rows, and takes its assignments: an array with
more rows than the field holds appends the new rows (the model only appends
to these fields, so the first rows of what it assigns are the rows it read);
the same number of rows keeps the array as a dependency (the pipeline line
above). The window stays bounded.

The model's positions are one number for the whole batch, so sequences of
different lengths cannot share a batch: the batch form is a batch of one
(`merge` of a single cache), which lets mlx-lm's `BatchGenerator` serve it
one sequence at a time, as mlx-lm's server does for this model.
"""

from __future__ import annotations

import copy

import mlx.core as mx

from ..config import QuantSpec
from ..mlx_lm_internals import BaseCache
from ..quant import Store
from .base import DEQUANTIZED, KVQCache

FIELDS = ("window", "compress_kv", "index_k")
PENDING = ("pending_kv", "pending_gate")


class KVQRowsCache(KVQCache):
    """The rows (B, N, D) of one `LayerCache` field, stored quantized as keys
    (B, 1, N, D) with no values; `max_rows` bounds a window, `ratio` is the
    tokens per row of a compressed field."""

    kind = "rows"

    def __init__(
        self,
        key_spec: QuantSpec,
        value_spec: QuantSpec,
        start: int = 0,
        max_rows: int | None = None,
        ratio: int = 1,
    ):
        self._init_specs(key_spec, value_spec, start, DEQUANTIZED)
        self.max_rows = max_rows
        self.ratio = ratio
        self.offset = 0  # rows held
        self.tokens = 0  # tokens the layer has seen (what `start` counts)
        self.dtype = None

    @property
    def _token_count(self) -> int:
        return self.tokens

    def _encode_rows(self, x: mx.array) -> tuple[Store, Store]:
        self._remember_dtype(x)
        x = x[:, None]
        return self._encode(x, x[..., :0])

    def rows(self) -> mx.array | None:
        """The rows held, dequantized to the dtype they were written in."""
        if self._keys is None:
            return None
        return self._keys[..., : self.offset, :].dequantize(self.dtype)[:, 0]

    def append(self, x: mx.array) -> None:
        """Add rows `x` (B, M, D) at the end (grows in 256-row steps)."""
        k, v = self._encode_rows(x)
        prev = self.offset
        self._make_room(prev, k, v)
        self.offset += k.length
        self._keys[..., prev : self.offset, :] = k
        self._values[..., prev : self.offset, :] = v

    def push(self, x: mx.array) -> mx.array:
        """Window update: the held rows then `x`, dequantized (what the layer
        attends over), keeping only the last `max_rows` of them."""
        k, v = self._encode_rows(x)
        if self._keys is not None:
            used = self.offset
            k = Store.concat([self._keys[..., :used, :], k])
            v = Store.concat([self._values[..., :used, :], v])
        out = k.dequantize(self.dtype)[:, 0]
        if self.max_rows is not None and k.length > self.max_rows:
            k, v = k[..., -self.max_rows :, :], v[..., -self.max_rows :, :]
        self._keys, self._values, self.offset = k, v, k.length
        return out

    def depend_on(self, x: mx.array) -> None:
        """Keep `x` (the rows, with dependencies attached) as a dependency."""
        head, *rest = self._keys.parts
        self._keys = Store((mx.depends(head, [x]), *rest), self._keys.spec)

    def size(self) -> int:
        return self.offset

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    @property
    def state(self):
        return [
            self._store_state(), self.offset, self.tokens,
            0 if self.max_rows is None else self.max_rows, self.ratio, self._spec_state(),
        ]  # fmt: skip

    @state.setter
    def state(self, v):
        stores, offset, tokens, max_rows, ratio, meta = v
        self._set_spec_state(meta)
        self._set_store_state(stores)
        self.offset, self.tokens, self.ratio = int(offset), int(tokens), int(ratio)
        self.max_rows = int(max_rows) or None


class KVQWindowRows(KVQRowsCache):
    """`LayerCache.window`: the last `window_size` rows."""

    kind = "sliding"
    field = "window"
    bounded = True


class KVQCompressedRows(KVQRowsCache):
    """`LayerCache.compress_kv`: one pooled KV row per `ratio` tokens."""

    kind = "compressed"
    field = "compress_kv"


class KVQIndexRows(KVQRowsCache):
    """`LayerCache.index_k`: the indexer's keys of the compressed rows."""

    kind = "indexer"
    field = "index_k"


LEAF_CLASSES = {"window": KVQWindowRows, "compress_kv": KVQCompressedRows, "index_k": KVQIndexRows}


class PendingRows:
    """A layer's rows of the compression group still open: a report view,
    not a cache (its rows live in the layer cache's state), so it is listed
    by `KVQDeepseekV41Cache.report_members`, never among the `caches` that tools
    walk as mlx-lm caches."""

    field = "pending"

    def __init__(self, owner: KVQDeepseekV41Cache):
        self.owner = owner

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.owner.pending if a is not None)

    def empty(self) -> bool:
        return self.owner.pending_kv is None

    def size(self) -> int:
        return 0 if self.owner.pending_kv is None else self.owner.pending_kv.shape[1]


class _Field:
    """A KV field of `KVQDeepseekV41Cache` as the model code sees it."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        leaf = obj.leaves.get(self.name)
        return None if leaf is None else leaf.rows()

    def __set__(self, obj, value) -> None:
        obj._assign(self.name, value)


class KVQDeepseekV41Cache(BaseCache):
    """The quantized twin of deepseek_v41's `LayerCache`; see the module docstring."""

    window = _Field()
    compress_kv = _Field()
    index_k = _Field()

    def __init__(self, window_size: int, leaves: dict[str, KVQRowsCache]):
        unknown = set(leaves) - set(FIELDS)
        if unknown:
            raise ValueError(f"LayerCache has no KV fields {sorted(unknown)}")
        self.window_size = window_size
        self.leaves = {name: leaves[name] for name in FIELDS if name in leaves}
        self.offset = 0
        self.pending_kv = None
        self.pending_gate = None

    @classmethod
    def from_cache(
        cls,
        cache,
        fields: dict[str, tuple[int, QuantSpec, QuantSpec]],
        start: int = 0,
    ) -> KVQDeepseekV41Cache:
        """The twin of a (possibly filled) `LayerCache`: `fields` maps each KV
        field to quantize to (its ratio, key spec, value spec); its rows,
        offset and open group carry over."""
        leaves = {
            name: LEAF_CLASSES[name](
                key_spec,
                value_spec,
                start,
                cache.window_size if name == "window" else None,
                ratio,
            )
            for name, (ratio, key_spec, value_spec) in fields.items()
        }
        q = cls(cache.window_size, leaves)
        q.offset = cache.offset
        for leaf in q.leaves.values():
            leaf.tokens = cache.offset
        for name in FIELDS:
            rows = getattr(cache, name)
            if rows is not None:
                q._assign(name, rows)
        q.pending_kv, q.pending_gate = cache.pending_kv, cache.pending_gate
        return q

    # -- the model's side ---------------------------------------------------
    def update_window(self, kv: mx.array) -> mx.array:
        """The window with `kv` appended (dequantized); keeps its last rows."""
        self.offset += kv.shape[1]
        for leaf in self.leaves.values():
            leaf.tokens = self.offset
        return self.leaves["window"].push(kv)

    def _assign(self, name: str, value) -> None:
        leaf = self.leaves.get(name)
        if leaf is None:
            if value is None:
                return
            raise TypeError(
                f"LayerCache field {name} was not planned for this layer (the plan "
                f"declares {sorted(self.leaves)}); its rows would not be quantized"
            )
        if value is None or not isinstance(value, mx.array) or value.ndim != 3:
            shown = getattr(value, "shape", type(value).__name__)
            raise TypeError(f"LayerCache.{name} takes (batch, rows, dim) arrays; got {shown}")
        held = leaf.offset
        if value.shape[1] < held:
            raise TypeError(
                f"LayerCache.{name} holds {held} rows; the model assigned {value.shape[1]} "
                "(these fields only grow)"
            )
        if value.shape[1] > held:
            leaf.append(value[:, held:])
        elif held:
            leaf.depend_on(value)

    @property
    def pending(self) -> tuple:
        return (self.pending_kv, self.pending_gate)

    # -- protocol -----------------------------------------------------------
    @property
    def caches(self) -> tuple:
        """The member caches, one per KV field, each with mlx-lm's cache protocol."""
        return tuple(self.leaves.values())

    @property
    def report_members(self) -> tuple:
        """What reports list for this layer: its caches, then the open group."""
        compressed = self.leaves.get("compress_kv")
        open_group = compressed is not None and compressed.ratio > 1
        return (*self.caches, *([PendingRows(self)] if open_group else []))

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def nbytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves.values()) + PendingRows(self).nbytes

    def is_trimmable(self) -> bool:
        return False  # evicted window rows and closed groups cannot come back

    def trim(self, n: int) -> int:
        return 0

    @property
    def state(self):
        return [
            [[name, type(leaf).__name__, leaf.state] for name, leaf in self.leaves.items()],
            self.pending_kv, self.pending_gate, self.offset, self.window_size,
        ]  # fmt: skip

    @state.setter
    def state(self, v):
        leaves, self.pending_kv, self.pending_gate, offset, window_size = v
        self.leaves = {}
        for name, _, leaf_state in leaves:
            leaf = LEAF_CLASSES[name].__new__(LEAF_CLASSES[name])
            leaf.state = leaf_state
            self.leaves[name] = leaf
        self.offset, self.window_size = int(offset), int(window_size)

    # -- a batch of one -----------------------------------------------------
    @classmethod
    def merge(cls, caches: list) -> KVQDeepseekV41Cache:
        if len(caches) != 1:
            raise ValueError(
                "deepseek_v41 runs one sequence at a time (its positions are one number "
                f"for the whole batch); {len(caches)} caches cannot be merged"
            )
        return caches[0]

    def filter(self, batch_indices) -> None:
        if list(batch_indices) != [0]:
            raise ValueError(f"a batch of one keeps row 0, not {list(batch_indices)}")

    def extract(self, idx: int) -> KVQDeepseekV41Cache:
        if idx != 0:
            raise ValueError(f"a batch of one has row 0, not {idx}")
        return copy.deepcopy(self)

    def extend(self, other) -> None:
        raise ValueError("deepseek_v41 runs one sequence at a time: batches cannot be joined")

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        if any(left_padding or ()) or any(right_padding or ()):
            raise ValueError("deepseek_v41 runs one sequence at a time: no padding")

    def finalize(self) -> None:
        return None

"""A prompt-cache entry's caches as records' tensors, and back.

Every leaf of an entry (a cache slot, or a member of a `CacheList` slot)
has one of three forms:

- `FULL`: a paged full-attention sequence. Its tokens go to the chunk
  files, chunk by chunk (the K/V parts of every such leaf for those
  tokens, as the pool stores them: packed data, scales and biases), and
  the tokens past its last whole chunk to the entry's file;
- `WINDOW`: a paged sliding-window sequence, whose blocks (what the window
  still sees) go to the entry's file;
- `STATE`: any other cache (the padded layout's, the layers that do not
  page, the speculative lane's own caches): its `state` and class, as
  mlx-lm's prompt-cache files keep them (`PROMPT_FILE_CLASSES`), in the
  entry's file.

Tensors are copied out of the pools on the engine thread (`gather_*`,
evaluated, so the writer thread only reads finished arrays), and written
back into the pools by the engine thread (`append`, `window_sequence`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache

from mlx_kvq.caches import PROMPT_FILE_CLASSES, KVQPagedSequence, KVQPagedSplitSequence, Pages
from mlx_kvq.config import QuantSpec
from mlx_kvq.quant import Store

from .records import Record, RecordError, Skip, device_array


class Form(str, Enum):
    FULL = "full"
    WINDOW = "window"
    STATE = "state"


@dataclass(frozen=True)
class LeafForm:
    """Where one leaf sits in the entry and how it is stored."""

    slot: int
    member: int | None
    form: Form
    window: int | None = None
    cls: str | None = None  # a STATE leaf's class

    @property
    def name(self) -> str:
        return str(self.slot) if self.member is None else f"{self.slot}.{self.member}"

    @property
    def key(self) -> tuple[int, int | None]:
        return (self.slot, self.member)

    def header(self) -> dict[str, Any]:
        return {
            "slot": self.slot, "member": self.member, "form": self.form.value,
            "window": self.window, "cls": self.cls,
        }  # fmt: skip

    @classmethod
    def from_header(cls, d: dict[str, Any]) -> LeafForm:
        member = d["member"]
        window = d["window"]
        return cls(
            int(d["slot"]), None if member is None else int(member), Form(d["form"]),
            None if window is None else int(window), d.get("cls"),
        )  # fmt: skip


@dataclass(frozen=True)
class PoolSpec:
    """What a paged slot's pool stores."""

    key_spec: QuantSpec
    value_spec: QuantSpec
    window: int | None


def slot_leaves(caches: list) -> list[tuple[int, int | None, Any]]:
    """(slot, member, leaf) of one sequence's caches, members of `CacheList`
    slots one by one."""
    out = []
    for slot, c in enumerate(caches):
        if type(c) is mlx_cache.CacheList:
            out += [(slot, i, m) for i, m in enumerate(c.caches)]
        else:
            out.append((slot, None, c))
    return out


def leaf_forms(caches: list) -> list[LeafForm] | str:
    """Each leaf's form, or why this entry cannot be stored (a class mlx-lm's
    prompt files do not know)."""
    out = []
    for slot, member, leaf in slot_leaves(caches):
        if isinstance(leaf, KVQPagedSplitSequence):
            return f"layer {slot} is in the paged split layout, which the disk tier does not keep"
        if isinstance(leaf, KVQPagedSequence):
            form = Form.FULL if leaf.window is None else Form.WINDOW
            out.append(LeafForm(slot, member, form, leaf.window))
        elif type(leaf).__name__ in PROMPT_FILE_CLASSES:
            out.append(LeafForm(slot, member, Form.STATE, cls=type(leaf).__name__))
        else:
            return f"layer {slot} holds a {type(leaf).__name__}, which prompt files cannot keep"
    return out


def _parts(leaf: KVQPagedSequence) -> list[tuple[str, mx.array]]:
    storage = leaf.pool.storage
    return [(f"k{i}", a) for i, a in enumerate(storage.keys.parts)] + [
        (f"v{i}", a) for i, a in enumerate(storage.values.parts)
    ]


def gather_chunks(
    leaves: Sequence[tuple[LeafForm, KVQPagedSequence]], first: int, count: int, blocks: int
) -> list[list[tuple[str, mx.array]]]:
    """The tensors of chunks `first .. first + count - 1` (`blocks` pool blocks
    each) of every FULL leaf, per chunk, copied and evaluated."""
    out: list[list[tuple[str, mx.array]]] = [[] for _ in range(count)]
    for form, leaf in leaves:
        ids = mx.array(leaf.table.ids[first * blocks : (first + count) * blocks], dtype=mx.int32)
        for part, a in _parts(leaf):
            g = a[ids].reshape(count, -1, *a.shape[2:])
            for c in range(count):
                out[c].append((f"{form.name}.{part}", g[c]))
    mx.eval([a for chunk in out for _, a in chunk])
    return out


def gather_tail(leaf: KVQPagedSequence, start: int) -> list[tuple[str, mx.array]]:
    """Tokens `[start, length)` of a paged leaf (`start` on a block boundary at
    or after its table's base), unevaluated."""
    t = leaf.table
    bs = leaf.pool.block_size
    ids = t.ids[(start - t.base) // bs :]
    n = t.length - start
    if not ids or n <= 0:
        return []
    idx = mx.array(ids, dtype=mx.int32)
    return [(part, mx.contiguous(a[idx].reshape(-1, *a.shape[2:])[:n])) for part, a in _parts(leaf)]


def state_tensors(leaf: Any) -> tuple[list[tuple[str, mx.array]], dict[str, Any]]:
    """A STATE leaf's arrays (unevaluated) and its other values, by their keys
    in `tree_flatten(leaf.state)`."""
    arrays, scalars = [], {}
    for key, value in tree_flatten(leaf.state):
        if isinstance(value, mx.array):
            arrays.append((key, mx.contiguous(value)))
        elif value is None or isinstance(value, (bool, int, float, str)):
            scalars[key] = value
        else:
            raise TypeError(f"{type(leaf).__name__}.state holds a {type(value).__name__}")
    return arrays, scalars


def state_leaf(form: LeafForm, record: Record, stored: dict[str, Any]) -> Any:
    """A STATE leaf rebuilt from `record` (its arrays under `form.name/`)."""
    cls = PROMPT_FILE_CLASSES.get(form.cls or "")
    if cls is None:
        raise RecordError(Skip.CORRUPT, f"layer {form.name}: unknown cache class {form.cls!r}")
    prefix = f"{form.name}/"
    items = [(k, record.tensor(prefix + k)) for k in stored["arrays"]]
    items += list(stored["scalars"].items())
    order = {k: i for i, k in enumerate(stored["order"])}
    items.sort(key=lambda kv: order.get(kv[0], len(order)))
    try:
        return cls.from_state(tree_unflatten(items))
    except Exception as e:  # noqa: BLE001 - a state that does not fit its class is corrupt
        raise RecordError(
            Skip.CORRUPT, f"layer {form.name}: {form.cls} state does not load: {e}"
        ) from None


def _store(parts: list[mx.array], spec: QuantSpec, name: str) -> Store:
    if len(parts) != (3 if spec.quantized else 1):
        raise RecordError(Skip.CORRUPT, f"layer {name}: {len(parts)} parts for {spec.describe()}")
    return Store(parts, spec)


def tokens_of(
    pieces: Sequence[tuple[Record, int]], form: LeafForm, pool_spec: PoolSpec
) -> tuple[Store, Store]:
    """A paged leaf's K/V held by `pieces` (records, each from its token `lo`
    on), one after the other: token-major `(n, H, D')` stores."""
    stores = []
    for p, spec in (("k", pool_spec.key_spec), ("v", pool_spec.value_spec)):
        parts = []
        for i in range(3):
            name = f"{form.name}.{p}{i}"
            views = [record.tensors[name][lo:] for record, lo in pieces if name in record.tensors]
            if not views:
                break
            if len(views) != len(pieces):
                raise RecordError(Skip.CORRUPT, f"layer {form.name}: {name} missing from a file")
            dtype = pieces[0][0].dtypes[name]
            if any(record.dtypes[name] != dtype for record, _ in pieces):
                raise RecordError(Skip.CORRUPT, f"layer {form.name}: {name} changes dtype")
            try:
                joined = views[0] if len(views) == 1 else np.concatenate(views)
            except ValueError as e:
                raise RecordError(Skip.CORRUPT, f"layer {form.name}: {name}: {e}") from None
            parts.append(device_array(joined, dtype))
        stores.append(_store(parts, spec, form.name))
    return stores[0], stores[1]


def check_fits(leaf: KVQPagedSequence, k: Store, v: Store, name: str) -> None:
    """Refuse tokens shaped or typed unlike what the leaf's pool stores."""
    storage = leaf.pool.storage
    if storage.keys is None:
        return
    for have, got in ((storage.keys, k), (storage.values, v)):
        for a, b in zip(have.parts, got.parts, strict=True):
            if a.shape[2:] != b.shape[1:] or a.dtype != b.dtype:
                raise RecordError(
                    Skip.CORRUPT,
                    f"layer {name}: stored {b.dtype}{tuple(b.shape[1:])}, the pool holds "
                    f"{a.dtype}{tuple(a.shape[2:])}",
                )


def _batch_form(s: Store) -> Store:
    """`(n, H, D')` parts as `(1, H, n, D')` (what a pool's first growth reads)."""
    return s.map(lambda a: a.transpose(1, 0, 2)[None])


def append(leaf: KVQPagedSequence, k: Store, v: Store, name: str, total: int = 0) -> None:
    """Append tokens (token-major stores) to a paged leaf's table; `total`: the
    tokens it will hold once every append is done (its pool grows once)."""
    n = k.parts[0].shape[0]
    if not n:
        return
    check_fits(leaf, k, v, name)
    kb, vb = _batch_form(k), _batch_form(v)
    t = leaf.table
    if total:
        bs = leaf.pool.block_size
        leaf.pool.make_free(-(-(total - t.base) // bs) - len(t.ids), kb, vb)
    blocks, slots = t.reserve(n, kb, vb)
    leaf.pool.write(blocks, slots, k, v)


def window_sequence(
    pages: Pages, form: LeafForm, spec: PoolSpec, k: Store, v: Store, end: int
) -> KVQPagedSequence:
    """A WINDOW leaf holding tokens `[end - n, end)`."""
    pool = pages.pool(form.key, spec.key_spec, spec.value_spec, spec.window)
    leaf = KVQPagedSequence(pool, spec.window)
    check_fits(leaf, k, v, form.name)
    leaf.hold(_batch_form(k), _batch_form(v), end)
    return leaf


def assemble(forms: Sequence[LeafForm], leaves: Sequence[Any]) -> list:
    """One sequence's caches from its leaves (members of a slot into a `CacheList`)."""
    caches: list = []
    slots: dict[int, list] = {}
    for form, leaf in zip(forms, leaves, strict=True):
        if form.member is None:
            caches.append(leaf)
        else:
            if form.slot not in slots:
                slots[form.slot] = []
                caches.append(slots[form.slot])
            slots[form.slot].append(leaf)
    return [mlx_cache.CacheList(*c) if isinstance(c, list) else c for c in caches]


def release(leaves: Sequence[Any]) -> None:
    """Give back the blocks of paged leaves made for a restore that failed."""
    for leaf in leaves:
        if isinstance(leaf, KVQPagedSequence):
            leaf.table.release()


__all__ = [
    "Form",
    "LeafForm",
    "PoolSpec",
    "append",
    "assemble",
    "check_fits",
    "gather_chunks",
    "gather_tail",
    "leaf_forms",
    "release",
    "slot_leaves",
    "state_leaf",
    "state_tensors",
    "tokens_of",
    "window_sequence",
]

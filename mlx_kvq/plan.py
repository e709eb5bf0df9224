"""The per-layer KV plan: decided and checked when the model is loaded.

`plan_kv` looks at every cache slot the model asks for (mlx-lm's own
`make_prompt_cache`), classifies it through the declared registry, and runs a
*lazy* probe forward pass (graph construction only: no weights are
materialised, so it works from `config.json` alone) that

- reads the exact key/value shapes of every slot (bytes per token),
- checks the quantized caches and the attention redirect against the real
  model code: every KV slot must reach quantized attention, or the model must
  take dequantized arrays (reported, with its transient cost),

so that an unsupported setting raises `UnsupportedKVConfig` at load time,
naming the layer and the fix, never on the first request.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache

from . import attention
from .caches import (
    DEQUANTIZED,
    PACKED,
    KVQDeepseekV41Cache,
    KVQIndexerCache,
    KVQSplitWindowCache,
    KVQWindowCache,
    is_twin,
    lookup,
    quantize_cache,
)
from .caches.deepseek_v41 import FIELDS
from .config import KVConfig, QuantSpec, UnsupportedKVConfig, is_split
from .mlx_lm_internals import model_classes
from .model_facts import facts

KV_KINDS = ("full", "sliding", "chunked", "indexer", "compressed")

# deepseek_v41's LayerCache: its KV fields in member order, then the open
# compression group (working state); see caches/deepseek_v41.py.
LAYER_FIELDS = (*FIELDS, "pending")


def layer_cache_fields(model, slot: int) -> dict[str, int]:
    """The KV fields deepseek_v41's layer `slot` fills in its LayerCache, with
    the tokens per row: every layer keeps a window; a layer that compresses
    its own KV (a "kv source" with a ratio) adds the compressed rows, and the
    index keys when it is also an index source (read from its attention
    module, as the model code decides it)."""
    if model.model.pipeline_size > 1:
        raise UnsupportedKVConfig(
            "deepseek_v41 under pipeline parallelism passes compressed KV between stages "
            "through the first layer's LayerCache, which mlx-kvq has not declared; use "
            "tensor parallelism, or run without --kv-bits"
        )
    attn = model.layers[slot].self_attn
    fields = {"window": 1}
    if attn.ratio and attn.is_kv_source:
        fields["compress_kv"] = attn.ratio
        if attn.is_index_source:
            fields["index_k"] = attn.ratio
    return fields


@dataclass(frozen=True)
class LayerPlan:
    """What one cache slot gets."""

    slot: int
    kind: str  # full | sliding | chunked | indexer | compressed | state | unused
    window: int | None
    key_spec: QuantSpec
    value_spec: QuantSpec
    kv_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    dtype_size: int = 2  # bytes per element of the model's keys and values (unquantized)
    hand_out: str = PACKED
    skipped: bool = False
    state_bytes: int = 0
    member: int | None = None  # position inside a container slot (CacheList, LayerCache)
    ratio: int = 1  # tokens per stored row (compressed rows)

    @property
    def is_kv(self) -> bool:
        return self.kind in KV_KINDS

    @property
    def quantized(self) -> bool:
        return (
            self.is_kv
            and not self.skipped
            and (self.key_spec.quantized or self.value_spec.quantized)
        )

    def bytes_per_row(self, quantized: bool = True) -> float:
        """Bytes one stored row (one token, or one compressed group) costs."""
        if not self.is_kv:
            return 0.0
        k = self.key_spec if quantized and not self.skipped else QuantSpec(None)
        v = self.value_spec if quantized and not self.skipped else QuantSpec(None)
        return self.kv_heads * (
            self.key_dim * k.bytes_per_element() + self.value_dim * v.bytes_per_element()
        )

    def bytes_per_token(self, quantized: bool = True) -> float:
        return self.bytes_per_row(quantized) / self.ratio

    def rows_held(self, context: int) -> int:
        """Rows stored after `context` tokens (at most: a split-layout window
        also holds the rest of its oldest group)."""
        tokens = context if self.window is None else min(context, self.window + self.extra_rows)
        return tokens // self.ratio

    @property
    def extra_rows(self) -> int:
        """Tokens a split layer may hold beyond its window: the rest of a group."""
        k, v = self.key_spec, self.value_spec
        return max(k.flush_unit, v.flush_unit) - 1 if is_split(k, v) else 0

    def exact_rows(self, context: int) -> int:
        """Unquantized rows a split layer holds after `context` tokens, at most:
        its sinks, its residual and a group not yet complete."""
        k, v = self.key_spec, self.value_spec
        if not (self.quantized and is_split(k, v)):
            return 0
        held = self.rows_held(context)
        return min(held, k.sinks + max(k.residual, v.residual) + self.extra_rows)

    def bytes_at(self, context: int, quantized: bool = True) -> float:
        """Bytes held after `context` tokens (unquantized sinks and tail in 16 bits)."""
        rows = self.rows_held(context)
        if not quantized:
            return self.bytes_per_row(False) * rows
        exact = self.exact_rows(context)
        return self.bytes_per_row() * (rows - exact) + exact * self.kv_heads * 2 * (
            self.key_dim + self.value_dim
        )

    def label(self) -> str:
        if self.kind == "state" and self.ratio > 1:
            return f"state (open group of < {self.ratio} rows, not KV)"
        if self.kind == "state":
            return "state (recurrent, not a KV cache)"
        if self.kind == "unused":
            return "unused (the model never stores K/V here)"
        text = self.kind if self.window is None else f"{self.kind}({self.window})"
        if self.ratio > 1:
            text += f" 1/{self.ratio}"
        if self.skipped:
            return f"{text} UNQUANTIZED (skipped on request)"
        text += f" K {self.key_spec.describe()}"
        text += f" V {self.value_spec.describe()}" if self.value_dim else " (keys only)"
        exact = [f"{n} {what}" for n, what in ((self.key_spec.sinks, "sinks"),
                 (self.key_spec.residual, "recent")) if n]  # fmt: skip
        if exact:
            text += f", {' + '.join(exact)} exact"
        if self.hand_out == DEQUANTIZED:
            text += " [dequantized hand-out]"
        return text


@dataclass
class KVPlan:
    """Every cache slot of a model, what it gets, and what it costs."""

    model_type: str
    config: KVConfig
    layers: list[LayerPlan]
    num_model_layers: int
    shared_layers: int = 0
    sinks: bool = False
    batch: bool = False
    max_context: int | None = None
    max_batch: int | None = None  # sequences one batch may hold (None: no limit)
    notes: list[str] = field(default_factory=list)
    _model: object = field(default=None, repr=False, compare=False)

    # -- building caches ----------------------------------------------------
    def make_cache(self) -> list:
        """Fresh caches for one sequence, exactly as planned."""
        if self._model is None:
            raise RuntimeError(
                "this plan was made from a config alone; load the model to make caches"
            )
        return build_caches(self._model, self)

    # -- facts --------------------------------------------------------------
    def layer(self, slot: int, member: int | None = None) -> LayerPlan:
        """The plan of one cache slot (of one member of a `CacheList` slot)."""
        for p in self.layers:
            if p.slot == slot and p.member == member:
                return p
        raise KeyError(
            f"the plan has no cache slot {slot}"
            + (f" member {member}" if member is not None else "")
        )

    @property
    def kv_layers(self) -> list[LayerPlan]:
        return [p for p in self.layers if p.is_kv]

    @property
    def kinds(self) -> set[str]:
        kinds = {p.kind for p in self.layers}
        if self.shared_layers:
            kinds.add("shared")
        return kinds

    @property
    def max_window(self) -> int | None:
        windows = [p.window for p in self.kv_layers if p.window is not None]
        return max(windows) if windows else None

    @property
    def partial(self) -> bool:
        """Some KV layer left unquantized on request (`--kv-skip-layers`,
        `--kv-window-bits 0`)."""
        return self.config.enabled and any(not p.quantized for p in self.kv_layers)

    @property
    def bytes_per_token(self) -> int:
        return round(sum(p.bytes_per_token() for p in self.kv_layers))

    def estimate(self, context: int, batch: int = 1) -> dict:
        """KV bytes at `context` tokens for `batch` sequences, by kind."""
        by_kind: dict[str, dict[str, int]] = {}
        for p in self.layers:
            entry = by_kind.setdefault(p.kind, {"layers": 0, "bytes": 0, "fp16_bytes": 0})
            entry["layers"] += 1
            if p.is_kv:
                entry["bytes"] += round(p.bytes_at(context) * batch)
                entry["fp16_bytes"] += round(p.bytes_at(context, quantized=False) * batch)
            else:
                entry["bytes"] += p.state_bytes * batch
                entry["fp16_bytes"] += p.state_bytes * batch
        total = sum(e["bytes"] for e in by_kind.values())
        fp16 = sum(e["fp16_bytes"] for e in by_kind.values())
        return {
            "context": context, "batch": batch, "by_kind": by_kind,
            "bytes": total, "fp16_bytes": fp16, "ratio": total / fp16 if fp16 else 1.0,
        }  # fmt: skip

    # -- reports ------------------------------------------------------------
    def summary(self) -> str:
        """One line: coverage, kinds, bits, bytes per token."""
        kv = self.kv_layers
        quantized = sum(p.quantized for p in kv)
        parts = []
        for kind in KV_KINDS:
            n = sum(p.kind == kind for p in kv)
            if n:
                windows = sorted({p.window for p in kv if p.kind == kind and p.window})
                parts.append(
                    f"{n} {kind}" + (f"({','.join(map(str, windows))})" if windows else "")
                )
        state = sum(p.kind == "state" for p in self.layers)
        if state:
            parts.append(f"{state} state (not KV)")
        if self.shared_layers:
            parts.append(f"{self.shared_layers} KV-shared")
        line = (
            f"{self.model_type}: {quantized}/{len(kv)} KV layers quantized "
            f"[{', '.join(parts)}], {self.config.describe()}, "
            f"{self.bytes_per_token} KV bytes/token"
        )
        if self.partial:
            line = "WARNING: PARTIAL KV QUANTIZATION (explicitly requested). " + line
        return line

    def table(self) -> str:
        """Per-layer table, runs of identical layers grouped."""
        lines = [self.summary(), ""]
        lines.append(f"{'slots':>10}  {'treatment':<58} {'heads':>5} {'dims':>9} {'B/token':>9}")
        for first, last, p in _runs(self.layers):
            slots = str(first) if first == last else f"{first}-{last}"
            dims = f"{p.key_dim}/{p.value_dim}" if p.is_kv else "-"
            bpt = f"{p.bytes_per_token():.0f}" if p.is_kv else f"{p.state_bytes} B"
            lines.append(f"{slots:>10}  {p.label():<58} {p.kv_heads or '-':>5} {dims:>9} {bpt:>9}")
        if self.shared_layers:
            lines.append(
                f"{'':>10}  {self.shared_layers} layers reuse an earlier layer's K/V "
                "(KV-shared): no cache of their own, quantized attention on the owner's K/V"
            )
        if self.sinks:
            lines.append(f"{'':>10}  attention sinks: handled by quantized attention")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "model_type": self.model_type,
            "summary": self.summary(),
            "kv_config": asdict(self.config),
            "layers": [
                {**asdict(p), "label": p.label(), "quantized": p.quantized,
                 "bytes_per_token": p.bytes_per_token()}
                for p in self.layers
            ],
            "shared_layers": self.shared_layers,
            "kinds": sorted(self.kinds),
            "kv_layers": len(self.kv_layers),
            "quantized_layers": sum(p.quantized for p in self.kv_layers),
            "partial": self.partial,
            "sinks": self.sinks,
            "bytes_per_token": self.bytes_per_token,
            "fp16_bytes_per_token": round(sum(p.bytes_per_token(False) for p in self.kv_layers)),
            "max_window": self.max_window,
            "max_context": self.max_context,
            "notes": self.notes,
        }  # fmt: skip


def _runs(layers: list[LayerPlan]) -> Iterable[tuple[int, int, LayerPlan]]:
    def key(p: LayerPlan):
        return (p.label(), p.kv_heads, p.key_dim, p.value_dim, p.state_bytes)

    start = 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or key(layers[i]) != key(layers[start]):
            yield layers[start].slot, layers[i - 1].slot, layers[start]
            start = i


# -- building -----------------------------------------------------------------
def _prototype(model, max_kv_size: int | None) -> list:
    """mlx-lm's own (unquantized) cache list for the model."""
    return mlx_cache.make_prompt_cache(model, max_kv_size=max_kv_size)


@dataclass(frozen=True)
class _LayerLeaf:
    """One field of an mlx-lm deepseek_v41 `LayerCache`, planned as a leaf."""

    cache: object
    field: str
    ratio: int


def _flatten(caches: list, model=None) -> list[tuple[int, int | None, object]]:
    """(slot, member, leaf) for every cache leaf: `CacheList` members; the
    fields of a deepseek_v41 `LayerCache` (declared from `model`) or of its
    twin; else the slot's cache."""
    out = []
    for slot, c in enumerate(caches):
        kind = lookup(c)
        if type(c) is mlx_cache.CacheList:
            out.extend((slot, m, member) for m, member in enumerate(c.caches))
        elif type(c) is KVQDeepseekV41Cache:
            out.extend((slot, _member(leaf), leaf) for leaf in c.report_members)
        elif kind is not None and kind.name == "layer":
            fields = layer_cache_fields(model, slot)
            for m, name in enumerate(FIELDS):
                if name in fields:
                    out.append((slot, m, _LayerLeaf(c, name, fields[name])))
            if fields.get("compress_kv", 1) > 1:
                pending = LAYER_FIELDS.index("pending")
                out.append((slot, pending, _LayerLeaf(c, "pending", fields["compress_kv"])))
        else:
            out.append((slot, None, c))
    return out


def _member(leaf) -> int:
    """A `KVQDeepseekV41Cache` leaf's member number (its field's place in LAYER_FIELDS)."""
    return LAYER_FIELDS.index(leaf.field)


def _layer_leaf(leaf: _LayerLeaf) -> tuple[str, int | None, int]:
    """(kind, window, ratio) of a LayerCache field."""
    if leaf.field == "window":
        return "sliding", leaf.cache.window_size, 1
    if leaf.field == "pending":
        return "state", None, leaf.ratio
    return ("compressed" if leaf.field == "compress_kv" else "indexer"), None, leaf.ratio


def _shape_layer_leaf(p: LayerPlan, leaf: _LayerLeaf, cfg: KVConfig) -> LayerPlan:
    """Dims of a probed LayerCache field (one row serves as key and value)."""
    if leaf.field == "pending":
        rows = leaf.cache.compress_kv
        dim = 0 if rows is None else rows.shape[-1]
        # At most ratio - 1 float32 rows of KV and of gate.
        return _replace(p, state_bytes=2 * (leaf.ratio - 1) * dim * 4)
    rows = getattr(leaf.cache, leaf.field)
    if rows is None:
        raise UnsupportedKVConfig(
            f"cache slot {p.slot}: deepseek_v41 is declared to fill LayerCache.{leaf.field} "
            "here, but the probe left it empty; the declaration (layer_cache_fields in "
            "mlx_kvq/plan.py) does not match this mlx-lm version"
        )
    p = _replace(p, kv_heads=1, key_dim=rows.shape[-1], value_dim=0, hand_out=DEQUANTIZED)
    if p.quantized:
        where = f"cache slot {p.slot} (LayerCache.{leaf.field})"
        p.key_spec.check_dim(p.key_dim, where)
        if cfg.rotation == "hadamard":
            _check_rotation(p.key_dim, p.key_dim, where)
    return p


def build_caches(model, plan: KVPlan, start: int | None = None) -> list:
    """Quantized caches for one sequence following `plan` (`start` overrides
    the plan's `quantized_kv_start`)."""
    proto = _prototype(model, plan.config.max_kv_size)

    return [twin_slot(plan, slot, c, start) for slot, c in enumerate(proto)]


def twin_slot(plan: KVPlan, slot: int, cache, start: int | None = None):
    """What `plan` puts in cache slot `slot` in place of `cache` (an mlx-lm
    cache of that slot, empty or filled; `CacheList` members one by one)."""
    start = plan.config.quantized_start if start is None else start
    kind = lookup(cache)
    if kind is not None and kind.name == "layer" and not is_twin(cache):
        members = [p for p in plan.layers if p.slot == slot and p.is_kv and not p.skipped]
        if not members:
            return cache
        fields = {LAYER_FIELDS[p.member]: (p.ratio, p.key_spec, p.value_spec) for p in members}
        return KVQDeepseekV41Cache.from_cache(cache, fields, start)
    if type(cache) is mlx_cache.CacheList:
        return mlx_cache.CacheList(
            *(_twin(plan, plan.layer(slot, m), c, start) for m, c in enumerate(cache.caches))
        )
    return _twin(plan, plan.layer(slot), cache, start)


def _twin(plan: KVPlan, p: LayerPlan, c, start: int):
    if not p.is_kv or p.skipped or is_twin(c):
        return c
    if p.kind == "indexer":
        return KVQIndexerCache.from_cache(c, p.key_spec, p.value_spec, start, p.hand_out)
    if p.kind == "full" and p.window is not None and c.empty():
        window = KVQSplitWindowCache if is_split(p.key_spec, p.value_spec) else KVQWindowCache
        return window(
            p.window, p.key_spec, p.value_spec, keep=0 if plan.batch else 4,
            start=start, hand_out=p.hand_out,
        )  # fmt: skip
    return quantize_cache(c, p.key_spec, p.value_spec, start, p.hand_out)


def model_type_of(model) -> str:
    """The model's `model_type` (its config's), or its module name."""
    args = getattr(model, "args", None)
    mt = getattr(args, "model_type", None)
    if mt:
        return mt
    return type(model).__module__.rsplit(".", 1)[-1]


def model_from_config(config: dict | str | Path) -> nn.Module:
    """Build a model from `config.json` without loading (or materialising) weights."""
    if not isinstance(config, dict):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        config = json.loads(path.read_text())
    model_class, args_class = model_classes(config)
    return model_class(args_class.from_dict(config))


def _probe(model, caches: list, prefill: int = 2) -> tuple[object, list]:
    """Lazy forward pass (`prefill` tokens, then 1): builds the graph, computes nothing."""
    with attention.count_attention() as counts:
        model(mx.arange(1, prefill + 1)[None], cache=caches)
        model(mx.array([[prefill + 1]]), cache=caches)
    return counts, caches


def _slot_shapes(c) -> tuple[int, int, int, int]:
    """(kv heads, key dim, value dim, bytes per element) of a probed mlx-lm cache."""
    return c.keys.shape[1], c.keys.shape[-1], c.values.shape[-1], c.keys.dtype.size


def has_bounded_layers(model_or_config, max_kv_size: int | None = None) -> bool:
    """Whether some KV layer of the model keeps a bounded window of tokens
    (sliding, chunked, or every full layer under `max_kv_size`): the default
    KV setting depends on it (`defaults.default_kv_config`)."""
    return plan_kv(model_or_config, KVConfig(max_kv_size=max_kv_size)).max_window is not None


def plan_kv(
    model_or_config,
    kv_config: KVConfig | None = None,
    *,
    batch: bool = False,
) -> KVPlan:
    """Plan (and check) KV caches for every cache slot of a model.

    `model_or_config` is a loaded model, a `config.json` dict, or a path to a
    model directory or config file (then no weights are loaded). `batch`
    plans for continuous batching (windowed full layers keep no sink tokens).
    """
    cfg = kv_config or KVConfig()
    model = (
        model_or_config
        if isinstance(model_or_config, nn.Module)
        else model_from_config(model_or_config)
    )
    attention.install()  # what its caches hand attention, only ours reads
    model_type = model_type_of(model)
    refused = facts(model_type).refused
    if cfg.enabled and refused:
        raise UnsupportedKVConfig(
            f"{model_type}: KV quantization is not supported: {refused}. Run without --kv-bits"
        )
    proto = _prototype(model, cfg.max_kv_size)
    flat = _flatten(proto, model)
    slots = len(proto)
    for s in cfg.skip_layers:
        if s >= slots:
            raise UnsupportedKVConfig(
                f"--kv-skip-layers names slot {s}, but the model has {slots} cache slots"
            )

    layers: list[LayerPlan] = []
    notes: list[str] = []
    indexer = facts(model_type).indexer_member
    for slot, member, c in flat:
        field = c.field if type(c) is _LayerLeaf else None
        kind = lookup(c.cache if field else c)
        where = f"cache slot {slot}" + (f" member {member}" if member is not None else "")
        if kind is None:
            raise UnsupportedKVConfig(
                f"{where}: cache type {type(c).__module__}.{type(c).__name__} is not a declared "
                f"cache kind of mlx-kvq, so it cannot be quantized (model {model_type}); "
                "declare it in mlx_kvq/caches/registry.py or run without --kv-bits"
            )
        if field is not None:
            name, window, ratio = _layer_leaf(c)
        else:
            name, window, ratio = kind.name, kind.window(c), 1
        if indexer is not None and member == indexer:
            if type(c) is not mlx_cache.KVCache:
                raise UnsupportedKVConfig(
                    f"{where}: {model_type} is declared to keep its indexer keys in a KVCache "
                    f"here, but the model made a {type(c).__name__}; the declaration "
                    "(`indexer_member` in mlx_kvq/model_facts.py) does not match this mlx-lm version"
                )
            name = "indexer"
        if name == "full" and cfg.max_kv_size is not None:
            window = cfg.max_kv_size
        if kind.name == "sliding" and getattr(c, "keep", 0) and batch:
            notes.append(f"{where}: sink tokens (keep={c.keep}) are not kept in batched windows")
        skipped = slot in cfg.skip_layers
        key_spec, value_spec = cfg.specs(bounded=window is not None)
        why = _no_split(kind, field, model_type, indexer)
        if is_split(key_spec, value_spec) and why:
            key_spec, value_spec = per_token(key_spec, cfg), per_token(value_spec, cfg)
            notes.append(
                f"{where} ({name}): {why}, so its keys are quantized per token with no "
                "token kept exact"
            )
        layers.append(
            LayerPlan(
                slot,
                name,
                window,
                key_spec,
                value_spec,
                skipped=skipped,
                member=member,
                ratio=ratio,
            )
        )
    if cfg.max_kv_size is not None and any(p.kind == "full" for p in layers):
        notes.append(
            f"full-attention slots are bounded to the last {cfg.max_kv_size} tokens (--max-kv-size)"
        )

    # Shapes, from a lazy forward over mlx-lm's own caches (long enough that
    # every compressed field gets a row).
    prefill = max([2] + [p.ratio + 1 for p in layers])
    try:
        _probe(model, proto, prefill)
    except Exception as e:  # the model itself does not run: nothing to do with KV
        raise UnsupportedKVConfig(f"{model_type}: probe forward pass failed: {e!r}") from e
    shaped = []
    for p, (_, _, c) in zip(layers, flat, strict=True):
        if type(c) is _LayerLeaf:
            shaped.append(_shape_layer_leaf(p, c, cfg))
            continue
        if p.is_kv and c.keys is None:
            # e.g. nemotron-nas: a cache made for an attention block the model
            # replaced by a linear layer; nothing is ever stored there.
            p = _replace(p, kind="unused")
        elif p.is_kv:
            h, dk, dv, size = _slot_shapes(c)
            if p.kind == "indexer":
                dv = 0  # values are a copy of the keys, or empty: not kept
            hand_out = DEQUANTIZED if p.kind == "indexer" else p.hand_out
            p = _replace(
                p, kv_heads=h, key_dim=dk, value_dim=dv, dtype_size=size, hand_out=hand_out
            )
            if p.quantized:
                where = f"cache slot {p.slot} ({p.kind})"
                p.key_spec.check_dim(dk, where)
                p.value_spec.check_dim(dv, where)
                if cfg.rotation == "hadamard":
                    _check_rotation(dk, dv, where)
        else:
            p = _replace(p, state_bytes=int(c.nbytes) if not c.empty() else 0)
        shaped.append(p)

    plan = KVPlan(
        model_type, cfg, shaped, num_model_layers=len(getattr(model, "layers", [])) or slots,
        batch=batch, notes=notes, _model=model,
    )  # fmt: skip
    if any(kind.one_sequence for kind in map(lookup, proto) if kind is not None):
        plan.max_batch = 1
        notes.append(
            f"{model_type}: one sequence at a time (its cache positions are one number per "
            "batch, so sequences cannot be padded into one batch, as in mlx-lm)"
        )
    unused = [p.slot for p in shaped if p.kind == "unused"]
    if batch and unused:
        raise UnsupportedKVConfig(
            f"{model_type}: cache slot {unused[0]} is never written (its attention block was "
            "replaced), and mlx-lm's batch cache cannot hold a slot that stays empty, so it "
            "cannot be served with continuous batching (as in mlx_lm.server); use "
            "`mlx-kvq generate`"
        )
    plan.shared_layers = max(0, plan.num_model_layers - slots) if _has_kv_sharing(model) else 0
    plan.max_context = _max_context(model)
    if cfg.enabled:
        _check_hand_out(model, plan)
    return plan


def _no_split(kind, field: str | None, model_type: str, indexer) -> str | None:
    """Why a cache of this declared kind takes no split layout (an indexer
    model sets its attention caches' `.keys` itself; deepseek_v41's layer
    fields have no split twin), or None."""
    if indexer is not None:
        return f"{model_type}'s indexer sets its attention caches' `.keys` itself"
    if kind.split is None or field is not None:
        return "no split layout is declared for this kind"
    return None


def per_token(spec: QuantSpec, cfg: KVConfig) -> QuantSpec:
    """`spec` without the split layout: per-token scales in `cfg`'s groups of
    channels (a per-channel key's group counts tokens), no token kept exact."""
    return replace(spec, group_size=cfg.group_size, per_channel=False, sinks=0, residual=0)


def _replace(p: LayerPlan, **changes) -> LayerPlan:
    from dataclasses import replace

    return replace(p, **changes)


def _check_rotation(dk: int, dv: int, where: str) -> None:
    """Refuse a head dimension the Hadamard transform cannot rotate; a
    dimension of 0 (an indexer's absent values) stores nothing to rotate."""
    for d in (dk, dv):
        if d == 0:
            continue
        try:
            mx.eval(mx.hadamard_transform(mx.zeros((1, d))))
        except Exception as e:
            raise UnsupportedKVConfig(
                f"{where}: Hadamard rotation needs a head dimension of the form m*2^k "
                f"(m in 1, 12, 20, 28); got {d}. Use --kv-rotation none"
            ) from e


def _has_kv_sharing(model) -> bool:
    args = getattr(model, "args", None)
    for a in (args, getattr(args, "text_config", None)):
        if a is None:
            continue
        n = (
            a.get("num_kv_shared_layers", 0)
            if isinstance(a, dict)
            else getattr(a, "num_kv_shared_layers", 0)
        )
        if n:
            return True
    return False


def _max_context(model) -> int | None:
    args = getattr(model, "args", None)
    for a in (args, getattr(args, "text_config", None)):
        if a is None:
            continue
        n = (
            a.get("max_position_embeddings")
            if isinstance(a, dict)
            else getattr(a, "max_position_embeddings", None)
        )
        if n:
            return int(n)
    return None


def _check_hand_out(model, plan: KVPlan) -> None:
    """Run the planned caches through the model lazily and make sure every
    quantized slot reaches quantized attention; fall back to dequantized
    hand-out for model code that needs arrays, and say so."""
    declared = facts(plan.model_type).needs_arrays
    modes = [DEQUANTIZED] if declared else [PACKED, DEQUANTIZED]
    errors = []
    for mode in modes:
        plan.layers = [
            _replace(p, hand_out=mode) if p.quantized and p.kind != "indexer" else p
            for p in plan.layers
        ]
        # Quantized from the first token, whatever `quantized_kv_start` says:
        # the probe is short and must exercise the quantized path.
        caches = build_caches(model, plan, start=0)
        try:
            counts, _ = _probe(model, caches, max([2] + [p.ratio + 1 for p in plan.layers]))
        except Exception as e:
            errors.append(f"{mode}: {type(e).__name__}: {e}")
            continue
        plan.sinks = counts["sinks"] > 0
        if mode == PACKED:
            missing = _slots_not_reaching_quantized_attention(plan, caches, counts)
            if missing:
                errors.append(f"{mode}: cache slots {missing} never reached quantized attention")
                continue
        else:
            plan.notes.append(
                f"{plan.model_type}: model code needs arrays, so quantized layers hand out "
                "dequantized K/V (memory saved at rest; a transient full-precision copy per layer "
                "exists during its attention)"
            )
        return
    raise UnsupportedKVConfig(
        f"{plan.model_type}: quantized caches do not run in this model's attention code "
        f"({'; '.join(errors)}). Run without --kv-bits, or report the architecture."
    )


def _slots_not_reaching_quantized_attention(plan: KVPlan, caches: list, counts) -> list[int]:
    seen = {key[1] for key in counts if isinstance(key, tuple) and key[0] == "cache" and key[2]}
    missing = []
    flat = _flatten(caches)
    for p, (slot, _, c) in zip(plan.layers, flat, strict=True):
        if p.kind == "indexer":  # read by the indexer's array code, never by attention
            continue
        if p.quantized and id(c) not in seen and not _reaches_via_owner(c, counts):
            missing.append(slot)
    return missing


def _reaches_via_owner(c, counts) -> bool:
    """Some models (gemma3n, llama4 global/chunk wrappers, CacheList members)
    call attention with another object than the slot's cache; accept the slot
    when every attention call took the quantized path."""
    return counts["full_precision"] == 0 and counts["quantized"] > 0

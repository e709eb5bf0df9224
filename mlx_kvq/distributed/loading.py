"""Sharded loading (mlx-lm's `sharded_load`) and what each rank then owns.

Tensor parallel (the default, as in mlx-lm): every rank holds every layer
with `1/N` of the attention heads, so its caches hold `1/N` of the KV heads.
Pipeline parallel (`--pipeline`): rank `r` holds a contiguous run of layers
(rank 0 the last ones, as mlx-lm splits them) and caches for those only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..caches.base import KVQCache
from ..quant import Store
from .group import world

TENSOR = "tensor"
PIPELINE = "pipeline"


@dataclass(frozen=True)
class Shard:
    """What this rank of the group holds."""

    mode: str  # "tensor" or "pipeline"
    rank: int
    size: int
    first_layer: int  # global index of this rank's first model layer
    num_layers: int  # model layers on this rank
    total_layers: int  # model layers of the whole model

    @property
    def layers(self) -> str:
        last = self.first_layer + self.num_layers - 1
        return str(self.first_layer) if last == self.first_layer else f"{self.first_layer}-{last}"


def load_sharded(
    path: str,
    pipeline: bool = False,
    *,
    tokenizer_config: dict | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, Any, dict, Shard]:
    """mlx-lm's `sharded_load` over the whole group, plus this rank's `Shard`.

    Pipeline mode also makes the quantized caches usable at the stage
    boundary (see `enable_pipeline_caches`).
    """
    from mlx_lm.utils import sharded_load

    g = world()
    if pipeline:
        enable_pipeline_caches()
    model, tokenizer, config = sharded_load(
        path,
        pipeline_group=g if pipeline else None,
        tensor_group=None if pipeline else g,
        return_config=True,
        tokenizer_config=tokenizer_config or {"trust_remote_code": trust_remote_code},
        trust_remote_code=trust_remote_code,
    )
    inner = getattr(model, "model", None)
    if pipeline:
        total = len(inner.layers)
        first = inner.start_idx
        count = (inner.end_idx or total) - first
        shard = Shard(PIPELINE, g.rank(), g.size(), first, count, total)
    else:
        total = len(getattr(model, "layers", []) or [])
        shard = Shard(TENSOR, g.rank(), g.size(), 0, total, total)
    return model, tokenizer, config, shard


# -- pipeline stage boundary ---------------------------------------------------
class _DependableStore(Store):
    """A `Store` that `mx.depends` accepts: a sequence of its arrays.

    mlx-lm's pipeline models end each non-final stage with
    `cache[-1].keys = mx.depends(cache[-1].keys, h)`, which ties the send of
    the hidden state to the cache so that evaluating the cache (prefill)
    performs the send. `mx.depends` takes an array or a sequence of arrays;
    a plain `Store` is neither (and, having `__getitem__` without `__len__`,
    would be iterated forever).
    """

    __slots__ = ()

    def __len__(self) -> int:
        return len(self.parts)

    def __iter__(self):
        return iter(self.parts)

    def __getitem__(self, idx):
        if type(idx) is int:
            return self.parts[idx]
        return Store.__getitem__(self, idx)


def _get_keys(self):
    v = self.__dict__.get("keys")
    if type(v) is Store:
        v.__class__ = _DependableStore
    return v


def _set_keys(self, value) -> None:
    if isinstance(value, (list, tuple)):  # what mx.depends hands back
        old = self.__dict__.get("keys")
        value = _DependableStore(value, old.spec)
    self.__dict__["keys"] = value


_ENABLED = False


def enable_pipeline_caches() -> None:
    """Let mlx-lm's pipeline code put its send dependency on quantized caches.

    Installs a `keys` property on `KVQCache` (every mlx-kvq cache, batch
    forms included) that hands out a `Store` `mx.depends` can take and turns
    the list it returns back into a `Store`. Storage and behaviour are
    otherwise unchanged. Idempotent; only pipeline ranks call it.
    """
    global _ENABLED
    if _ENABLED:
        return
    KVQCache.keys = property(_get_keys, _set_keys)
    _ENABLED = True


def sync_seed(seed: int | None = None) -> int:
    """One random seed for the whole group (rank 0's), applied on every rank.

    Sampling runs on every rank over identical logits; the same seed keeps
    the sampled tokens identical, as mlx-lm's server does.
    """
    from .group import broadcast_json

    if seed is None:
        seed = int(mx.random.randint(0, 2**31 - 1, ()).item())
    seed = int(broadcast_json(seed))
    mx.random.seed(seed)
    return seed

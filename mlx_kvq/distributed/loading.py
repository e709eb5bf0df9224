"""Sharded loading (mlx-lm's `sharded_load`) and what each rank then owns.

Tensor parallel (the default, as in mlx-lm): every rank holds every layer
with `1/N` of the attention heads, so its caches hold `1/N` of the KV heads.
Pipeline parallel (`--pipeline`): rank `r` holds a contiguous run of layers
(rank 0 the last ones, as mlx-lm splits them) and caches for those only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx

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

    def describe(self) -> str:
        if self.mode == PIPELINE:
            return f"rank {self.rank}/{self.size}: layers {self.layers} of {self.total_layers}"
        return f"rank {self.rank}/{self.size}: 1/{self.size} of the heads of all {self.total_layers} layers"

    def to_dict(self) -> dict:
        return {**asdict(self), "layers": self.layers}


def load_sharded(
    path: str,
    pipeline: bool = False,
    *,
    tokenizer_config: dict | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, Any, dict, Shard]:
    """mlx-lm's `sharded_load` over the whole group, plus this rank's `Shard`.

    Pipeline stages end with `cache[-1].keys = mx.depends(cache[-1].keys, h)`
    in mlx-lm's model code; quantized caches take that as they are (see
    `KVQCache.keys`).
    """
    from mlx_lm.utils import sharded_load

    g = world()
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

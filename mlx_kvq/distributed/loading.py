"""Sharded loading (mlx-lm's `sharded_load`) and what each rank then owns.

Tensor parallel (the default, as in mlx-lm): every rank holds every layer
with `1/N` of the attention heads, so its caches hold `1/N` of the KV heads.
A layer with fewer KV heads than ranks (or a count `N` does not divide) has
its KV heads replicated first, as vLLM does (and mlx-lm's qwen3_5 in its own
`shard()`): each head is repeated until `N` divides the count, so each rank
holds whole copies of the heads its query heads read. Pipeline parallel
(`--pipeline`): rank `r` holds a contiguous run of layers (rank 0 the last
ones, as mlx-lm splits them) and caches for those only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

from ..model_facts import facts
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
    kv_layout: str = ""  # how tensor parallelism placed the KV heads (TensorLayout)

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
    layout: TensorLayout | None = None,
) -> tuple[Any, Any, dict, Shard]:
    """mlx-lm's `sharded_load` over the whole group, plus this rank's `Shard`.

    `layout` is what `planning.check_sharding` decided from config.json
    before any weight was read; when it replicates KV heads, the tensor
    parallel load repeats them before mlx-lm's `shard()` (`load_replicated`).
    Pipeline stages end with `cache[-1].keys = mx.depends(cache[-1].keys, h)`
    in mlx-lm's model code; quantized caches take that as they are (see
    `KVQCache.keys`).
    """
    from mlx_lm.utils import sharded_load

    g = world()
    tokenizer_config = tokenizer_config or {"trust_remote_code": trust_remote_code}
    if not pipeline and layout is not None and layout.replicate:
        model, tokenizer, config = load_replicated(path, g, tokenizer_config, trust_remote_code)
    else:
        model, tokenizer, config = sharded_load(
            path,
            pipeline_group=g if pipeline else None,
            tensor_group=None if pipeline else g,
            return_config=True,
            tokenizer_config=tokenizer_config,
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
        described = layout.describe() if layout is not None else ""
        shard = Shard(TENSOR, g.rank(), g.size(), 0, total, total, described)
    return model, tokenizer, config, shard


# -- which sharding a model has (mlx-lm's own test, in `sharded_load`) ----------
def sharding_support(model) -> tuple[bool, bool]:
    """(tensor parallel, pipeline parallel): what mlx-lm's `sharded_load`
    accepts for this model (a `shard()` method; a `model.pipeline()`)."""
    inner = getattr(model, "model", None)
    return hasattr(model, "shard"), inner is not None and hasattr(inner, "pipeline")


# -- KV heads replicated across ranks -------------------------------------------
# mlx-kvq replicates the KV heads of the model modules whose facts name where
# their attention keeps the count (`model_facts.KVHeads`, read from each
# module's Attention and shard()); others with too few KV heads are refused
# before loading (planning.check_sharding).
def replicates_kv_heads(module: str) -> bool:
    """Whether mlx-kvq can replicate the KV heads of model module `module`."""
    return facts(module).kv_heads is not None


def model_module(model) -> str:
    """The mlx-lm module that defines `model` (the key of its `model_facts`)."""
    return type(model).__module__.rsplit(".", 1)[-1]


def kv_replicas(kv_heads: int, ranks: int) -> int:
    """Copies of each KV head so that `ranks` divides the count (1: none)."""
    return 1 if kv_heads % ranks == 0 else ranks // math.gcd(kv_heads, ranks)


def replicate_kv_heads(model, ranks: int) -> list[int]:
    """Repeat each KV head of every attention layer (in place, before
    `shard()`) so that `ranks` divides the count: head `j` becomes copies
    `j*r .. j*r + r - 1`, so query head `h` still reads a copy of the head it
    read (`h // (q_heads / kv_heads)`), alone or sharded. Returns the copies
    per layer. Only for modules whose facts declare `kv_heads`."""
    decl = facts(model_module(model)).kv_heads
    copies = []
    for layer in model.layers:
        attn = layer.self_attn
        heads = getattr(attn, decl.attribute)
        r = kv_replicas(heads, ranks)
        copies.append(r)
        if r == 1:
            continue

        def repeat(p, heads=heads, r=r):
            rows = p.reshape(heads, p.shape[0] // heads, *p.shape[1:])
            return mx.repeat(rows, r, axis=0).reshape(-1, *p.shape[1:])

        for proj in (attn.k_proj, attn.v_proj):
            proj.update(tree_map(repeat, proj.parameters()))
        setattr(attn, decl.attribute, heads * r)
        if decl.derived is not None:
            decl.derived(attn)
    return copies


def load_replicated(path: str, group, tokenizer_config: dict, trust_remote_code: bool):
    """mlx-lm's tensor-parallel `sharded_load`, with the KV heads replicated
    (`replicate_kv_heads`) between loading the weights and `shard()`."""
    from mlx_lm.utils import load_model, load_tokenizer

    from ..mlx_lm_internals import local_model

    model_path = local_model(path)
    model, config = load_model(
        model_path, lazy=True, strict=False, trust_remote_code=trust_remote_code
    )
    tokenizer = load_tokenizer(
        model_path, tokenizer_config, eos_token_ids=config.get("eos_token_id", None)
    )
    replicate_kv_heads(model, group.size())
    model.shard(group)
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu))  # as sharded_load
    return model, tokenizer, config


SPLIT = "split"  # 1/N of the KV heads per rank (mlx-lm's sharding)
REPLICATED = "replicated by mlx-kvq"  # heads repeated before sharding
MODEL_KEEPS = "kept whole by the model's shard()"  # e.g. a latent cache every rank holds


@dataclass(frozen=True)
class TensorLayout:
    """Where tensor parallelism puts the KV heads, decided from config.json.

    `kv_heads` / `rank_kv_heads`: per KV cache slot, the whole model's and
    each rank's; `how` is SPLIT, REPLICATED or MODEL_KEEPS; `copies`: per
    layer, how many copies of each KV head (REPLICATED).
    """

    model_type: str
    ranks: int
    kv_heads: tuple[int, ...]
    rank_kv_heads: tuple[int, ...]
    how: str = SPLIT
    copies: tuple[int, ...] = field(default_factory=tuple)

    @property
    def replicate(self) -> bool:
        return self.how == REPLICATED

    def describe(self) -> str:
        heads = "/".join(map(str, sorted(set(self.kv_heads)))) or "-"
        local = "/".join(map(str, sorted(set(self.rank_kv_heads)))) or "-"
        text = f"KV heads {heads} per layer, {local} per rank over {self.ranks} ranks"
        if self.how == SPLIT:
            return text + " (split)"
        if self.how == REPLICATED:
            r = "/".join(map(str, sorted({c for c in self.copies if c > 1})))
            return text + f" (each KV head replicated x{r} so every rank holds whole heads)"
        return text + f" ({MODEL_KEEPS})"


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

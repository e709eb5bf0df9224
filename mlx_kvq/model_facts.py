"""What mlx-kvq knows about particular mlx-lm model types: one record each.

Almost every architecture is handled by declaration of its cache kinds
(`caches/registry.py`) and by the planner's probe. A few need a fact about
their model code that no probe can find cheaply or safely; each such fact is
a field of that model type's `ModelFacts`, found by the architecture sweep
(`scripts/arch_sweep.py`, `docs/architectures.md`) against mlx-lm 0.32.2.
Keys are mlx-lm model types, which are also the names of their modules
(`mlx_lm.models.<name>`; distributed loading looks modules up by name).
Pure data: this module imports nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OwnCache:
    """A cache class the model defines itself (looked up by qualified name, so
    no model module is imported for it), whose fields are planned one by one;
    `window_attribute` holds its window. Its batch form holds one sequence."""

    qualname: str
    window_attribute: str


@dataclass(frozen=True)
class KVHeads:
    """Where the model's attention keeps its KV head count, for replicating
    heads across ranks: every decoder layer's `self_attn` has `k_proj` /
    `v_proj` whose output rows are the KV heads one after another, and
    `attribute` holds their count (what the module's `shard()` divides by the
    ranks); `derived` recomputes attributes computed from it."""

    attribute: str
    derived: Callable[[Any], None] | None = None


@dataclass(frozen=True)
class ModelFacts:
    """One model type's facts; a field left at its default means "nothing special"."""

    # Its code calls array methods on the cached tensors (latent attention,
    # sparse indexers) or bypasses mlx-lm's attention function: its quantized
    # layers hand out dequantized arrays (the probe also catches models not
    # declared here).
    needs_arrays: bool = False
    # Sparse attention: every `CacheList` slot holds, at this member, the
    # indexer's keys next to the attention cache (the indexer scores them with
    # array code and touches the cache's `.keys` / `.values` directly); that
    # member gets `KVQIndexerCache`.
    indexer_member: int | None = None
    # Why KV quantization is refused for it (its code works with no cache
    # object but mlx-lm's own), or None.
    refused: str | None = None
    # Why its layers keep the padded batch layout (its attention takes mask
    # arrays it lays out for a padded batch itself), or None.
    unpaged: str | None = None
    own_cache: OwnCache | None = None
    kv_heads: KVHeads | None = None


def _gpt_oss_groups(attn: Any) -> None:
    attn.num_key_value_groups = attn.num_attention_heads // attn.num_key_value_heads


_ARRAYS = ModelFacts(needs_arrays=True)
_N_KV_HEADS = ModelFacts(kv_heads=KVHeads("n_kv_heads"))

FACTS: dict[str, ModelFacts] = {
    "bailing_hybrid": _ARRAYS,
    "bailing_moe_v3": _ARRAYS,
    "deepseek_v3": _ARRAYS,
    "deepseek_v32": ModelFacts(needs_arrays=True, indexer_member=1),
    "deepseek_v41": ModelFacts(
        needs_arrays=True,
        own_cache=OwnCache("mlx_lm.models.deepseek_v41.LayerCache", "window_size"),
    ),
    "exaone_moe": _N_KV_HEADS,
    "gemma2": _ARRAYS,
    "glm4_moe": _N_KV_HEADS,
    "glm4_moe_lite": _ARRAYS,
    "glm_moe_dsa": ModelFacts(needs_arrays=True, indexer_member=1),
    "gpt_oss": ModelFacts(kv_heads=KVHeads("num_key_value_heads", _gpt_oss_groups)),
    "iquestloopcoder": _N_KV_HEADS,
    "kimi_k25": _ARRAYS,
    "kimi_k3": _ARRAYS,
    "kimi_linear": _ARRAYS,
    "kimi_vl": _ARRAYS,
    "llama": _N_KV_HEADS,
    "longcat_flash": _ARRAYS,
    "minimax_m3_vl": ModelFacts(
        indexer_member=1, unpaged="its sparse attention passes its own top-k mask arrays"
    ),
    "ministral3": _N_KV_HEADS,
    "mistral4": _ARRAYS,
    "phi": _ARRAYS,
    "phi3small": _ARRAYS,
    "phixtral": _ARRAYS,
    "plamo": _ARRAYS,
    "plamo2": _ARRAYS,
    "qwen2": _N_KV_HEADS,
    "qwen3": _N_KV_HEADS,
    "qwen3_moe": _N_KV_HEADS,
    "stablelm": _ARRAYS,
    "step3p5": ModelFacts(kv_heads=KVHeads("num_kv_heads")),
}

NOTHING_SPECIAL = ModelFacts()


def facts(model_type: str) -> ModelFacts:
    """The facts of `model_type` (a model type or an mlx-lm module name)."""
    return FACTS.get(model_type, NOTHING_SPECIAL)


def declared(fact: str) -> list[str]:
    """The model types whose `fact` (a `ModelFacts` field) is set, sorted."""
    default = getattr(NOTHING_SPECIAL, fact)
    return sorted(t for t, f in FACTS.items() if getattr(f, fact) != default)


__all__ = ["FACTS", "KVHeads", "ModelFacts", "OwnCache", "declared", "facts"]

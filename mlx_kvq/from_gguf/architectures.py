"""The GGUF architectures mlx-kvq reads, declared: how each one's metadata
becomes an mlx-lm ``config.json``, how its tensor names become mlx-lm's, and
which of llama.cpp's conversions to undo.

llama.cpp changes two things on the way in. For ``llama`` it permutes the
rows of the query and key projections into its interleaved RoPE order
(``permute`` in its ``convert_hf_to_gguf.py``); mlx-lm rotates halves, so the
rows are put back. For ``gemma3`` it stores every norm weight as ``1 + w``;
mlx-lm's Gemma norms add the 1 themselves, so it is taken off again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class UnsupportedModel(ValueError):
    """A GGUF file mlx-kvq cannot convert (its architecture, a tensor or a
    setting); raised before any weight is read where the metadata decides."""


# llama.cpp tensor names -> mlx-lm's, per block (`blk.N.` -> `model.layers.N.`)
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# tensors llama.cpp adds that mlx-lm recomputes (RoPE frequencies)
_DERIVED = ("rope_freqs",)


@dataclass(frozen=True)
class Architecture:
    """One GGUF architecture: the mlx-lm model type it becomes, its names, and
    the transforms that undo llama.cpp's conversion."""

    model_type: str
    layer_names: Mapping[str, str]
    config: Callable[[Metadata], dict[str, Any]]
    permute_qk: bool = False  # llama's interleaved RoPE rows
    norm_shift: float = 0.0  # stored norm weight = mlx-lm's + norm_shift

    def mlx_name(self, name: str) -> str | None:
        """mlx-lm's name of a GGUF tensor; None for one mlx-lm derives itself."""
        base, _, suffix = name.rpartition(".")
        if base in _DERIVED:
            return None
        if base in _TOP_NAMES:
            return f"{_TOP_NAMES[base]}.{suffix}"
        parts = base.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in self.layer_names:
            return f"model.layers.{parts[1]}.{self.layer_names[parts[2]]}.{suffix}"
        raise UnsupportedModel(
            f"tensor {name} has no counterpart in mlx-lm's {self.model_type} model; "
            "this file is not a plain text model of its architecture"
        )

    def transform(self, name: str, array: np.ndarray, meta: Metadata) -> np.ndarray:
        """A tensor (dense or packed rows) with llama.cpp's changes undone."""
        if self.permute_qk and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = meta.integer("attention.head_count")
            if ".attn_k." in name:
                heads = meta.integer("attention.head_count_kv", heads)
            return unpermute_rows(array, heads)
        if self.norm_shift and name.endswith("norm.weight"):
            return array - np.float32(self.norm_shift)
        return array


@dataclass(frozen=True)
class Metadata:
    """A GGUF file's key-value metadata, read under its architecture's prefix."""

    values: Mapping[str, Any]
    tensor_names: frozenset[str] = field(default_factory=frozenset)

    @property
    def architecture(self) -> str:
        return str(self.values.get("general.architecture", "?"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(f"{self.architecture}.{key}", default)

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            raise UnsupportedModel(f"the file's metadata has no {self.architecture}.{key}")
        if isinstance(value, (list, tuple)):  # per-layer arrays: all alike here
            if len(set(value)) != 1:
                raise UnsupportedModel(
                    f"{self.architecture}.{key} differs between layers ({sorted(set(value))}); "
                    "mlx-lm's model takes one value"
                )
            value = value[0]
        return int(value)

    def vocab_size(self) -> int:
        tokens = self.values.get("tokenizer.ggml.tokens")
        return int(self.get("vocab_size", len(tokens) if tokens is not None else 0))


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k rows (interleaved RoPE pairs back to
    halves), on a dense weight or on packed rows alike."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_scaling(meta: Metadata) -> dict[str, Any] | None:
    kind = meta.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(meta.get("rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = meta.integer("rope.scaling.original_context_length")
        return {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": original,
        }
    raise UnsupportedModel(f"{meta.architecture}.rope.scaling.type {kind!r} is not supported")


def llama3_rope_scaling(freqs: np.ndarray, head_dim: int, base: float) -> dict[str, Any]:
    """Llama 3.1's RoPE scaling parameters recovered from the `rope_freqs`
    tensor llama.cpp stores instead of them (its per-dimension divisors);
    raises where no standard setting reproduces the tensor."""
    factor = float(freqs.max())
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    for original in (8192, 4096, 16384, 32768, 131072):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 8.0)):
            smooth = (original / wavelen - low) / (high - low)
            want = np.where(
                wavelen < original / high,
                1.0,
                np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)),
            )
            if np.allclose(want, freqs, rtol=1e-3, atol=1e-4):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": original,
                }
    raise UnsupportedModel(
        "rope_freqs: no Llama 3 RoPE scaling setting reproduces the file's frequencies"
    )


def _common(meta: Metadata) -> dict[str, Any]:
    heads = meta.integer("attention.head_count")
    hidden = meta.integer("embedding_length")
    head_dim = meta.integer("attention.key_length", hidden // heads)
    if meta.integer("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModel(
            f"{meta.architecture}: keys and values of different widths are not supported"
        )
    rotary = meta.get("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise UnsupportedModel(
            f"{meta.architecture}.rope.dimension_count {rotary} != head dim {head_dim}: "
            "partial rotary embeddings are not supported for this architecture"
        )
    config = {
        "hidden_size": hidden,
        "num_hidden_layers": meta.integer("block_count"),
        "intermediate_size": meta.integer("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.integer("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": meta.vocab_size(),
        "max_position_embeddings": meta.integer("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in meta.tensor_names,
    }
    scaling = _rope_scaling(meta)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _llama(meta: Metadata) -> dict[str, Any]:
    names = meta.tensor_names
    return {
        **_common(meta),
        "model_type": "llama",
        "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
    }


def _qwen2(meta: Metadata) -> dict[str, Any]:
    return {
        **_common(meta),
        "model_type": "qwen2",
        "rope_theta": float(meta.get("rope.freq_base", 1000000.0)),
    }


def _qwen3(meta: Metadata) -> dict[str, Any]:
    return {
        **_common(meta),
        "model_type": "qwen3",
        "rope_theta": float(meta.get("rope.freq_base", 1000000.0)),
    }


def _gemma3(meta: Metadata) -> dict[str, Any]:
    config = _common(meta)  # mlx-lm applies rope_scaling to the global layers only
    layers = config["num_hidden_layers"]
    # What llama.cpp fixes for Gemma 3 rather than storing: every sixth layer is
    # global, local layers' RoPE base is 10,000, and the 27B model (62 layers)
    # scales queries by hidden/heads instead of the head dim.
    scalar = config["hidden_size"] / config["num_attention_heads"] if layers == 62 else None
    config.pop("tie_word_embeddings")  # mlx-lm ties when lm_head is absent
    return {
        **config,
        "model_type": "gemma3_text",
        "rope_theta": float(meta.get("rope.freq_base", 1000000.0)),
        "rope_local_base_freq": 10000.0,
        "sliding_window": meta.integer("attention.sliding_window"),
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": scalar or config["head_dim"],
    }


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", _LAYER_NAMES, _llama, permute_qk=True),
    "qwen2": Architecture("qwen2", _LAYER_NAMES, _qwen2),
    "qwen3": Architecture("qwen3", _LAYER_NAMES, _qwen3),
    "gemma3": Architecture("gemma3_text", _GEMMA_LAYER_NAMES, _gemma3, norm_shift=1.0),
}


def architecture(meta: Metadata) -> Architecture:
    """The declared architecture of a file, or UnsupportedModel naming it."""
    name = meta.architecture
    if name not in ARCHITECTURES:
        raise UnsupportedModel(
            f"GGUF architecture {name!r} is not supported (supported: "
            f"{', '.join(sorted(ARCHITECTURES))}); convert the original model with mlx_lm.convert"
        )
    return ARCHITECTURES[name]

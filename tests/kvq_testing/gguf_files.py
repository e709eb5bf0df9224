"""Tiny GGUF files written as llama.cpp's converter writes them, from a tiny
mlx-lm model with random weights: q/k rows permuted for llama, Gemma's norms
stored as 1 + w, weights in the given block types, and a tokenizer of
either kind. `reference_model` is the same model with the weights the file
really holds (what quantization left of them), for comparing logits.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import _get_classes

# mlx-lm name suffix -> llama.cpp name (per layer)
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
GEMMA_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}

ARCH_CONFIGS = {
    "llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=0,
        rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=0,
        rope_theta=1000000.0, tie_word_embeddings=True,
    ),
    "qwen3": dict(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
        vocab_size=0, rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=512,
    ),
    "gemma3": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6,
        vocab_size=0, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        query_pre_attn_scalar=64, sliding_window=8, sliding_window_pattern=6,
    ),
}  # fmt: skip


def bpe_vocab() -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary: the 256 byte symbols, a few merges, ChatML
    control tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    symbols = sorted(ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *symbols]
    tokens += [m.replace(" ", "") for m in merges]
    return tokens, merges


def spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece BPE vocabulary: control tokens, byte fallback, pieces
    with scores (higher merges first), a user-defined run of newlines."""
    pieces = ["▁", "t", "h", "e", "a", "n", "i", "▁t", "he", "▁the", "in", "an", "▁a"]
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "\n\n"]
    types = [3, 3, 3, 2, 3, 3, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    scores = [0.0] * len(tokens)
    for i, p in enumerate(pieces):
        tokens.append(p)
        types.append(1)
        scores.append(-float(i))
    return tokens, scores, types


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `permute` of q/k rows (halves -> interleaved pairs)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _stored(w: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or floats to write, the float32 values they hold)."""
    if qtype == GGMLQuantizationType.F32:
        return w.astype(np.float32), w.astype(np.float32)
    data = quantize(w.astype(np.float32), qtype)
    return data, dequantize(data, qtype).reshape(w.shape)


def write_gguf(
    path: Path,
    arch: str,
    weight_type: str = "Q8_0",
    seed: int = 0,
) -> tuple[Path, dict[str, mx.array], dict]:
    """A tiny GGUF file of `arch` with linear weights in `weight_type`; returns
    (path, the weights the file holds under mlx-lm's names, the config)."""
    qtype = GGMLQuantizationType[weight_type]
    config = dict(ARCH_CONFIGS[arch])
    spm = arch == "gemma3"
    if spm:
        tokens, scores, types = spm_vocab()
    else:
        tokens, merges = bpe_vocab()
    config["vocab_size"] = len(tokens)
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    mx.eval(model.parameters())
    weights = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}

    w = GGUFWriter(str(path), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config.get("max_position_embeddings", 2048))
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    if spm:
        w.add_sliding_window(config["sliding_window"])
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
        w.add_token_merges(merges)
        w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
    w.add_token_list(tokens)

    held: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        base, _, suffix = name.rpartition(".")
        if base == "model.embed_tokens":
            gguf_name = "token_embd"
        elif base == "model.norm":
            gguf_name = "output_norm"
        elif base == "lm_head":
            gguf_name = "output"
        else:
            layer, rest = base.split(".")[2], ".".join(base.split(".")[3:])
            table = (
                {**LAYER_NAMES, **GEMMA_NORMS}
                if spm
                else {**LAYER_NAMES, "post_attention_layernorm": "ffn_norm"}
            )
            gguf_name = f"blk.{layer}.{table[rest]}"
        out = value
        if "norm" in base:
            out = value + 1.0 if spm else value
            data, _ = _stored(out, GGMLQuantizationType.F32)
            held[name] = value
            w.add_tensor(f"{gguf_name}.{suffix}", data)
            continue
        if arch == "llama" and gguf_name.endswith(("attn_q", "attn_k")) and suffix == "weight":
            out = _permute(value, heads if gguf_name.endswith("attn_q") else kv_heads)
        kind = qtype if value.ndim == 2 and value.shape[-1] % 32 == 0 else GGMLQuantizationType.F32
        data, values = _stored(out, kind)
        if arch == "llama" and gguf_name.endswith(("attn_q", "attn_k")) and suffix == "weight":
            from mlx_kvq.from_gguf.architectures import unpermute_rows

            values = unpermute_rows(values, heads if gguf_name.endswith("attn_q") else kv_heads)
        held[name] = values
        w.add_tensor(f"{gguf_name}.{suffix}", data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, {k: mx.array(v) for k, v in held.items()}, config


def reference_model(config: dict, held: dict[str, mx.array]):
    """The mlx-lm model of `config` with exactly the weights a file holds."""
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.update(tree_unflatten(list(held.items())))
    mx.eval(model.parameters())
    return model

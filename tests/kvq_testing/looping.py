"""A tiny llama whose greedy reply is a text the test chooses, repeated.

Stand-in for the web tests until `kvq_testing.scripted` lands. The model
is a bigram table: each piece of the reply is one token (added to the
tokenizer when it is not there yet), the embedding is the identity (hidden
size = vocabulary size), attention and MLP outputs are zeroed so that the
residual stream is the current token, and the output head maps the chat template's `<|assistant|>` to the first piece,
each piece to the next and the last back to the first. Whatever the prompt,
greedy decoding after `<|assistant|>` spells the pieces in order and loops
until `max_tokens`; the KV caches are still written and read on every layer
(K/V projections keep their random weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.utils import save_config, save_model

from kvq_testing.tiny import EOS, tiny_config, write_tokenizer

START_TOKEN = "<|assistant|>"


def _byte_level() -> dict[int, str]:
    """GPT-2's byte-to-character table (what a ByteLevel BPE vocabulary stores)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def save_looping_model(
    path: str | Path,
    pieces: list[str],
    model_type: str = "llama:sliding",
    **config_overrides: Any,
) -> Path:
    """Write a model whose greedy chat reply is `"".join(pieces)`, repeated.

    `model_type` must be a llama configuration of `kvq_testing.archs`
    (`llama` or `llama:sliding`); each piece becomes one token (a new one
    unless the base vocabulary has it).
    """
    if len(set(pieces)) != len(pieces) or not all(pieces):
        raise ValueError("the pieces must be distinct, non-empty strings")
    path = Path(path)
    write_tokenizer(path)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    table = _byte_level()
    ids = []
    next_id = max([*vocab.values(), *(t["id"] for t in tokenizer["added_tokens"])]) + 1
    for piece in pieces:
        key = "".join(table[b] for b in piece.encode("utf-8"))
        if key not in vocab:
            vocab[key] = next_id
            next_id += 1
        ids.append(vocab[key])
    start = vocab[START_TOKEN]
    if start in ids:
        raise ValueError(f"{START_TOKEN} cannot be a piece")
    size = -(-next_id // 64) * 64
    config = tiny_config(model_type, size, hidden_size=size, tie_word_embeddings=False,
                         max_position_embeddings=8192, **config_overrides)  # fmt: skip
    if config["model_type"] != "llama":
        raise ValueError(f"{model_type} is not a llama configuration")
    config["eos_token_id"] = vocab[EOS]
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    head = [[0.0] * size for _ in range(size)]
    for current, following in zip([start, *ids], [*ids, ids[0]], strict=True):
        head[following][current] = 1.0
    weights = [("model.embed_tokens.weight", mx.eye(size)), ("lm_head.weight", mx.array(head))]
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        weights.append(
            (prefix + "self_attn.o_proj.weight", mx.zeros_like(layer.self_attn.o_proj.weight))
        )
        weights.append((prefix + "mlp.down_proj.weight", mx.zeros_like(layer.mlp.down_proj.weight)))
    model.load_weights(weights, strict=False)
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(config, path / "config.json")
    return path

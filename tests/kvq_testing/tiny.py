"""Write tiny random-weight model directories that `mlx_lm.load` can open.

Server and engine tests need a real model directory (config.json, weights,
tokenizer with a chat template) but models are never downloaded here. This
module builds one from a tiny configuration in :mod:`kvq_testing.archs`
(or a bare `model_type` with overrides), with a byte-level BPE tokenizer
trained at call time on a few KB of English text bundled below.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from kvq_testing import archs

TOKENIZER_VOCAB = 384  # 256 byte symbols + special tokens + merges
SPECIAL_TOKENS = ["<pad>", "<bos>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD, BOS, EOS = "<pad>", "<bos>", "<|end|>"

# Turns are "<|role|>content<|end|>\n"; the model's reply ends with <|end|> (its EOS).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A server answers many requests at
once by decoding them together in one batch, and every request keeps its own
cache of keys and values. When the cache is stored with fewer bits, more
sequences fit in the same memory, and the model can read a longer context.
Hello, how are you today? I am fine, thank you. What is the weather like in the
city? It is sunny and warm, with a light wind from the sea. Tell me a story about
a small robot who learned to count the stars. Once upon a time there was a little
robot that lived on a hill. Every night it looked up and counted the stars, one by
one, until the sun came back and the birds began to sing again.
Numbers such as 1, 2, 3, 10, 42, 100 and 2026 appear in text, and so do names like
Alice, Bob, Paris, London and Tokyo. The meeting starts at nine o'clock and ends at
noon. Please write a short poem about the river, the mountain and the old bridge.
Water flows under the bridge, the mountain stands still, and the bridge remembers
every traveller who crossed it. Can you explain how a cache works? A cache keeps
recent results close at hand so that the same work is not done twice. If the cache
grows too large, the oldest entries are removed first, so memory stays bounded.
The teacher asked the students to read the first chapter and answer the questions
at the end. They wrote their answers in small notebooks and handed them in before
lunch. In the afternoon they went outside to play football in the park.
Good morning! Good evening! Thanks a lot. You're welcome. See you tomorrow.
"""


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """Train (once per process) a byte-level BPE and return its JSON."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tok.to_str()


def write_tokenizer(path: Path) -> int:
    """Write tokenizer.json/tokenizer_config.json into `path`; return the vocab size."""
    path.mkdir(parents=True, exist_ok=True)
    text = _tokenizer_json()
    (path / "tokenizer.json").write_text(text)
    vocab = json.loads(text)["model"]["vocab"]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1 << 20,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return max(vocab.values()) + 1


def tiny_config(model_type: str, vocab_size: int, **overrides: Any) -> dict:
    """The tiny config for `model_type` (an archs.TINY_CONFIGS key or a bare model type)."""
    if model_type in archs.TINY_CONFIGS:
        config = archs.get_config(model_type)
    else:
        config = {"model_type": model_type}
    nested = "text_config" in config
    targets = [config, config["text_config"]] if nested else [config]
    for cfg in targets:
        cfg["vocab_size"] = vocab_size
        if "vocab_size_per_layer_input" in cfg:
            cfg["vocab_size_per_layer_input"] = vocab_size
    config.update(copy.deepcopy(overrides))
    return config


def save_tiny_model(path: str | Path, model_type: str, **config_overrides: Any) -> Path:
    """Write a float32 random-weight model directory loadable by `mlx_lm.load`.

    `model_type` is a key of `kvq_testing.archs.TINY_CONFIGS` (for example
    "gemma4_text:kv_shared" or "gpt_oss") or any mlx-lm model type, in which
    case `config_overrides` must supply the rest of its configuration.
    Weights are seeded, so the same call writes the same model.
    """
    from mlx_lm.utils import save_config, save_model

    from mlx_kvq.mlx_lm_internals import model_classes

    path = Path(path)
    vocab = write_tokenizer(path)
    vocab = -(-vocab // 64) * 64  # a round embedding size
    config = tiny_config(model_type, vocab, **config_overrides)
    eos_id = json.loads(_tokenizer_json())["model"]["vocab"][EOS]
    config.setdefault("eos_token_id", eos_id)

    model_class, args_class = model_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    fix = getattr(archs, "_POST_INIT", {}).get(model.__module__.rsplit(".", 1)[-1])
    if fix is not None:
        fix(model)
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(config, path / "config.json")
    return path

"""A GGUF file's tokenizer, rebuilt with the `tokenizers` library.

Two vocabulary kinds cover the supported architectures:

- ``gpt2``: byte-level BPE with the file's merges, split first by the
  pre-tokenizer regexes llama.cpp uses for the file's ``tokenizer.ggml.pre``
  (llama3, qwen2, smollm, gpt2, ...);
- ``llama``: SentencePiece BPE with byte fallback. The file stores scores, not
  merges; a merge's rank is the score of the piece it makes, which is how
  SentencePiece (and llama.cpp) choose the next merge.

Control tokens become special added tokens; user-defined ones (Gemma's runs
of newlines and tabs, HTML tags) are matched whole in the raw text before the
model runs, as llama.cpp does. BOS is added when the file says so, and the
end-of-generation tokens are the file's EOS and EOT ids plus the control
tokens llama.cpp recognizes as ending a turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from .architectures import Metadata, UnsupportedModel


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# tokenizer.ggml.pre -> (regexes applied in turn, whole words looked up before merges)
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "llama-bpe": ((_LLAMA3,), True),
    "llama3": ((_LLAMA3,), True),
    "llama-v3": ((_LLAMA3,), True),
    "dbrx": ((_LLAMA3,), False),
    "smaug-bpe": ((_LLAMA3,), False),
    "qwen2": ((_QWEN2,), False),
    "deepseek-r1-qwen": ((_QWEN2,), False),
    "stablelm2": ((_QWEN2,), False),
    "smollm": ((r"\p{N}", _GPT2), False),
    "refact": ((r"\p{N}", _GPT2), False),
    "command-r": ((r"\p{N}", _GPT2), False),
    "codeshell": ((r"\p{N}", _GPT2), False),
    "gpt-2": ((_GPT2,), False),
    "gpt2": ((_GPT2,), False),
    "mpt": ((_GPT2,), False),
    "olmo": ((_GPT2,), False),
    "phi-2": ((_GPT2,), False),
    "default": (
        (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
        False,
    ),
}
# control tokens that end a turn (llama.cpp's end-of-generation list)
END_OF_TURN = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
)


@dataclass(frozen=True)
class Vocab:
    """What mlx-lm's tokenizer files need: the `tokenizers` JSON, the
    `tokenizer_config.json` fields and the end-of-generation ids."""

    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None


def _field(meta: Metadata, key: str, default: Any = None) -> Any:
    return meta.values.get(f"tokenizer.ggml.{key}", default)


def _token_id(meta: Metadata, key: str, count: int) -> int | None:
    value = _field(meta, f"{key}_token_id")
    return int(value) if value is not None and 0 <= int(value) < count else None


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges from its scores: every split of a normal
    piece into two pieces of the vocabulary, ranked by the piece's score."""
    index = {t: i for i, t in enumerate(tokens) if types[i] == TokenType.NORMAL}
    ranked = []
    for piece, i in index.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                ranked.append((-scores[i], index[left], index[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def build_vocab(meta: Metadata) -> Vocab:
    """The file's tokenizer, or UnsupportedModel naming what cannot be rebuilt."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, processors
    from tokenizers import pre_tokenizers as pre
    from tokenizers.models import BPE

    kind = _field(meta, "model")
    tokens = list(_field(meta, "tokens") or [])
    if not tokens:
        raise UnsupportedModel("the file has no tokenizer (tokenizer.ggml.tokens is missing)")
    count = len(tokens)
    types = list(_field(meta, "token_type") or [TokenType.NORMAL] * count)
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = _token_id(meta, "unknown", count)
    if kind == "gpt2":
        pre_name = str(_field(meta, "pre", "default"))
        if pre_name not in PRE_TOKENIZERS:
            raise UnsupportedModel(
                f"tokenizer.ggml.pre {pre_name!r} is not supported (known: "
                f"{', '.join(sorted(PRE_TOKENIZERS))})"
            )
        regexes, whole_words = PRE_TOKENIZERS[pre_name]
        merges = [tuple(m.split(" ", 1)) for m in _field(meta, "merges") or []]
        tok = Tokenizer(BPE(vocab, merges, ignore_merges=whole_words))
        tok.pre_tokenizer = pre.Sequence(
            [pre.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tok.decoder = decoders.ByteLevel()
        post = [processors.ByteLevel(trim_offsets=False)]
    elif kind == "llama":
        scores = list(_field(meta, "scores") or [0.0] * count)
        merges = _spm_merges(tokens, scores, types)
        unk_piece = tokens[unk] if unk is not None else None
        tok = Tokenizer(BPE(vocab, merges, unk_token=unk_piece, fuse_unk=True, byte_fallback=True))
        space_prefix = bool(_field(meta, "add_space_prefix", True))
        steps = [normalizers.Prepend("▁")] if space_prefix else []
        tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
        decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if space_prefix:
            decode.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(decode)
        post = []
    else:
        raise UnsupportedModel(
            f"tokenizer.ggml.model {kind!r} is not supported (gpt2 BPE and llama "
            "SentencePiece vocabularies are)"
        )
    added = []
    for t, kind_id in zip(tokens, types, strict=True):
        if kind_id in (TokenType.CONTROL, TokenType.UNKNOWN):
            added.append(AddedToken(t, special=True, normalized=False))
        elif kind_id == TokenType.USER_DEFINED:
            added.append(AddedToken(t, special=False, normalized=False))
    tok.add_tokens(added)

    bos = _token_id(meta, "bos", count)
    eos = _token_id(meta, "eos", count)
    add_bos = bool(_field(meta, "add_bos_token", kind == "llama")) and bos is not None
    add_eos = bool(_field(meta, "add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = " ".join(
            ([f"{tokens[bos]}:0"] if add_bos else [])
            + ["$A:0"]
            + ([f"{tokens[eos]}:0"] if add_eos else [])
        )
        specials = [(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on]
        post.append(processors.TemplateProcessing(single=single, special_tokens=specials))
    if post:
        tok.post_processor = post[0] if len(post) == 1 else processors.Sequence(post)

    ends = [
        i
        for i in (eos, _token_id(meta, "eot", count), _token_id(meta, "eom", count))
        if i is not None
    ]
    ends += [
        vocab[t]
        for t in END_OF_TURN
        if t in vocab and types[vocab[t]] == TokenType.CONTROL and vocab[t] not in ends
    ]
    pad = _token_id(meta, "padding", count)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.integer("context_length", 4096),
    }
    for name, i in (("bos", bos), ("eos", eos), ("unk", unk), ("pad", pad)):
        if i is not None:
            config[f"{name}_token"] = tokens[i]
    template = meta.values.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    return Vocab(tok.to_str(), config, tuple(dict.fromkeys(ends)), bos)

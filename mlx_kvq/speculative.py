"""What speculative decoding needs of the caches, decided before it starts.

mlx-lm's speculative loop (`speculative_generate_step`) rewinds both models'
caches with `trim` after rejected draft tokens. Whether a cache can be
rewound is declared here, by exact type (`REWIND`), never guessed:

- full attention trims exactly;
- a sliding window that has wrapped has overwritten its oldest tokens;
  mlx-kvq's window keeps the tokens it evicts during the last steps
  (`KVQWindowCache.set_rewind`), so it rewinds exactly, its bytes bounded by
  `window + num_draft_tokens + 1` slots; mlx-lm's own `RotatingKVCache`
  (a layer left unquantized by `--kv-skip-layers`) cannot, and mlx-lm's
  `trim_prompt_cache` would then silently trim nothing;
- recurrent state and chunked attention are not declared rewindable.

mlx-lm also splits the combined cache list by `len(model.layers)`, which is
wrong for KV-shared models (fewer cache slots than layers), and a draft
model must share the model's vocabulary. Everything is checked by
`check_speculation` from the planned caches, so a model that cannot be
served speculatively is refused at startup, naming the slot.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache

from .caches import (
    KVQChunkedCache,
    KVQFullCache,
    KVQSplitCache,
    KVQSplitChunkedCache,
    KVQSplitWindowCache,
    KVQWindowCache,
)
from .config import UnsupportedKVConfig

DEFAULT_DRAFT_TOKENS = 3  # mlx-lm's --num-draft-tokens default
MAX_DRAFT_TOKENS = 64  # per step; a window keeps this many evicted slots to rewind


class Rewind(str, Enum):
    """How a cache goes back after rejected draft tokens."""

    EXACT = "exact"  # trims back exactly
    RING = "ring"  # a window that keeps its last evicted tokens (set_rewind)
    NONE = "none"  # cannot be rewound


REWIND: dict[type, tuple[Rewind, str]] = {
    KVQFullCache: (Rewind.EXACT, "full attention"),
    KVQSplitCache: (Rewind.EXACT, "full attention (split layout)"),
    KVQSplitWindowCache: (Rewind.RING, "sliding window (split layout)"),
    KVQSplitChunkedCache: (Rewind.NONE, "chunked attention is not declared rewindable"),
    mlx_cache.KVCache: (Rewind.EXACT, "full attention"),
    KVQWindowCache: (Rewind.RING, "sliding window"),
    mlx_cache.RotatingKVCache: (
        Rewind.NONE,
        "mlx-lm's own sliding window (RotatingKVCache) overwrites the tokens a rejected draft "
        "would need back; use mlx-kvq's caches for it (do not skip its slot with "
        "--kv-skip-layers; mlx-kvq's windows rewind, quantized or not)",
    ),
    mlx_cache.ArraysCache: (
        Rewind.NONE,
        "a recurrent state cannot be rewound token by token",
    ),
    KVQChunkedCache: (Rewind.NONE, "chunked attention is not declared rewindable"),
    mlx_cache.ChunkedKVCache: (Rewind.NONE, "chunked attention is not declared rewindable"),
}


def _leaves(cache: list) -> list[tuple[int, Any]]:
    out = []
    for slot, c in enumerate(cache):
        members = c.caches if type(c) is mlx_cache.CacheList else (c,)
        out.extend((slot, m) for m in members)
    return out


def check_speculation(
    model: nn.Module,
    draft_model: nn.Module,
    model_cache: list,
    draft_cache: list,
    vocab: tuple[int, int] | None = None,
) -> None:
    """Refuse what mlx-lm's speculative loop would split, rewind or decode wrongly.

    `model_cache` and `draft_cache` are caches as the plans make them;
    `vocab` is (the model's, the draft model's) tokenizer vocabulary size.
    """
    if vocab is not None and vocab[0] != vocab[1]:
        raise UnsupportedKVConfig(
            f"speculative decoding: the draft model's vocabulary has {vocab[1]} tokens, the "
            f"model's {vocab[0]}; the draft model must use the model's tokenizer"
        )
    if len(model_cache) != len(model.layers):
        raise UnsupportedKVConfig(
            f"speculative decoding: the model has {len(model_cache)} cache slots for "
            f"{len(model.layers)} layers (KV-shared layers); mlx-lm's speculative loop "
            "splits caches by layer count. Run without --draft-model"
        )
    for name, caches in (("model", model_cache), ("draft model", draft_cache)):
        for slot, c in _leaves(caches):
            how, why = REWIND.get(type(c), (Rewind.NONE, f"{type(c).__name__} is not declared"))
            if how is Rewind.NONE:
                raise UnsupportedKVConfig(
                    f"speculative decoding: the {name}'s cache slot {slot} cannot be rewound "
                    f"after rejected draft tokens: {why}. Run without --draft-model"
                )


def prepare_for_speculation(cache: list, num_draft_tokens: int) -> list:
    """Make `cache`'s windows rewindable by one speculative step (in place)."""
    for _, c in _leaves(cache):
        if REWIND.get(type(c), (Rewind.NONE, ""))[0] is Rewind.RING:
            c.set_rewind(num_draft_tokens + 1)
    return cache


def end_speculation(cache: list) -> list:
    """Stop keeping evicted tokens (before the caches are stored for reuse)."""
    for _, c in _leaves(cache):
        if REWIND.get(type(c), (Rewind.NONE, ""))[0] is Rewind.RING:
            c.set_rewind(0)
    return cache


def split_caches(model: nn.Module, prompt_cache: list | None) -> tuple[list | None, list | None]:
    """A combined speculative cache list as mlx-lm splits it: (target's, draft's)."""
    if prompt_cache is None:
        return None, None
    n = len(model.layers)
    return prompt_cache[:n], prompt_cache[n:]

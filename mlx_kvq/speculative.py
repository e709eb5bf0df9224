"""What speculative decoding needs of the caches, checked before it starts.

mlx-lm's speculative loop rewinds both caches with `trim` after rejected
draft tokens. Quantized full-attention caches trim exactly. A wrapped
sliding window cannot be rewound (its oldest slots are overwritten), and
mlx-lm's `trim_prompt_cache` then silently trims nothing, so such models are
refused here, before generation starts. mlx-lm also splits the combined cache
list by `len(model.layers)`, which is wrong for KV-shared models (fewer cache
slots than layers): refused too.
"""

from __future__ import annotations

import mlx.nn as nn

from .config import UnsupportedKVConfig

DEFAULT_DRAFT_TOKENS = 3  # mlx-lm's --num-draft-tokens default
MAX_DRAFT_TOKENS = 64  # per step; a window keeps this many evicted slots to rewind


def split_caches(model: nn.Module, prompt_cache: list | None) -> tuple[list | None, list | None]:
    """A combined speculative cache list as mlx-lm splits it: (target's, draft's)."""
    if prompt_cache is None:
        return None, None
    n = len(model.layers)
    return prompt_cache[:n], prompt_cache[n:]


def check_speculative_caches(
    model: nn.Module, draft_model: nn.Module, model_cache: list, draft_cache: list
) -> None:
    """Refuse caches mlx-lm's speculative loop would split or rewind wrongly."""
    if len(model_cache) != len(model.layers):
        raise UnsupportedKVConfig(
            f"speculative decoding: the model has {len(model_cache)} cache slots for "
            f"{len(model.layers)} layers (KV-shared layers); mlx-lm's speculative loop "
            "splits caches by layer count. Run without --draft-model"
        )
    for name, caches in (("model", model_cache), ("draft model", draft_cache)):
        windows = [i for i, c in enumerate(caches) if hasattr(c, "max_size")]
        if windows:
            raise UnsupportedKVConfig(
                f"speculative decoding: the {name} has sliding-window cache slots {windows}; "
                "a wrapped window cannot be rewound after rejected draft tokens. "
                "Run without --draft-model (or without --max-kv-size)"
            )

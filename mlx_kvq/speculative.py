"""Speculative decoding with quantized caches on both models.

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

from .config import KVConfig, UnsupportedKVConfig


def speculative_caches(
    model: nn.Module, draft_model: nn.Module, prompt_cache, cfg: KVConfig
) -> list:
    """Target caches followed by draft caches, both quantized as planned."""
    from .generate import _prepare_cache

    if prompt_cache is not None:
        n = len(model.layers)
        model_cache, draft_cache = prompt_cache[:n], prompt_cache[n:]
    else:
        model_cache = draft_cache = None
    model_cache = _prepare_cache(model, model_cache, cfg) or _fresh(model, cfg)
    draft_cache = _prepare_cache(draft_model, draft_cache, cfg) or _fresh(draft_model, cfg)
    for name, m, caches in (
        ("model", model, model_cache),
        ("draft model", draft_model, draft_cache),
    ):
        if name == "model" and len(caches) != len(m.layers):
            raise UnsupportedKVConfig(
                f"speculative decoding: the {name} has {len(caches)} cache slots for "
                f"{len(m.layers)} layers (KV-shared layers); mlx-lm's speculative loop "
                "splits caches by layer count. Run without --draft-model"
            )
        windows = [i for i, c in enumerate(caches) if hasattr(c, "max_size")]
        if windows:
            raise UnsupportedKVConfig(
                f"speculative decoding: the {name} has sliding-window cache slots {windows}; "
                "a wrapped window cannot be rewound after rejected draft tokens. "
                "Run without --draft-model (or without --max-kv-size)"
            )
    return list(model_cache) + list(draft_cache)


def _fresh(model: nn.Module, cfg: KVConfig) -> list:
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model, max_kv_size=cfg.max_kv_size)

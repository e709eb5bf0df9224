"""`mlx-kvq cache-prompt`: process a prefix once and save its quantized caches
(like `mlx_lm.cache_prompt`); `mlx-kvq generate --prompt-cache-file` continues it."""

from __future__ import annotations

import argparse

from .flags import add_cache_prompt_flags, kv_config
from .startup import kv_setting, load_model, model_source, refuse_early


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("cache-prompt", help="process a prefix once and save its quantized caches")
    add_cache_prompt_flags(c)
    c.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from ..caches import cache_report
    from ..generate import get_plan, save_prompt_cache

    kv_config(args)
    source = model_source(args)
    refuse_early(source, kv_setting(args, source))
    model, tokenizer = load_model(source, args)
    cfg = kv_setting(args, source, model)
    plan = get_plan(model, cfg) if cfg.enabled else None
    print(plan.summary() if plan else "KV cache: unquantized")
    cache = plan.make_cache() if plan else make_prompt_cache(model, max_kv_size=cfg.max_kv_size)
    tokens = mx.array(tokenizer.encode(args.prompt.replace("\\n", "\n")))
    for start in range(0, tokens.size, args.prefill_step_size):
        model(tokens[None, start : start + args.prefill_step_size], cache=cache)
        mx.eval([c.state for c in cache])
    metadata = {"model": source.location, "tokens": str(tokens.size), "kv": cfg.describe()}
    save_prompt_cache(args.prompt_cache_file, cache, metadata)
    held = sum(r["nbytes"] for r in cache_report(cache))
    print(f"saved {tokens.size} tokens to {args.prompt_cache_file} ({held} KV bytes held)")
    return 0

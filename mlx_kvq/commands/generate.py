"""`mlx-kvq generate`: like `mlx_lm.generate`, every KV layer quantized.

It prints the plan first, then the text, then mlx-lm's speed lines, peak
memory and the KV bytes the caches hold. Under `mlx.launch` every rank takes
the same steps (`startup.Launch`): it loads its shard, plans and validates
its own caches, agrees with the group, and runs the same generation (the
collectives inside the model keep the ranks in step); rank 0 prints, with
one line per rank.
"""

from __future__ import annotations

import argparse

from .flags import (
    add_generate_flags,
    check_draft_tokens,
    kv_config,
    sampling_defaults,
)
from .startup import Launch, model_directory, model_source, prepare_compute, refuse_early


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser(
        "generate", help="generate text like mlx_lm.generate, every KV layer quantized"
    )
    add_generate_flags(g)
    g.set_defaults(run=run)


def prompt_tokens(tokenizer, args: argparse.Namespace, continuing: bool = False) -> list[int]:
    """The prompt as mlx_lm.generate builds it (chat template unless told not to);
    `continuing` a prompt-cache file, it is plain text that follows the file's prefix."""
    prompt = args.prompt.replace("\\n", "\n")
    use_template = (
        not continuing and not args.ignore_chat_template and tokenizer.chat_template is not None
    )
    if use_template:
        messages = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(prompt, add_special_tokens=not continuing and not use_template)


def sampler(args: argparse.Namespace):
    """mlx-lm's sampler for the sampling flags (a bad value exits 2 before loading)."""
    from mlx_lm.sample_utils import make_sampler

    p = sampling_defaults(args)
    return make_sampler(p.temperature, p.top_p, p.min_p, top_k=p.top_k)


def run(args: argparse.Namespace) -> int:
    """Generate once, in one process or on every rank of an `mlx.launch` group."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from ..blas import blas_info
    from ..caches import cache_report
    from ..generate import check_prompt_cache_settings, load_prompt_cache, stream_generate
    from ..kernels import native_status

    launch = Launch.current()
    say = launch.say
    with launch.refusing():
        kv_config(args)
        check_draft_tokens(args)
        sample = sampler(args)
        source = model_source(args)
        launch.refuse_in_group(args, "draft_model", "adapter_path", "prompt_cache_file")
        cfg = launch.kv_setting(args, source)
        refuse_early(source, cfg)
        cache, meta = None, {}
        if args.prompt_cache_file:  # read before the weights: a bad file exits 2 at once
            cache, meta = load_prompt_cache(args.prompt_cache_file, return_metadata=True)
            check_prompt_cache_settings(cache, cfg, args.prompt_cache_file)
    model, tokenizer = launch.load(source, args)
    with launch.refusing():
        cfg = launch.kv_setting(args, source, model)  # the default follows the loaded layout
        if cache is not None:
            check_prompt_cache_settings(cache, cfg, args.prompt_cache_file)
        plan, infos = launch.plan(model, cfg) if cfg.enabled else (None, launch.shard_infos())
    draft = None
    if args.draft_model:
        draft = load(model_directory(args.draft_model, "--draft-model")[0])[0]
        prepare_compute(draft, args)
    say(launch.plan_text(plan, infos, args.verbose))
    say("=" * 10)
    if cache is not None:
        say(f"prompt cache: {meta.get('tokens', '?')} tokens of {args.prompt_cache_file!r}")
    tokens = prompt_tokens(tokenizer, args, continuing=cache is not None)
    if cache is None and draft is None:
        cache = plan.make_cache() if plan is not None else make_prompt_cache(model, cfg.max_kv_size)

    kv = plan.config if plan is not None else cfg  # a rank's plan names its own layers
    kwargs = dict(max_tokens=args.max_tokens, sampler=sample,
                  prompt_cache=cache, **kv.as_kwargs())  # fmt: skip
    if draft is not None:
        kwargs["num_draft_tokens"] = args.num_draft_tokens
    mx.reset_peak_memory()
    if args.seed is not None and not launch.grouped:  # a group's seed is set when it loads
        mx.random.seed(args.seed)
    response = None
    for response in stream_generate(model, tokenizer, tokens, draft_model=draft, **kwargs):
        say(response.text, end="")
    say()
    say("=" * 10)
    held = launch.kv_bytes(cache) if cache is not None else None
    launch.close()
    if response is None:
        say("No text generated for this prompt")
        return 0
    say(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
    say(
        f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec"
    )
    say(launch.named(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB"))
    say(f"BLAS: {blas_info().summary()}")
    say(f"Native kernels: {native_status().summary()}")
    if held is None:
        return 0
    if args.verbose:
        for i, r in enumerate(cache_report(cache)):
            state = "quantized" if r["quantized"] else "unquantized"
            say(launch.named(f"held slot {i}: {r['kind']} {state} {r['nbytes']} {r['tokens']}"))
    ranks = f" across {len(held)} ranks" if launch.grouped else ""
    say(f"KV bytes held: {sum(held)} ({sum(held) / 2**20:.2f} MiB){ranks}")
    for r, (b, info) in enumerate(zip(held, infos or (), strict=False)):
        say(
            f"  rank {r} ({info.get('mode')} parallel, layers {info.get('layers')}): KV bytes held: {b}"
        )
    return 0

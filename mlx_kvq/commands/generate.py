"""`mlx-kvq generate`: like `mlx_lm.generate`, every KV layer quantized.

It prints the plan first, then the text, then mlx-lm's speed lines, peak
memory and the KV bytes the caches hold. Under `mlx.launch` every rank loads
its shard, plans and validates its own caches, agrees with the group, and
runs the same generation (the collectives inside the model keep the ranks
in step); rank 0 prints, with one line per rank.
"""

from __future__ import annotations

import argparse
import sys

from .flags import (
    add_adapter_flag,
    add_draft_flags,
    add_kv_flags,
    add_model_flag,
    check_draft_tokens,
    kv_config,
)
from .startup import (
    check_sharding_early,
    kv_setting,
    load_model,
    model_directory,
    model_source,
    refuse_early,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser(
        "generate", help="generate text like mlx_lm.generate, every KV layer quantized"
    )
    add_model_flag(g)
    add_adapter_flag(g)
    g.add_argument("--prompt", "-p", default="And God said", help="the prompt")
    g.add_argument("--max-tokens", "-m", type=int, default=100, help="tokens to generate")
    g.add_argument("--temp", type=float, default=0.0, help="sampling temperature")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus top-p")
    g.add_argument("--seed", type=int, default=None, help="random seed")
    g.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the raw prompt without the tokenizer's chat template",
    )
    add_draft_flags(g)
    g.add_argument(
        "--prompt-cache-file", default=None, help="prompt cache written by `mlx-kvq cache-prompt`"
    )
    g.add_argument(
        "--verbose",
        action="store_true",
        help="print the whole plan table, and the bytes each cache slot holds at the end",
    )
    g.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch: pipeline parallel (layers split over ranks) instead of "
                   "tensor parallel (heads split over ranks), as in mlx-lm")  # fmt: skip
    add_kv_flags(g)
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


def run(args: argparse.Namespace) -> int:
    from ..distributed.group import launched

    if launched():
        return run_ranks(args)
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from ..blas import blas_info
    from ..caches import cache_report
    from ..generate import check_prompt_cache_settings, get_plan, load_prompt_cache, stream_generate
    from ..kernels import native_status

    kv_config(args)
    check_draft_tokens(args)
    source = model_source(args)
    cfg = kv_setting(args, source)
    refuse_early(source, cfg)
    cache, meta = None, {}
    if args.prompt_cache_file:  # read before the weights: a bad file exits 2 at once
        cache, meta = load_prompt_cache(args.prompt_cache_file, return_metadata=True)
        check_prompt_cache_settings(cache, cfg, args.prompt_cache_file)
    model, tokenizer = load_model(source, args)
    if source.local_config is None:  # the default follows the loaded model's layout
        cfg = kv_setting(args, source, model)
        if cache is not None:
            check_prompt_cache_settings(cache, cfg, args.prompt_cache_file)
    draft = None
    if args.draft_model:
        draft = load(model_directory(args.draft_model, "--draft-model")[0])[0]
    plan = get_plan(model, cfg) if cfg.enabled else None
    print(
        plan.table()
        if (plan and args.verbose)
        else (plan.summary() if plan else "KV cache: unquantized")
    )
    print("=" * 10)
    if cache is not None:
        print(f"prompt cache: {meta.get('tokens', '?')} tokens of {args.prompt_cache_file!r}")
    tokens = prompt_tokens(tokenizer, args, continuing=cache is not None)
    if cache is None and draft is None:
        cache = plan.make_cache() if plan is not None else make_prompt_cache(model, cfg.max_kv_size)

    kwargs = dict(max_tokens=args.max_tokens, sampler=make_sampler(args.temp, args.top_p),
                  prompt_cache=cache, **cfg.as_kwargs())  # fmt: skip
    if draft is not None:
        kwargs["num_draft_tokens"] = args.num_draft_tokens
    mx.reset_peak_memory()
    if args.seed is not None:
        mx.random.seed(args.seed)
    response = None
    for response in stream_generate(model, tokenizer, tokens, draft_model=draft, **kwargs):
        print(response.text, end="", flush=True)
    print()
    print("=" * 10)
    if response is None:
        print("No text generated for this prompt")
        return 0
    print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
    print(
        f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec"
    )
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    print(f"BLAS: {blas_info().summary()}")
    print(f"Native kernels: {native_status().summary()}")
    if cache is not None:
        report = cache_report(cache)
        if args.verbose:
            for i, r in enumerate(report):
                state = "quantized" if r["quantized"] else "unquantized"
                print(f"held slot {i}: {r['kind']} {state} {r['nbytes']} {r['tokens']}")
        held = sum(r["nbytes"] for r in report)
        print(f"KV bytes held: {held} ({held / 2**20:.2f} MiB)")
    return 0


def run_ranks(args: argparse.Namespace) -> int:
    """One rank of an `mlx.launch` group (see the module docstring)."""
    from mlx_lm.models import cache as mlx_cache
    from mlx_lm.sample_utils import make_sampler

    from ..config import UnsupportedKVConfig
    from ..distributed.group import gather_json, world
    from ..distributed.heartbeat import Heartbeat, RankLoss, abort_on_loss
    from ..distributed.loading import load_sharded, sync_seed
    from ..distributed.planning import gather_kv_bytes, plan_on_every_rank, ranks_table
    from ..generate import stream_generate

    rank = world().rank()

    def say(*a, **kw):
        if rank == 0:
            print(*a, **kw, flush=True)

    kv_config(args)
    source = model_source(args)
    cfg = kv_setting(args, source)  # from config.json: the same on every rank
    for flag in ("draft_model", "adapter_path"):
        if getattr(args, flag):
            raise ValueError(
                f"--{flag.replace('_', '-')} is not supported under mlx.launch (as in mlx-lm)"
            )
    if args.prompt_cache_file:
        raise ValueError("--prompt-cache-file is not supported under mlx.launch")
    layout = check_sharding_early(source.location, args.pipeline, rank)
    refuse_early(source, cfg)  # the same on every rank

    hb = Heartbeat.start()
    hb.on_group_failed = lambda reason: abort_on_loss(RankLoss(0, reason, reported=True))
    try:
        model, tokenizer, _, shard = load_sharded(
            source.location, pipeline=args.pipeline, layout=layout
        )
    except Exception as e:
        hb.report_fatal(f"rank {rank}: loading failed: {type(e).__name__}: {e}")
        hb.stopping()
        raise ValueError(
            f"rank {rank}: could not load {source.location}: {type(e).__name__}: {e}"
        ) from e
    sync_seed(args.seed)

    if cfg.enabled:
        try:
            plan, infos = plan_on_every_rank(model, cfg, shard)
        except UnsupportedKVConfig as e:
            hb.stopping()  # every rank stops here, each saying which rank failed
            raise UnsupportedKVConfig(f"rank {rank}: {e}") from None
        if args.verbose:
            say(f"rank 0: {plan.table()}")
        say(ranks_table(infos))
        cache = plan.make_cache()
    else:
        infos = gather_json({"ok": True, "rank": rank, "mode": shard.mode, "layers": shard.layers})
        say("KV cache: unquantized")
        cache = mlx_cache.make_prompt_cache(model, cfg.max_kv_size)
    say("=" * 10)

    tokens = prompt_tokens(tokenizer, args)
    response = None
    for response in stream_generate(model, tokenizer, tokens, max_tokens=args.max_tokens,
                                    sampler=make_sampler(args.temp, args.top_p),
                                    prompt_cache=cache):  # fmt: skip
        say(response.text, end="")
    say()
    say("=" * 10)
    held = gather_kv_bytes(cache)
    hb.stopping()
    gather_json(0)  # barrier: nobody closes the heartbeat channel before everyone is done
    hb.close()
    if response is None:
        say("No text generated for this prompt")
        return 0
    say(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
    say(
        f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec"
    )
    say(f"Peak memory (rank 0): {response.peak_memory:.3f} GB")
    say(f"KV bytes held: {sum(held)} ({sum(held) / 2**20:.2f} MiB) across {len(held)} ranks")
    for r, (b, info) in enumerate(zip(held, infos, strict=True)):
        say(f"  rank {r} ({shard.mode} parallel, layers {info.get('layers')}): KV bytes held: {b}")
    sys.stdout.flush()
    return 0

"""`mlx-kvq generate` under `mlx.launch`: every rank generates, rank 0 prints.

Every rank loads its shard (mlx-lm's `sharded_load`), plans and validates its
own quantized caches, agrees on the plan with the group, then runs the same
generation loop (the collectives inside the model keep the ranks in step).
Rank 0 prints the text, the plan with one line per rank, and the KV bytes
each rank holds.
"""

from __future__ import annotations

import argparse
import sys


def cli_generate(args: argparse.Namespace) -> int:
    from mlx_lm.models import cache as mlx_cache
    from mlx_lm.sample_utils import make_sampler

    from ..cli import _fail, _model_path, kv_config_from_args
    from ..config import UnsupportedKVConfig
    from ..generate import stream_generate
    from ..plan import plan_kv
    from .group import gather_json, world
    from .heartbeat import Heartbeat
    from .loading import load_sharded, sync_seed
    from .planning import check_sharding, gather_kv_bytes, plan_on_every_rank, ranks_table

    g = world()
    rank = g.rank()

    def say(*a, **kw):
        if rank == 0:
            print(*a, **kw, flush=True)

    cfg = kv_config_from_args(args)
    path = _model_path(args)
    if args.draft_model:
        return _fail("--draft-model is not supported under mlx.launch (as in mlx-lm)")
    if args.prompt_cache_file:
        return _fail("--prompt-cache-file is not supported under mlx.launch")
    try:  # before any weight is read, the same on every rank
        layout = check_sharding(path, args.pipeline)
    except UnsupportedKVConfig as e:
        return _fail(f"rank {rank}: {e}")
    except Exception as e:  # no config to read: say so, as loading would
        return _fail(f"rank {rank}: could not read the config of {path}: {type(e).__name__}: {e}")
    if cfg.enabled and (path / "config.json").exists():
        plan_kv(path, cfg)  # refuse bad settings before loading weights (same on every rank)

    hb = Heartbeat.start()
    hb.on_group_failed = lambda reason: hb._on_lost(0, reason)
    try:
        model, tokenizer, _, shard = load_sharded(str(path), pipeline=args.pipeline, layout=layout)
    except Exception as e:
        hb.report_fatal(f"rank {rank}: loading failed: {type(e).__name__}: {e}")
        hb.stopping()
        return _fail(f"rank {rank}: could not load {path}: {type(e).__name__}: {e}")
    sync_seed(args.seed)

    if cfg.enabled:
        try:
            plan, infos = plan_on_every_rank(model, cfg, shard)
        except UnsupportedKVConfig as e:
            hb.stopping()  # every rank stops here, each saying which rank failed
            return _fail(f"rank {rank}: {e}")
    else:
        plan = None
        infos = gather_json({"ok": True, "rank": rank, "mode": shard.mode, "layers": shard.layers})

    if plan is not None:
        if args.verbose:
            say(f"rank 0: {plan.table()}")
        say(ranks_table(infos))
    else:
        say("KV cache: unquantized")
    say("=" * 10)

    prompt = args.prompt.replace("\\n", "\n")
    if not args.ignore_chat_template and tokenizer.chat_template is not None:
        messages = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tokens = tokenizer.encode(prompt, add_special_tokens=True)

    cache = (
        plan.make_cache()
        if plan is not None
        else mlx_cache.make_prompt_cache(model, cfg.max_kv_size)
    )
    sampler = make_sampler(args.temp, args.top_p)
    response = None
    for response in stream_generate(
        model, tokenizer, tokens, max_tokens=args.max_tokens, sampler=sampler, prompt_cache=cache
    ):
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

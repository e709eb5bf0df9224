"""`mlx-kvq serve` under `mlx.launch`: rank 0 serves HTTP, every rank decodes.

Startup, on every rank: heartbeat channel, sharded load, plan and batch-path
checks on this rank's caches, then one status exchange: any rank that cannot
honour the plan stops the whole group (exit 2, the failing rank named in
every rank's message). Rank 0 then opens the port with `/health` at 503
until the warm-up passed on every rank; the other ranks run the same engine
without HTTP, driven by rank 0's per-step commands, until rank 0 stops.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from .group import world

log = logging.getLogger("mlx_kvq.distributed")

DEFAULT_STEP_TIMEOUT_S = 300.0


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags that only matter under `mlx.launch` (harmless otherwise)."""
    g = parser.add_argument_group("distributed (under mlx.launch)")
    g.add_argument(
        "--pipeline",
        action="store_true",
        help="pipeline parallel (layers split over ranks) instead of tensor parallel "
        "(heads split over ranks), as in mlx-lm",
    )
    g.add_argument("--distributed-step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S,
                   help="fail the group when one engine step (a prefill chunk or a decode step on "
                   f"every rank) takes longer than this many seconds (default {DEFAULT_STEP_TIMEOUT_S:g})")  # fmt: skip


def serve(args: argparse.Namespace) -> int:
    """Run one rank of the group; see the module docstring."""
    g = world()
    rank = g.rank()
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    from ..caches import cache_report
    from ..cli import kv_config_from_args
    from ..config import UnsupportedKVConfig
    from ..engine import check_batch_path
    from ..engine.warmup import warmup_spec
    from ..server import main as server_main
    from ..server.main import API_KEY_ENV, _check_numbers, _fail, _resolve_model, _settings
    from .engine import DistributedEngine
    from .group import gather_json
    from .heartbeat import Heartbeat
    from .loading import load_sharded, sync_seed
    from .planning import check_sharding, group_plan_dict, plan_on_every_rank, ranks_table

    def fail(message: str) -> int:
        return _fail(f"rank {rank}: {message}")

    try:
        kv_config = kv_config_from_args(args)
        _check_numbers(args)
        source, model_id = _resolve_model(args)
        if args.pipeline and args.prompt_cache_bytes is not None:
            raise ValueError(
                "--prompt-cache-bytes is not supported with --pipeline: ranks hold different "
                "bytes, so byte-based eviction would diverge between them; use --prompt-cache-size"
            )
    except (ValueError, FileNotFoundError) as e:
        return fail(str(e))
    try:  # before any weight is read, the same on every rank
        layout = check_sharding(source, args.pipeline)
    except UnsupportedKVConfig as e:
        return fail(str(e))
    except Exception as e:  # no config to read: say so, as loading would
        return fail(f"could not read the config of {source}: {type(e).__name__}: {e}")

    hb = Heartbeat.start()
    hb.on_group_failed = lambda reason: hb._on_lost(0, reason)  # startup: leave with rank 0
    tokenizer_config = {"trust_remote_code": bool(args.trust_remote_code)}
    if args.chat_template:
        tokenizer_config["chat_template"] = args.chat_template
    try:
        model, tokenizer, _, shard = load_sharded(
            source, args.pipeline, tokenizer_config=tokenizer_config,
            trust_remote_code=args.trust_remote_code, layout=layout,
        )  # fmt: skip
    except Exception as e:
        hb.report_fatal(f"rank {rank}: could not load the model: {type(e).__name__}: {e}")
        return fail(f"could not load the model from {source}: {type(e).__name__}: {e}")
    sync_seed()

    def checks(plan) -> None:
        check_batch_path(plan.make_cache, cache_report, kv_config, plan.max_batch)
        warmup_spec(plan.max_window, kv_config, plan.max_context)

    try:
        plan, infos = plan_on_every_rank(model, kv_config, shard, batch=True, checks=checks)
        if args.prompt_cache_bytes is not None and len({i["bytes_per_token"] for i in infos}) > 1:
            raise UnsupportedKVConfig(
                "--prompt-cache-bytes needs the same KV bytes per token on every rank "
                f"(got {[i['bytes_per_token'] for i in infos]}); use --prompt-cache-size"
            )
    except UnsupportedKVConfig as e:
        hb.stopping()
        return fail(f"KV setting refused for {model_id}: {e}")
    plans = gather_json(plan.to_dict())
    group_plan = group_plan_dict(plans, infos)
    if rank == 0:
        log.info("KV plan for %s (this rank):\n%s\n%s", model_id, plan.table(), ranks_table(infos))

    # tests: "{rank}" in the gate path holds back one rank's warm-up
    gate = args.warmup_gate.replace("{rank}", str(rank)) if args.warmup_gate else None
    options = server_main.engine_options(args, plan.max_context, gate, plan.max_batch)
    engine = DistributedEngine(
        model, tokenizer, plan, kv_config, options, heartbeat=hb, rank_infos=infos, shard=shard,
        step_timeout=args.distributed_step_timeout,
    )  # fmt: skip
    hb.on_group_failed = lambda reason: log.error("rank 0 reports: %s", reason)
    if rank == 0:
        from ..server.main import _run

        api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
        settings = _settings(args, model_id, plan, api_key)
        settings.plan = group_plan
        rc = _run(engine, settings, args.host, args.port, args.log_level)
        _leave(hb, rc)
    engine.start()
    while engine.alive:
        engine._thread.join(0.5)
    if engine._stopped_normally:
        _leave(hb, 0)
    # This rank failed (rank 0 was told why) or the group did: stay until rank 0 goes,
    # so that rank 0 keeps answering 503 with the reason; the heartbeat exits us then.
    log.error("rank %d: engine stopped: %s", rank, engine.readiness.get().reason)
    threading.Event().wait()
    return 1


def _leave(hb, rc: int) -> None:
    """Exit now: an engine thread stuck in a collective must not hold the process."""
    hb.stopping()
    hb.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)

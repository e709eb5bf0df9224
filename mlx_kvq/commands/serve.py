"""`mlx-kvq serve`: an OpenAI-compatible server on quantized, batched KV caches.

Startup order matters: settings are checked, the model is loaded, the
per-layer KV plan is built and validated, and the batch path is checked,
all before the port opens, so an unsupported setting exits with status 2
and the plan's message. The port then opens with `/health` at 503 while the
engine warms up (see `http_process`).

Under `mlx.launch` (`run_ranks`) every rank does the same on its shard, and
one status exchange stops the whole group (exit 2, naming the failing rank)
if any rank cannot honour the plan. Rank 0 then serves HTTP; the other ranks
run the same engine without HTTP, driven by rank 0's per-step commands.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from ..config import PAGED_BLOCK_SIZE
from .flags import (
    add_adapter_flag,
    add_draft_flags,
    add_http_flags,
    add_kv_flags,
    add_model_flag,
    add_sampling_flags,
    check_draft_tokens,
    check_sampling,
    json_object,
    kv_config,
    parse_size,
)
from .http_process import DEFAULT_SHUTDOWN_TIMEOUT_S, serve_http
from .startup import (
    ModelSource,
    check_sharding_early,
    kv_setting,
    load_model,
    model_directory,
    model_source,
    tokenizer_config,
    use_default_chat_template,
)

log = logging.getLogger("mlx_kvq.server")

API_KEY_ENV = "MLX_KVQ_API_KEY"
DEFAULT_STEP_TIMEOUT_S = 300.0
DEFAULT_MAX_QUEUED = 256
USEFUL_PROMPT = 256  # the shortest prompt a budget must hold alone for the server to start


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The `serve` flags: mlx_lm.server's names and meanings, plus ours."""
    p = sub.add_parser("serve", help="OpenAI-compatible server")
    add_model_flag(p)
    add_adapter_flag(p)
    add_draft_flags(p)
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model id listed by /v1/models (default: the --model value)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    p.add_argument(
        "--trust-remote-code", action="store_true", help="allow the tokenizer's custom code"
    )
    p.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    )
    p.add_argument("--chat-template", default="", help="override the tokenizer's chat template")
    p.add_argument(
        "--use-default-chat-template",
        action="store_true",
        help="when the tokenizer has no chat template, use its default one (as mlx_lm.server; "
        "exit 2 when it has none)",
    )
    p.add_argument(
        "--chat-template-args",
        type=json_object,
        default={},
        help="JSON object of apply_chat_template arguments, e.g. '{\"enable_thinking\":false}'",
    )
    add_sampling_flags(p, max_tokens=512)
    add_http_flags(p)
    p.add_argument(
        "--decode-concurrency",
        type=int,
        default=32,
        help="sequences decoded together in one batch (default: 32)",
    )
    p.add_argument(
        "--prompt-concurrency", type=int, default=8, help="prompts processed together (default: 8)"
    )
    p.add_argument(
        "--prefill-step-size",
        type=int,
        default=2048,
        help="prompt tokens per prefill step (default: 2048)",
    )
    p.add_argument(
        "--prompt-cache-size",
        type=int,
        default=10,
        help="maximum entries in the prompt cache (default: 10; 0 disables it)",
    )
    p.add_argument(
        "--prompt-cache-bytes",
        type=parse_size,
        default=None,
        help="maximum bytes of KV held by the prompt cache, e.g. 2GB; while "
        "requests run, their KV bytes count against it too (as in mlx-lm)",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        help="KV memory budget: live sequences and the prompt cache together, e.g. 2GiB; "
        "a request is admitted when its prompt fits beside what running sequences hold "
        "(default: derived "
        "from the machine, less the weights, and printed at startup)",
    )
    p.add_argument(
        "--kv-block-size",
        type=int,
        default=PAGED_BLOCK_SIZE,
        help="tokens per block of the paged KV layout (full-attention and sliding-window "
        f"layers held in blocks, shared prompt prefixes held once; default {PAGED_BLOCK_SIZE}); "
        "0 keeps mlx-lm's left-padded rows",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=DEFAULT_MAX_QUEUED,
        help="requests that may wait for admission; more get 429 with Retry-After "
        f"(default: {DEFAULT_MAX_QUEUED})",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer <key>' or 'x-api-key: <key>' on the API routes "
        f"(or set {API_KEY_ENV})",
    )
    p.add_argument(
        "--max-request-bytes",
        type=parse_size,
        default=8 * 1024 * 1024,
        help="largest accepted request body (default: 8MiB); larger gets 413",
    )
    p.add_argument(
        "--response-store-bytes",
        type=parse_size,
        default=64 * 1024 * 1024,
        help="bytes of stored /v1/responses (store: true) kept for previous_response_id "
        "and GET /v1/responses/{id}, oldest dropped first (default: 64MiB)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish "
        f"before they are answered with an error (default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g})",
    )
    p.add_argument("--warmup-gate", default=None, help=argparse.SUPPRESS)
    add_kv_flags(p)
    g = p.add_argument_group("distributed (under mlx.launch)")
    g.add_argument(
        "--pipeline",
        action="store_true",
        help="pipeline parallel (layers split over ranks) instead of tensor parallel "
        "(heads split over ranks), as in mlx-lm",
    )
    g.add_argument(
        "--distributed-step-timeout",
        type=float,
        default=DEFAULT_STEP_TIMEOUT_S,
        help="fail the group when one engine step (a prefill chunk or a decode step on "
        f"every rank) takes longer than this many seconds (default {DEFAULT_STEP_TIMEOUT_S:g})",
    )
    p.set_defaults(run=run)  # fmt: skip


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse flag values no server could run with (exit 2 before loading)."""
    from ..server.schemas import check_template_kwargs

    check_sampling(args)
    check_draft_tokens(args)
    for name in ("decode_concurrency", "prompt_concurrency", "prefill_step_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.prompt_cache_size < 0:
        raise ValueError("--prompt-cache-size must be >= 0")
    if args.max_queued_requests < 1:
        raise ValueError("--max-queued-requests must be at least 1")
    if args.shutdown_timeout < 0:
        raise ValueError("--shutdown-timeout must be >= 0")
    if args.kv_block_size < 0:
        raise ValueError("--kv-block-size must be >= 0 (0: padded rows)")
    check_template_kwargs(args.chat_template_args, "--chat-template-args")
    check_api_key(args.api_key or os.environ.get(API_KEY_ENV) or None)


def check_api_key(key: str | None) -> None:
    """Refuse a key no client could send: HTTP header values are latin-1 text
    without control characters, and the server strips surrounding spaces."""
    if key is None:
        return
    where = f"--api-key (or {API_KEY_ENV})"
    try:
        key.encode("latin-1")
    except UnicodeEncodeError:
        raise ValueError(
            f"{where} holds characters outside latin-1, which an HTTP header cannot carry; "
            "use ASCII letters, digits and punctuation"
        ) from None
    if any(ord(c) < 32 or ord(c) == 127 for c in key) or key != key.strip():
        raise ValueError(f"{where} holds control characters or surrounding spaces")


def engine_options(
    args: argparse.Namespace,
    max_context: int | None,
    warmup_gate: str | None,
    max_batch: int | None = None,
    *,
    kv_cache_memory: int | None = None,
):
    """The engine's scheduling, prompt-cache and budget settings from the serve flags.

    `max_batch` is the plan's limit (deepseek_v41 runs one sequence at a
    time, as in mlx-lm's server): the concurrency flags are capped to it, and
    the log says so. `kv_cache_memory` is the KV budget in bytes (None: admit
    by count only)."""
    from ..engine import EngineOptions

    decode, prompt = args.decode_concurrency, args.prompt_concurrency
    if max_batch is not None and max(decode, prompt) > max_batch:
        log.warning(
            "this model runs %d sequence(s) at a time: --decode-concurrency %d and "
            "--prompt-concurrency %d are capped to %d (requests queue)",
            max_batch, decode, prompt, max_batch,
        )  # fmt: skip
        decode, prompt = min(decode, max_batch), min(prompt, max_batch)
    return EngineOptions(
        decode_concurrency=decode,
        prompt_concurrency=prompt,
        prefill_step_size=args.prefill_step_size,
        prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes,
        max_context=max_context,
        kv_cache_memory=kv_cache_memory,
        block_size=args.kv_block_size or None,
        max_queued_requests=args.max_queued_requests,
        warmup_gate=warmup_gate,
    )


def kv_cache_memory(args: argparse.Namespace, model, plan, draft_model=None) -> int:
    """The KV budget: `--kv-cache-memory`, or the machine's default (less the
    weights of the model and of `draft_model`), logged with how it was
    derived. Refused (exit 2) when it cannot hold one prompt of a useful size
    (`USEFUL_PROMPT` tokens, or the model's context when shorter) alone:
    `--max-tokens` reserves nothing, sequences take memory as they grow."""
    from ..engine.budget import (
        Ledger,
        Shape,
        default_budget,
        format_bytes,
        machine_memory,
        share_for,
        weights_bytes,
    )
    from ..engine.memory import DECODE_RESERVE

    if args.kv_cache_memory is not None:
        budget, how = args.kv_cache_memory, "--kv-cache-memory"
    else:
        weights = weights_bytes(model) + (0 if draft_model is None else weights_bytes(draft_model))
        budget, how = default_budget(weights, machine_memory())
        how = f"default: {how}; set --kv-cache-memory to change it"
    log.info("KV cache memory: %s (%s)", format_bytes(budget), how)
    share = share_for(
        plan, budget, prefill_step=args.prefill_step_size, prompt_rows=args.prompt_concurrency
    )
    prompt = USEFUL_PROMPT
    if plan.max_context is not None:
        prompt = max(1, min(prompt, plan.max_context - DECODE_RESERVE))
    verdict = Ledger([share]).verdict(Shape(prompt, prompt + DECODE_RESERVE))
    if not verdict.fits_alone:
        raise ValueError(
            f"the KV budget of {format_bytes(budget)} ({how}) cannot hold one prompt of "
            f"{prompt} tokens and a decode reserve of {DECODE_RESERVE}, which needs "
            f"{format_bytes(verdict.needs)}: raise --kv-cache-memory"
        )
    return budget


def server_settings(args: argparse.Namespace, source: ModelSource, plan: dict):
    """What the HTTP layer needs besides the engine."""
    from ..server.guard import GuardPolicy
    from ..server.settings import ServerSettings

    return ServerSettings(
        model_id=source.served_id,
        names_checked=args.served_model_name is not None,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_request_bytes=args.max_request_bytes,
        response_store_bytes=args.response_store_bytes,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        chat_template_args=dict(args.chat_template_args),
        adapter_path=source.adapter_path,
        draft_model=args.draft_model,
        num_draft_tokens=args.num_draft_tokens,
        max_context=plan.get("max_context"),
        plan=plan,
        guard=GuardPolicy.for_bind(args.host, args.allowed_hosts, args.allowed_origins),
        body_timeout=args.body_timeout,
        prompt_workers=args.prompt_workers,
    )


def connection_limits(args: argparse.Namespace):
    """The connection bounds of the HTTP flags."""
    from ..server.connections import ConnectionLimits

    return ConnectionLimits(
        header_timeout=args.header_timeout,
        max_connections=args.max_connections,
        keep_alive_timeout=args.keep_alive_timeout,
    )


class CurrentStderr(logging.StreamHandler):
    """Writes each record to `sys.stderr` as it is when the record is emitted
    (a handler bound to the stream of its creation keeps writing to it after
    it is replaced and closed, as a test's captured stream is)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def setup_logging(args: argparse.Namespace, rank: int | None = None) -> None:
    where = "" if rank is None else f"rank {rank} "
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format=f"%(asctime)s {where}%(levelname)s %(name)s: %(message)s",
        handlers=[CurrentStderr()],
        force=True,
    )


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; status 2 for settings refused at startup."""
    from ..distributed.group import launched

    if launched():
        return run_ranks(args)
    setup_logging(args)
    from ..config import UnsupportedKVConfig
    from ..engine import Engine, check_batch_path, warmup_spec
    from ..plan import plan_kv

    kv_config(args)  # a bad flag fails before the weights are read
    check_numbers(args)
    source = model_source(args)
    model, tokenizer = load_model(source, args)
    try:
        kv = kv_setting(args, source, model)
        plan = plan_kv(model, kv, batch=True)
        check_batch_path(plan.make_cache, kv, max_batch=plan.max_batch)
        warmup_spec(plan.max_window, kv, plan.max_context)
    except UnsupportedKVConfig as e:
        raise UnsupportedKVConfig(f"KV setting refused for {source.served_id}: {e}") from None
    log.info("KV plan for %s:\n%s", source.served_id, plan.table())
    draft = load_draft(args, model, tokenizer, plan, kv)
    budget = kv_cache_memory(args, model, plan, None if draft is None else draft.model)
    options = engine_options(
        args, plan.max_context, args.warmup_gate, plan.max_batch, kv_cache_memory=budget
    )
    engine = Engine(model, tokenizer, plan, kv, options, draft=draft)
    log.info("%s", engine.capacity.line)
    settings = server_settings(args, source, plan.to_dict())
    return serve_http(engine, settings, args.host, args.port, args.log_level,
                      args.shutdown_timeout, connection_limits(args))  # fmt: skip


def load_draft(args: argparse.Namespace, model, tokenizer, plan, kv):
    """The draft model of `--draft-model`, loaded and planned like the model
    (its KV caches quantized too), checked for speculative decoding; None
    without the flag. A draft model that cannot serve is refused here (exit 2)."""
    if not args.draft_model:
        return None
    from mlx_lm import load

    from ..config import UnsupportedKVConfig
    from ..engine import DraftModel
    from ..plan import plan_kv
    from ..speculative import check_speculation

    try:
        draft_model, draft_tokenizer = load(model_directory(args.draft_model, "--draft-model")[0])
    except Exception as e:  # noqa: BLE001 - any load failure is a bad --draft-model
        raise ValueError(
            f"could not load the draft model from {args.draft_model}: {type(e).__name__}: {e}"
        ) from e
    try:
        draft_plan = plan_kv(draft_model, kv)
        check_speculation(
            model, draft_model, plan.make_cache(), draft_plan.make_cache(),
            vocab=(tokenizer.vocab_size, draft_tokenizer.vocab_size),
        )  # fmt: skip
    except UnsupportedKVConfig as e:
        raise UnsupportedKVConfig(f"--draft-model {args.draft_model} refused: {e}") from None
    log.info("KV plan for the draft model %s:\n%s", args.draft_model, draft_plan.table())
    return DraftModel(draft_model, draft_plan, args.draft_model, args.num_draft_tokens)


def run_ranks(args: argparse.Namespace) -> int:
    """One rank of an `mlx.launch` group; see the module docstring."""
    from ..config import UnsupportedKVConfig
    from ..distributed.coordinator import GroupCoordinator
    from ..distributed.group import gather_json, world
    from ..distributed.heartbeat import Heartbeat, RankLoss, abort_on_loss
    from ..distributed.loading import load_sharded, sync_seed
    from ..distributed.planning import group_plan_dict, plan_on_every_rank, ranks_table
    from ..engine import Engine, check_batch_path, warmup_spec

    rank = world().rank()
    setup_logging(args, rank)
    try:
        kv_config(args)
        check_numbers(args)
        source = model_source(args)
        kv = kv_setting(args, source)  # from config.json: the same on every rank
        for flag in ("draft_model", "adapter_path"):
            if getattr(args, flag):
                raise ValueError(
                    f"--{flag.replace('_', '-')} is not supported under mlx.launch (as in mlx-lm)"
                )
        if args.pipeline and args.prompt_cache_bytes is not None:
            raise ValueError(
                "--prompt-cache-bytes is not supported with --pipeline: ranks hold different "
                "bytes, so byte-based eviction would diverge between them; use --prompt-cache-size"
            )
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(f"rank {rank}: {e}") from None
    layout = check_sharding_early(source.location, args.pipeline, rank)

    hb = Heartbeat.start()
    hb.on_group_failed = lambda reason: abort_on_loss(RankLoss(0, reason, reported=True))
    try:
        model, tokenizer, _, shard = load_sharded(
            source.location, args.pipeline, tokenizer_config=tokenizer_config(args),
            trust_remote_code=args.trust_remote_code, layout=layout,
        )  # fmt: skip
    except Exception as e:
        hb.report_fatal(f"rank {rank}: could not load the model: {type(e).__name__}: {e}")
        raise ValueError(
            f"rank {rank}: could not load the model from {source.location}: {type(e).__name__}: {e}"
        ) from e
    if args.use_default_chat_template:
        use_default_chat_template(tokenizer)
    sync_seed()

    def checks(plan) -> None:
        check_batch_path(plan.make_cache, kv, max_batch=plan.max_batch)
        warmup_spec(plan.max_window, kv, plan.max_context)

    try:
        plan, infos = plan_on_every_rank(model, kv, shard, batch=True, checks=checks)
        if args.prompt_cache_bytes is not None and len({i["bytes_per_token"] for i in infos}) > 1:
            raise UnsupportedKVConfig(
                "--prompt-cache-bytes needs the same KV bytes per token on every rank "
                f"(got {[i['bytes_per_token'] for i in infos]}); use --prompt-cache-size"
            )
    except UnsupportedKVConfig as e:
        hb.stopping()
        raise UnsupportedKVConfig(
            f"rank {rank}: KV setting refused for {source.served_id}: {e}"
        ) from None
    group_plan = group_plan_dict(gather_json(plan.to_dict()), infos)
    if rank == 0:
        log.info(
            "KV plan for %s (this rank):\n%s\n%s",
            source.served_id,
            plan.table(),
            ranks_table(infos),
        )

    # tests: "{rank}" in the gate path holds back one rank's warm-up
    gate = args.warmup_gate.replace("{rank}", str(rank)) if args.warmup_gate else None
    try:
        budget = kv_cache_memory(args, model, plan)  # this rank's share
    except ValueError as e:
        hb.stopping()
        raise ValueError(f"rank {rank}: {e}") from None
    coordinator = GroupCoordinator(hb, infos, step_timeout=args.distributed_step_timeout)
    options = engine_options(args, plan.max_context, gate, plan.max_batch, kv_cache_memory=budget)
    engine = Engine(model, tokenizer, plan, kv, options, coordinator=coordinator)
    coordinator.bind(engine)
    hb.on_group_failed = lambda reason: log.error("rank 0 reports: %s", reason)
    if rank == 0:
        settings = server_settings(args, source, group_plan)
        rc = serve_http(engine, settings, args.host, args.port, args.log_level,
                        args.shutdown_timeout, connection_limits(args))  # fmt: skip
        leave(hb, rc)
    engine.start()
    engine.join()
    if coordinator.stopped_normally:
        leave(hb, 0)
    # This rank failed (rank 0 was told why) or the group did: stay until rank 0 goes,
    # so that rank 0 keeps answering 503 with the reason; the heartbeat exits us then.
    log.error("rank %d: engine stopped: %s", rank, engine.readiness.get().reason)
    threading.Event().wait()
    return 1


def leave(hb, rc: int) -> None:
    """Exit now: an engine thread stuck in a collective must not hold the process."""
    hb.stopping()
    hb.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)

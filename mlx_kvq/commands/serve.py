"""`mlx-kvq serve`: an OpenAI-compatible server on quantized, batched KV caches.

Startup order matters: settings are checked, the model is loaded, the
per-layer KV plan is built and validated, and the batch path is checked,
all before the port opens, so an unsupported setting exits with status 2
and the plan's message. The engine then starts its warm-up, and the HTTP
side (imported only now) is built and opens the port beside it, `/health`
at 503 until the warm-up is done (see `http_process`).

Under `mlx.launch` every rank takes the same steps on its shard
(`startup.Launch`), and one status exchange stops the whole group (exit 2,
naming the failing rank) if any rank cannot honour the plan. Rank 0 then
serves HTTP; the other ranks run the same engine without HTTP, driven by
rank 0's per-step commands.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import AUTO_BLOCK_SIZE, UnsupportedKVConfig
from ..residency import Footprint, Loaded, ModelEntry, ModelPool
from .flags import (
    API_KEY_ENV,
    add_serve_flags,
    check_draft_tokens,
    kv_config,
    sampling_defaults,
)
from .serve_models import declared_models, model_base, undeclared
from .startup import (
    Launch,
    ModelSource,
    fetched,
    kv_setting,
    load_tokenizer,
    load_weights,
    model_directory,
    model_source,
    prepare_compute,
    refuse_early,
)

log = logging.getLogger("mlx_kvq.server")

USEFUL_PROMPT = 256  # the shortest prompt a budget must hold alone for the server to start


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server")
    add_serve_flags(p)
    p.set_defaults(run=run)


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse flag values no server could run with (exit 2 before loading)."""
    from ..server.chat.template_args import check_template_kwargs

    sampling_defaults(args)
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
    if args.kv_block_size is not None and args.kv_block_size < 0:
        raise ValueError("--kv-block-size must be >= 0 (0: padded rows)")
    check_template_kwargs(args.chat_template_args, "--chat-template-args")
    check_api_key(args.api_key or os.environ.get(API_KEY_ENV) or None)
    check_prompt_cache_dir(args)


def check_prompt_cache_dir(args: argparse.Namespace) -> None:
    """Refuse a disk tier that cannot work: a cap without a directory, no
    prompt cache to read into, a directory that cannot be created or written."""
    if args.prompt_cache_dir is None:
        if args.prompt_cache_disk_bytes is not None:
            raise ValueError("--prompt-cache-disk-bytes needs --prompt-cache-dir")
        return
    if args.prompt_cache_disk_bytes is not None and args.prompt_cache_disk_bytes < 1:
        raise ValueError("--prompt-cache-disk-bytes must be at least 1 byte")
    if args.prompt_cache_size == 0:
        raise ValueError(
            "--prompt-cache-dir needs the prompt cache: entries are read back into it "
            "(--prompt-cache-size 0 turns it off)"
        )
    path = Path(args.prompt_cache_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--prompt-cache-dir {path} cannot be used: {e}") from None


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
    from ..engine.disk import DEFAULT_DISK_BYTES, DiskSettings

    disk = None
    if args.prompt_cache_dir is not None:
        disk = DiskSettings(
            args.prompt_cache_dir, args.prompt_cache_disk_bytes or DEFAULT_DISK_BYTES,
            args.prompt_cache_write_gate,
        )  # fmt: skip
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
        block_size=block_size_option(args),
        max_queued_requests=args.max_queued_requests,
        warmup_gate=warmup_gate,
        disk=disk,
    )


def block_size_option(args: argparse.Namespace) -> int | str | None:
    """`--kv-block-size` as the engine takes it: the plan's own (left out),
    padded rows (0), or that many tokens."""
    size = getattr(args, "kv_block_size", None)
    return AUTO_BLOCK_SIZE if size is None else size or None


@dataclass(frozen=True)
class ModelsMemory:
    """The memory budget the weights and KV budgets of every resident model
    share (`--models-memory`, or the machine's share), and how many models
    were declared: a model's default KV budget is an equal share of it less
    its weights."""

    budget: int
    how: str
    shares: int = 1

    def kv_default(self, weights: int) -> tuple[int, str]:
        """A model's KV budget without --kv-cache-memory, and how it was derived."""
        from ..engine.budget import format_bytes

        part = f"1/{self.shares} of " if self.shares > 1 else ""
        how = (
            f"default: {part}the models' memory budget of {format_bytes(self.budget)} "
            f"({self.how}) less the weights ({format_bytes(weights)}); set --kv-cache-memory "
            "to change it"
        )
        return max(0, self.budget // self.shares - weights), how


def models_memory(args: argparse.Namespace, declared: int) -> ModelsMemory | None:
    """The models' memory budget; None for one declared model without
    --models-memory (its KV budget is derived from the machine as ever, and
    the budget from it: `pool_memory`)."""
    if args.models_memory is not None:
        return ModelsMemory(args.models_memory, "--models-memory", declared)
    if declared == 1:
        return None
    return ModelsMemory(*machine_share(), declared)


def machine_share() -> tuple[int, str]:
    """What the machine gives the models by default (the default KV budget of a
    model without weights), and how it was derived."""
    from ..engine.budget import default_budget, machine_memory

    budget, how = default_budget(0, machine_memory())
    return budget, f"the machine's default: {how}"


def kv_cache_memory(
    args: argparse.Namespace, model, plan, draft_model=None, memory: ModelsMemory | None = None
) -> int:
    """The KV budget: `--kv-cache-memory`, or the default (less the weights
    of the model and of `draft_model`): the machine's, or a share of the
    models' memory budget `memory`, logged with how it was derived. Refused
    (exit 2) when it cannot hold one prompt of a useful size (`check_kv_budget`)."""
    from ..engine.budget import default_budget, format_bytes, machine_memory, weights_bytes

    if args.kv_cache_memory is not None:
        budget, how = args.kv_cache_memory, "--kv-cache-memory"
    else:
        weights = weights_bytes(model) + (0 if draft_model is None else weights_bytes(draft_model))
        if memory is None:
            budget, how = default_budget(weights, machine_memory())
            how = f"default: {how}; set --kv-cache-memory to change it"
        else:
            budget, how = memory.kv_default(weights)
    log.info("KV cache memory: %s (%s)", format_bytes(budget), how)
    check_kv_budget(args, plan, budget, how)
    return budget


def check_kv_budget(args: argparse.Namespace, plan, budget: int, how: str) -> None:
    """Refuse a KV budget that cannot hold one prompt of a useful size
    (`USEFUL_PROMPT` tokens, or the model's context when shorter) alone:
    `--max-tokens` reserves nothing, sequences take memory as they grow."""
    from ..engine.budget import Ledger, Shape, format_bytes, share_for
    from ..engine.memory import DECODE_RESERVE
    from ..engine.runner import choose_layout

    # priced in the layout the engine will hold it in (paged where the plan pages)
    on_disk = getattr(args, "prompt_cache_dir", None) is not None
    layout = choose_layout(plan, block_size_option(args), on_disk=on_disk)
    share = share_for(
        plan, budget, prefill_step=args.prefill_step_size, prompt_rows=args.prompt_concurrency,
        paged=layout.paged, block_size=layout.block_size or 0,
    )  # fmt: skip
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


def server_settings(
    args: argparse.Namespace, source: ModelSource, plan: dict, names_checked: bool | None = None
):
    """What the HTTP layer needs besides the engine (`names_checked`: whether
    every API checks `model`; default: whether --served-model-name was given)."""
    from ..server.guards.policy import GuardPolicy
    from ..server.settings import ServerSettings, ToolFormat

    if names_checked is None:
        names_checked = args.served_model_name is not None
    return ServerSettings(
        model_id=source.served_id,
        names_checked=names_checked,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_request_bytes=args.max_request_bytes,
        response_store_bytes=args.response_store_bytes,
        sampling=sampling_defaults(args),
        chat_template_args=dict(args.chat_template_args),
        tool_format=ToolFormat(args.tool_format),
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
    from ..server.guards.connections import ConnectionLimits

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
    """Serve until interrupted, in one process or on every rank of an
    `mlx.launch` group (rank 0 serves HTTP); status 2 for settings refused at
    startup. The default model loads here; the others declared are checked
    here and load on their first request (pinned ones once the port opens)."""
    from ..engine import SHUTTING_DOWN, Engine, check_batch_path, held_exact, warmup_spec
    from ..engine.budget import weights_bytes

    launch = Launch.current()
    setup_logging(args, launch.rank)
    with launch.refusing():
        kv_config(args)  # a bad flag fails before the weights are read
        check_numbers(args)
        margs, first, others = declared_models(args)  # margs: the default model's flags
        if launch.grouped and (others or args.models_file):
            raise ValueError(
                "several models (--model repeated, --models-file) are not supported under "
                "mlx.launch: a group serves one model"
            )
        for entry in others:
            check_declared(entry)
        if margs is not args:
            kv_config(margs)
            check_numbers(margs)
        source = model_source(margs)
        if first is not None:
            source = replace(source, served_id=first.name)
        check_names(source.served_id, first.aliases if first else (), others)
        launch.refuse_in_group(args, "draft_model", "adapter_path")
        if launch.grouped and args.prompt_cache_dir:
            raise ValueError(
                "--prompt-cache-dir is not supported under mlx.launch: the ranks' prompt "
                "caches must hold the same entries, and each rank would read its own files"
            )
        if launch.grouped and args.pipeline and args.prompt_cache_bytes is not None:
            raise ValueError(
                "--prompt-cache-bytes is not supported with --pipeline: ranks hold different "
                "bytes, so byte-based eviction would diverge between them; use --prompt-cache-size"
            )
        refuse_early(source, launch.kv_setting(margs, source))
        memory = models_memory(args, 1 + len(others))
    if launch.grouped or margs.draft_model or source.local_config is None:
        model, tokenizer = launch.load(source, margs)  # a draft model is checked against it
    else:  # a model on disk: its tokenizer loads while the engine warms up
        model, tokenizer = load_weights(source, margs), None

    def checks(plan) -> None:
        check_batch_path(plan.make_cache, kv, max_batch=plan.max_batch)
        warmup_spec(plan.max_window, kv, plan.max_context, held_exact(plan, None))

    with launch.refusing(f"KV setting refused for {source.served_id}: "):
        kv = launch.kv_setting(margs, source, model)
        plan, infos = launch.plan(model, kv, batch=True, checks=checks)
        per_token = {i["bytes_per_token"] for i in infos or ()}
        if margs.prompt_cache_bytes is not None and len(per_token) > 1:
            raise UnsupportedKVConfig(
                "--prompt-cache-bytes needs the same KV bytes per token on every rank "
                f"(got {[i['bytes_per_token'] for i in infos]}); use --prompt-cache-size"
            )
    plan_dict = launch.plan_dict(plan, infos)
    if launch.leader:
        log.info("KV plan for %s:\n%s", source.served_id, launch.plan_text(plan, infos, True))
    draft = load_draft(margs, model, tokenizer, plan, kv)
    with launch.refusing():
        budget = kv_cache_memory(margs, model, plan, None if draft is None else draft.model, memory)
        weights = weights_bytes(model) + (0 if draft is None else weights_bytes(draft.model))
        footprint = Footprint(weights, budget)
        memory = pool_memory(memory, footprint, source.served_id)
        settings = server_settings(margs, source, plan_dict, args.served_model_name is not None)
    # tests: "{rank}" in the gate path holds back one rank's warm-up, "{model}" one model's
    gate = warmup_gate(margs.warmup_gate, source.served_id, launch.rank)
    options = engine_options(margs, plan.max_context, gate, plan.max_batch, kv_cache_memory=budget)
    coordinator = launch.coordinator(infos, args.distributed_step_timeout)
    with launch.refusing():  # e.g. a block size the disk tier cannot keep
        engine = Engine(model, tokenizer, plan, kv, options, draft=draft, coordinator=coordinator)
    launch.bind(engine, coordinator)
    if not launch.leader:
        return launch.follow(engine, coordinator)
    log.info("%s", engine.capacity.line)
    engine.start()  # it warms up while the tokenizer loads and the HTTP side is built
    try:
        if tokenizer is None:
            engine.attach(load_tokenizer(source, margs))
            log.debug("tokenizer loaded, the engine has it")
    except BaseException:
        engine.stop(timeout=None)  # the warm-up runs to its end: MLX aborts an exit mid-evaluation
        raise
    pool: ModelPool | None = None
    try:
        from .http_process import serve_http

        entry = ModelEntry(
            source.served_id, margs.model or source.location,
            first.aliases if first else (), bool(first and first.pinned), options=margs,
        )  # fmt: skip
        pool = models_pool(args, memory, entry, others, Loaded(engine, settings), footprint,
                           launch.grouped)  # fmt: skip
        rc = serve_http(pool, settings, args.host, args.port, args.log_level,
                        args.shutdown_timeout, connection_limits(args))  # fmt: skip
    finally:
        if pool is not None:
            pool.close(SHUTTING_DOWN)
            pool.stop()
        engine.stop()
    return launch.leave(rc)


def check_declared(entry: ModelEntry) -> None:
    """Refuse at startup what a declared model's flags or config.json cannot
    honour, and a place no model can be loaded from."""
    from ..demo import resolve_model

    args = entry.options
    try:
        kv_config(args)
        check_numbers(args)
        if not undeclared(entry.location, hub=True):
            raise FileNotFoundError(
                f"no model directory (with config.json), GGUF file or repo id at {entry.location}"
            )
        location = resolve_model(entry.location)[0]
        if Path(location).is_dir():
            source = ModelSource(location, entry.name)
            refuse_early(source, kv_setting(args, source))
    except (ValueError, FileNotFoundError) as e:
        kind = type(e) if isinstance(e, UnsupportedKVConfig | FileNotFoundError) else ValueError
        raise kind(f"model '{entry.name}': {e}") from None


def check_names(default: str, aliases: tuple[str, ...], others: list[ModelEntry]) -> None:
    """Refuse two models going by one name (ValueError naming it)."""
    scratch = ModelPool(0)
    scratch.declare(ModelEntry(default, default, aliases))
    for entry in others:
        scratch.declare(replace(entry, location=entry.name))


def pool_memory(memory: ModelsMemory | None, first: Footprint, name: str) -> ModelsMemory:
    """The models' memory budget once the default model is priced: with one
    model and no --models-memory, the machine's share or what that model holds
    when more (so that it runs as a single-model server would); refused when
    the default model alone does not fit."""
    from ..engine.budget import format_bytes

    if memory is None:
        try:
            share, how = machine_share()
        except ValueError:  # the machine's memory is unknown: --kv-cache-memory was given
            share, how = 0, "the machine's memory is unknown"
        if first.total > share:
            share, how = first.total, f"what '{name}' holds"
        return ModelsMemory(share, how)
    if first.total > memory.budget:
        raise ValueError(
            f"the default model '{name}' holds {first.describe()}, more than the models' "
            f"memory budget of {format_bytes(memory.budget)} ({memory.how}): raise "
            "--models-memory or lower --kv-cache-memory"
        )
    return memory


def models_pool(
    args: argparse.Namespace,
    memory: ModelsMemory,
    default: ModelEntry,
    others: list[ModelEntry],
    loaded: Loaded,
    footprint: Footprint,
    grouped: bool,
) -> ModelPool:
    """The server's models: the default one resident, the other declared ones
    loaded on request (pinned ones start loading now), and, unless
    --declared-models-only, any model a request names (none in a group)."""
    from ..engine.budget import format_bytes

    loader = None
    if not grouped:
        loader = ServeLoader(args, memory, args.declared_models_only)
    pool = ModelPool(memory.budget, loader, wait_s=args.model_wait)
    pool.declare(default)
    for entry in others:
        pool.declare(entry)
    pool.adopt(default.name, loaded, footprint)
    if others or args.models_memory is not None:
        log.info(
            "models: %s; memory budget %s (%s) for their weights and KV budgets",
            ", ".join(pool.names()), format_bytes(memory.budget), memory.how,
        )  # fmt: skip
    for entry in others:
        if entry.pinned:
            pool.preload(entry.name)
    return pool


def warmup_gate(gate: str | None, model: str, rank: int | None) -> str | None:
    """The warm-up gate file of one model (tests: "{rank}" and "{model}" in
    the path name the rank, and the model with its non-alphanumerics as "_")."""
    if not gate:
        return None
    return gate.replace("{rank}", str(rank)).replace("{model}", re.sub(r"\W", "_", model))


class ServeLoader:
    """How `serve` loads a model on request (`residency.Loader`): the steps its
    default model takes at startup (`run`), each refusal a ValueError naming
    what cannot be honoured."""

    def __init__(self, args: argparse.Namespace, memory: ModelsMemory, declared_only: bool):
        self.base = model_base(args)
        self.memory = memory
        self.declared_only = declared_only
        self.names_checked = args.served_model_name is not None

    def named(self, name: str, hub: bool) -> ModelEntry | None:
        if self.declared_only or not undeclared(name, hub):
            return None
        options = argparse.Namespace(**{**vars(self.base), "model": name})
        return ModelEntry(name, name, declared=False, options=options)

    def prepare(self, entry: ModelEntry) -> PreparedModel:
        """Priced from its shapes: the weights are not read yet (`load_weights` lazy)."""
        from ..engine.budget import format_bytes, weights_bytes

        args = entry.options
        source = fetched(replace(model_source(args), served_id=entry.name))
        refuse_early(source, kv_setting(args, source))
        model = load_weights(source, args, lazy=True)
        weights = weights_bytes(model)
        if args.kv_cache_memory is not None:
            kv, how = args.kv_cache_memory, "--kv-cache-memory"
        else:
            kv, how = self.memory.kv_default(weights)
        if kv <= 0:
            raise ValueError(
                f"its weights ({format_bytes(weights)}) leave it no KV budget ({how}); give "
                "it --kv-cache-memory or raise --models-memory"
            )
        return PreparedModel(entry, source, model, Footprint(weights, kv), how, self.names_checked)


class PreparedModel:
    """A model priced, its weights not read (`residency.Prepared`)."""

    def __init__(self, entry: ModelEntry, source: ModelSource, model: Any,
                 footprint: Footprint, how: str, names_checked: bool):  # fmt: skip
        self.entry = entry
        self.source = source
        self.model = model
        self.footprint = footprint
        self.how = how
        self.names_checked = names_checked

    def finish(self) -> Loaded:
        """Planned, checked and warming up with its tokenizer, as `run` does."""
        from ..engine import Engine, check_batch_path, held_exact, warmup_spec
        from ..engine.budget import format_bytes
        from ..plan import plan_kv

        args, source, model, name = self.entry.options, self.source, self.model, self.entry.name
        kv = kv_setting(args, source, model)
        plan = plan_kv(model, kv, batch=True)  # not cached: the model may be unloaded
        check_batch_path(plan.make_cache, kv, max_batch=plan.max_batch)
        warmup_spec(plan.max_window, kv, plan.max_context, held_exact(plan, None))
        log.info("KV plan for %s:\n%s", name, plan.table())
        budget = self.footprint.kv
        log.info("KV cache memory of %s: %s (%s)", name, format_bytes(budget), self.how)
        check_kv_budget(args, plan, budget, self.how)
        gate = warmup_gate(args.warmup_gate, name, None)
        options = engine_options(args, plan.max_context, gate, plan.max_batch,
                                 kv_cache_memory=budget)  # fmt: skip
        engine = Engine(model, None, plan, kv, options)
        log.info("%s: %s", name, engine.capacity.line)
        engine.start()
        try:
            engine.attach(load_tokenizer(source, args))
        except BaseException:
            engine.stop(timeout=None)  # the warm-up runs to its end
            raise
        settings = server_settings(args, source, plan.to_dict(), self.names_checked)
        return Loaded(engine, settings)

    def discard(self) -> None:
        self.model = None


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
        prepare_compute(draft_model, args)
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

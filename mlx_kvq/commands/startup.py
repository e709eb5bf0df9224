"""What every command does before its own work: find the model, check, load, plan.

One pipeline for a single process and for the ranks of an `mlx.launch`
group (`Launch`). A setting that can be refused from `config.json` alone is
refused here, before any weights are read (a refusal costs seconds at
startup, not a failed first request after minutes of loading):
`refuse_early` plans the KV caches from the config and raises
`UnsupportedKVConfig` naming the layer. Errors are raised, never printed:
`commands.main` turns them into exit status 2 with the message.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import KVConfig

log = logging.getLogger("mlx_kvq.server")


@dataclass(frozen=True)
class ModelSource:
    """Where the model comes from and the id it is served under."""

    location: str  # a directory or a repo id, as mlx_lm.load takes it
    served_id: str
    adapter_path: str | None = None  # fine-tune weights applied at load (--adapter-path)

    @property
    def local_config(self) -> Path | None:
        """The model's config.json when it is on disk (not a hub repo id)."""
        path = Path(self.location) / "config.json"
        return path if path.is_file() else None


def model_source(args: argparse.Namespace) -> ModelSource:
    """`--model` (with `--adapter-path`): a path or repo id, `demo:gemma` or
    `demo:full` for an embedded model, and the gemma demo when none is given."""
    served = getattr(args, "served_model_name", None)
    adapter = getattr(args, "adapter_path", None)
    if adapter is not None:
        for name in ("adapter_config.json", "adapters.safetensors"):
            if not (Path(adapter) / name).is_file():
                raise FileNotFoundError(
                    f"--adapter-path {adapter}: no {name} there (mlx_lm.lora writes "
                    "adapter_config.json and adapters.safetensors)"
                )
    from ..demo import resolve_model

    try:
        location, demo_id = resolve_model(args.model)
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"the embedded demo model is not available in this installation ({e}); "
            "pass --model PATH"
        ) from None
    location, conversion = model_directory(location, "--model")
    if conversion is not None:
        demo_id = Path(conversion.source).stem
    return ModelSource(location, served or demo_id or args.model, adapter)


def model_directory(model: str, flag: str) -> tuple[str, Any]:
    """A model location as `mlx_lm.load` takes it: a GGUF file is converted once
    into the cache (`gguf.converted`) and its directory returned, with what the
    conversion did, said on stderr; other locations pass through."""
    from ..from_gguf import as_directory

    location, conversion, fresh = as_directory(model)
    if conversion is not None:
        done = "converted to" if fresh else "converted earlier, in"
        print(f"mlx-kvq: {flag} {model}: {done} {location}", file=sys.stderr)
        print(f"mlx-kvq: {conversion.summary()}", file=sys.stderr)
    return location, conversion


def kv_setting(args: argparse.Namespace, source: ModelSource, model: Any = None) -> KVConfig:
    """The KV setting the flags ask for; with no bits flag, the default of the
    model's layout (with or without a bounded layer), read from `model` (a
    loaded model or a config file), else from config.json before the weights
    where it is on disk (a hub id gets the bounded default until loaded)."""
    from ..defaults import asks_for_default
    from ..plan import has_bounded_layers
    from .flags import kv_config

    target = model if model is not None else source.local_config
    if target is None or not asks_for_default(args.kv_bits, args.kv_key_bits, args.kv_value_bits):
        return kv_config(args)
    return kv_config(args, has_bounded_layers(target, args.max_kv_size))


def setting_origin(args: argparse.Namespace, source: ModelSource, model: Any = None) -> str:
    """Where the KV setting of `kv_setting` comes from, in words: the flags, or
    which default of `mlx_kvq/defaults.py` the model's layout gets."""
    from ..defaults import asks_for_default, default_name
    from ..plan import has_bounded_layers

    target = model if model is not None else source.local_config
    if not asks_for_default(args.kv_bits, args.kv_key_bits, args.kv_value_bits):
        return "as the bits flags ask"
    if target is None:
        return default_name(True) + " (layout unknown before the weights load)"
    return default_name(has_bounded_layers(target, args.max_kv_size)) + " (mlx_kvq/defaults.py)"


def refuse_early(source: ModelSource, kv: KVConfig) -> None:
    """Plan from config.json alone (no weights), so a bad setting stops here."""
    from ..plan import plan_kv

    if kv.enabled and source.local_config is not None:
        plan_kv(source.local_config.parent, kv)


def tokenizer_config(args: argparse.Namespace) -> dict[str, Any]:
    """mlx-lm's tokenizer options from `--trust-remote-code` and `--chat-template`."""
    config: dict[str, Any] = {}
    if getattr(args, "trust_remote_code", False):
        config["trust_remote_code"] = True
    if getattr(args, "chat_template", None):
        config["chat_template"] = args.chat_template
    return config


def load_model(source: ModelSource, args: argparse.Namespace) -> tuple[Any, Any]:
    """(model, tokenizer) as mlx-lm's `load` makes them (a hub repo id fetched
    first), adapters applied; a failure names the model (and the adapter).
    `serve` loads the two apart, warming up between them.

    `--trust-remote-code` reaches the model too (custom `model_file`
    architectures), as in mlx_lm.server.
    """
    source = fetched(source)
    return load_weights(source, args), load_tokenizer(source, args)


def fetched(source: ModelSource) -> ModelSource:
    """`source` on disk: a hub repo id is fetched first (as mlx-lm's `load`
    does); a failure names the model."""
    if source.local_config is not None:
        return source
    from ..mlx_lm_internals import local_model

    try:
        return replace(source, location=str(local_model(source.location)))
    except Exception as e:  # noqa: BLE001 - any fetch failure is a bad --model
        raise ValueError(
            f"could not load the model from {source.location}: {type(e).__name__}: {e}"
        ) from e


def load_weights(source: ModelSource, args: argparse.Namespace, lazy: bool = False) -> Any:
    """The model on disk, as mlx-lm's `load` makes it but without its
    tokenizer (`load_tokenizer`), so that `serve` warms up while the
    tokenizer loads; a failure names the model. `lazy`: no weight is read
    yet (their bytes are known from their shapes; the engine reads them)."""
    from mlx_lm.utils import load_adapters
    from mlx_lm.utils import load_model as mlx_lm_load_model

    try:
        model, _ = mlx_lm_load_model(
            Path(source.location), lazy=lazy,
            trust_remote_code=getattr(args, "trust_remote_code", False),
        )  # fmt: skip
        if source.adapter_path is not None:
            model = load_adapters(model, source.adapter_path)
            model.eval()
    except Exception as e:  # noqa: BLE001 - any load failure is a bad --model
        raise ValueError(
            f"could not load the model from {_what(source)}: {type(e).__name__}: {e}"
        ) from e
    prepare_compute(model, args)
    return model


def load_tokenizer(source: ModelSource, args: argparse.Namespace) -> Any:
    """The tokenizer of a model on disk, as mlx-lm's `load` makes it; a
    failure names the model."""
    from mlx_lm.utils import load_config
    from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer

    path = Path(source.location)
    try:
        tokenizer = mlx_lm_load_tokenizer(
            path, tokenizer_config(args), eos_token_ids=load_config(path).get("eos_token_id")
        )
    except Exception as e:  # noqa: BLE001 - any load failure is a bad --model
        raise ValueError(
            f"could not load the tokenizer of {source.location}: {type(e).__name__}: {e}"
        ) from e
    if getattr(args, "use_default_chat_template", False):
        use_default_chat_template(tokenizer)
    return tokenizer


def _what(source: ModelSource) -> str:
    if source.adapter_path is None:
        return source.location
    return f"{source.location} with the adapter {source.adapter_path}"


def prepare_compute(model: Any, args: argparse.Namespace) -> None:
    """`--dtype` and the CPU backend's choices (`compute.prepare`), said on stderr."""
    from ..compute import prepare

    line = prepare(model, getattr(args, "dtype", "auto")).line()
    if line is not None:
        print(f"mlx-kvq: {line}", file=sys.stderr)


def check_sharding_early(location: str, pipeline: bool, rank: int):
    """Under `mlx.launch`: can the group shard this model? Decided from
    config.json before any weight is read, the same on every rank
    (`distributed.planning.check_sharding`); returns the tensor layout (None
    for pipeline), raises naming the rank otherwise (an unreadable config
    too, as loading would)."""
    from ..config import UnsupportedKVConfig
    from ..distributed.planning import check_sharding

    try:
        return check_sharding(location, pipeline)
    except UnsupportedKVConfig as e:
        raise UnsupportedKVConfig(f"rank {rank}: {e}") from None
    except Exception as e:  # noqa: BLE001 - no config to read: say so, as loading would
        raise ValueError(
            f"rank {rank}: could not read the config of {location}: {type(e).__name__}: {e}"
        ) from e


def use_default_chat_template(tokenizer: Any) -> None:
    """mlx_lm.server's `--use-default-chat-template`: a tokenizer without a chat
    template takes its default one; ValueError when there is none (recent
    transformers releases have no default templates)."""
    if tokenizer.chat_template is not None:
        return
    default = getattr(tokenizer, "default_chat_template", None)
    if not default:
        raise ValueError(
            "--use-default-chat-template: the tokenizer has no chat template and no default "
            "one; pass --chat-template with a template"
        )
    tokenizer.chat_template = default


class Launch:
    """Where a command runs: one process, or one rank of an `mlx.launch` group.

    Every command takes the same steps in the same order, single process and
    rank alike: `refusing` (settings checked, refusals named), `load`,
    `kv_setting`, `plan`, then its own work, `say` for what it prints and
    `leave` at the end. A step differs by where it runs only here: a rank
    checks the group can shard the model before any weight is read, loads
    its shard under a heartbeat (so that a rank that dies stops the group),
    takes the KV setting from config.json (the same on every rank), plans
    with every other rank (one failing rank stops them all), and prints
    only on rank 0.
    """

    def __init__(self, rank: int | None = None):
        self.rank = rank
        self.heartbeat: Any = None  # distributed.heartbeat.Heartbeat, once loading starts
        self.shard: Any = None  # distributed.loading.Shard, once loaded

    @classmethod
    def current(cls) -> Launch:
        from ..distributed.group import launched, world

        return cls(world().rank()) if launched() else cls()

    @property
    def grouped(self) -> bool:
        return self.rank is not None

    @property
    def leader(self) -> bool:
        """Whether this process answers the user (prints, serves HTTP)."""
        return self.rank in (None, 0)

    def named(self, message: str) -> str:
        """`message` as this process says it (`rank N: ...` in a group)."""
        return message if self.rank is None else f"rank {self.rank}: {message}"

    @contextmanager
    def refusing(self, what: str = "") -> Iterator[None]:
        """A setting refused inside (`ValueError`, `FileNotFoundError`,
        `UnsupportedKVConfig`) leaves naming this rank and `what`; the group's
        heartbeat is told this rank stops on purpose."""
        from ..config import UnsupportedKVConfig

        try:
            yield
        except (ValueError, FileNotFoundError) as e:
            if self.heartbeat is not None:
                self.heartbeat.stopping()
            kind = type(e) if type(e) in (UnsupportedKVConfig, FileNotFoundError) else ValueError
            raise kind(self.named(f"{what}{e}")) from None

    def refuse_in_group(self, args: argparse.Namespace, *flags: str) -> None:
        """Flags an `mlx.launch` group cannot honour (as in mlx-lm): a ValueError naming one."""
        for flag in flags if self.grouped else ():
            if getattr(args, flag, None):
                raise ValueError(
                    f"--{flag.replace('_', '-')} is not supported under mlx.launch (as in mlx-lm)"
                )

    def load(self, source: ModelSource, args: argparse.Namespace) -> tuple[Any, Any]:
        """(model, tokenizer): the whole model, or this rank's shard of it."""
        if not self.grouped:
            return load_model(source, args)
        from ..distributed.heartbeat import Heartbeat, RankLoss, abort_on_loss
        from ..distributed.loading import load_sharded, sync_seed

        pipeline = getattr(args, "pipeline", False)
        layout = check_sharding_early(source.location, pipeline, self.rank)
        hb = self.heartbeat = Heartbeat.start()
        hb.on_group_failed = lambda reason: abort_on_loss(RankLoss(0, reason, reported=True))
        try:
            model, tokenizer, _, self.shard = load_sharded(
                source.location, pipeline, tokenizer_config=tokenizer_config(args),
                trust_remote_code=getattr(args, "trust_remote_code", False), layout=layout,
            )  # fmt: skip
        except Exception as e:
            hb.report_fatal(self.named(f"could not load the model: {type(e).__name__}: {e}"))
            hb.stopping()
            raise ValueError(
                self.named(
                    f"could not load the model from {source.location}: {type(e).__name__}: {e}"
                )  # fmt: skip
            ) from e
        if getattr(args, "use_default_chat_template", False):
            use_default_chat_template(tokenizer)
        prepare_compute(model, args)
        sync_seed(getattr(args, "seed", None))
        return model, tokenizer

    def kv_setting(self, args: argparse.Namespace, source: ModelSource, model: Any = None):
        """The KV setting (see `kv_setting`): a rank reads the layout from
        config.json, so that every rank takes the same default."""
        return kv_setting(args, source, None if self.grouped else model)

    def plan(self, model: Any, kv: KVConfig, *, batch: bool = False, checks: Any = None):
        """(this process's plan, every rank's plan summary or None), `checks(plan)`
        run on it; in a group every rank raises when one cannot honour the plan.
        The batch plan (a server's) is made for its engine alone: `get_plan`'s
        cache would hold the model for good, and a server may unload it."""
        from ..generate import get_plan
        from ..plan import plan_kv

        if not self.grouped:
            plan = plan_kv(model, kv, batch=True) if batch else get_plan(model, kv)
            if checks is not None:
                checks(plan)
            return plan, None
        from ..distributed.planning import plan_on_every_rank

        return plan_on_every_rank(model, kv, self.shard, batch=batch, checks=checks)

    def shard_infos(self) -> list[dict[str, Any]] | None:
        """Every rank's shard (mode and layers) when no plan reports it
        (unquantized caches); None for a single process."""
        if not self.grouped:
            return None
        from ..distributed.group import gather_json

        mine = {"ok": True, "rank": self.rank, "mode": self.shard.mode, "layers": self.shard.layers}
        return gather_json(mine)

    def plan_text(self, plan: Any, infos: list[dict[str, Any]] | None, whole: bool) -> str:
        """The plan as reported: its table (`whole`) or summary, and one line per rank."""
        if plan is None:
            return "KV cache: unquantized"
        if infos is None:
            return plan.table() if whole else plan.summary()
        from ..distributed.planning import ranks_table

        return (self.named(f"{plan.table()}\n") if whole else "") + ranks_table(infos)

    def plan_dict(self, plan: Any, infos: list[dict[str, Any]] | None) -> dict[str, Any]:
        """The plan as `/health` and the page report it (the group's, in a group)."""
        if infos is None:
            return plan.to_dict()
        from ..distributed.group import gather_json
        from ..distributed.planning import group_plan_dict

        return group_plan_dict(gather_json(plan.to_dict()), infos)

    def coordinator(self, infos: list[dict[str, Any]] | None, step_timeout: float) -> Any:
        """The engine's seam to the other ranks (None: a single process)."""
        if not self.grouped:
            return None
        from ..distributed.coordinator import GroupCoordinator

        return GroupCoordinator(self.heartbeat, infos, step_timeout=step_timeout)

    def bind(self, engine: Any, coordinator: Any) -> None:
        """Once the engine exists, a rank's loss is the engine's to report."""
        if coordinator is not None:
            coordinator.bind(engine)
            self.heartbeat.on_group_failed = lambda reason: log.error("rank 0 reports: %s", reason)

    def follow(self, engine: Any, coordinator: Any) -> int:
        """A follower rank: run the engine rank 0 drives until the group stops."""
        import threading

        engine.start()
        engine.join()
        if coordinator.stopped_normally:
            self.leave(0)
        # This rank failed (rank 0 was told why) or the group did: stay until rank 0
        # goes, so that rank 0 keeps answering 503 with the reason; the heartbeat
        # exits us then.
        log.error("rank %d: engine stopped: %s", self.rank, engine.readiness.get().reason)
        threading.Event().wait()
        return 1

    def leave(self, rc: int) -> int:
        """`rc` for a single process; a rank exits now (an engine thread stuck in a
        collective must not hold the process)."""
        if self.heartbeat is None:
            return rc
        import os
        import sys

        self.heartbeat.stopping()
        self.heartbeat.close()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)

    def say(self, *args: Any, **kw: Any) -> None:
        """Print, on the leader only."""
        if self.leader:
            print(*args, **kw, flush=True)

    def kv_bytes(self, cache: list) -> list[int]:
        """The KV bytes each rank's `cache` holds (one entry for a single process)."""
        if not self.grouped:
            from ..caches import cache_report

            return [sum(r["nbytes"] for r in cache_report(cache))]
        from ..distributed.planning import gather_kv_bytes

        return gather_kv_bytes(cache)

    def close(self) -> None:
        """The group's end: every rank waits for every other before its heartbeat
        closes (no rank sees another's channel close as a loss)."""
        if self.heartbeat is None:
            return
        from ..distributed.group import gather_json

        self.heartbeat.stopping()
        gather_json(0)
        self.heartbeat.close()

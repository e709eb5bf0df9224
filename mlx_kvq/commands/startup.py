"""What every command does before its own work: find the model, check, load.

A setting that can be refused from `config.json` alone is refused here,
before any weights are read (a refusal costs seconds at startup, not a failed
first request after minutes of loading): `refuse_early` plans the KV
caches from the config and raises `UnsupportedKVConfig` naming the layer.
Errors are raised, never printed: `commands.main` turns them into exit
status 2 with the message.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import KVConfig


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
    """(model, tokenizer) with mlx-lm's `load`, adapters applied; a failure
    names the model (and the adapter).

    `--trust-remote-code` reaches the model too (custom `model_file`
    architectures), as in mlx_lm.server.
    """
    from mlx_lm import load

    try:
        model, tokenizer = load(
            source.location,
            adapter_path=source.adapter_path,
            tokenizer_config=tokenizer_config(args),
            trust_remote_code=getattr(args, "trust_remote_code", False),
        )
    except Exception as e:  # noqa: BLE001 - any load failure is a bad --model
        what = source.location
        if source.adapter_path is not None:
            what += f" with the adapter {source.adapter_path}"
        raise ValueError(f"could not load the model from {what}: {type(e).__name__}: {e}") from e
    if getattr(args, "use_default_chat_template", False):
        use_default_chat_template(tokenizer)
    return model, tokenizer


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

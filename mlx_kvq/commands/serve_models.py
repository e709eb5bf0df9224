"""The models `mlx-kvq serve` declares: `--model` (repeatable) and `--models-file`.

Each declared model is a `residency.ModelEntry`: the name it is served and
listed under, where it loads from, its aliases, whether it stays pinned, and
its flags (the command line's, with the model's own on top: `options`). The
first `--model` is the default model (`default_model`) and takes the command
line's model flags (`--served-model-name`, `--adapter-path`, `--draft-model`);
the others and those of the file take the command line's KV and serving
flags and what their own `flags` set (`flags.MODEL_FLAGS`, the KV flags).

A models file, JSON (or YAML, by its suffix)::

    {"default": "small",
     "models": [
       {"name": "small", "model": "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
        "aliases": ["claude-3-5-haiku-latest"], "pinned": true,
        "flags": "--kv-bits 4 --kv-cache-memory 256MiB"},
       {"model": "/models/gemma-3-270m"}]}

A request may also name a model nobody declared, as mlx_lm.server allows
(`undeclared`): a model directory, a GGUF file, an embedded demo model or,
on the OpenAI endpoints, a Hugging Face repo id.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path
from typing import Any

from ..residency import ModelEntry
from .flags import model_flags

ENTRY_KEYS = {"name", "model", "aliases", "pinned", "flags"}
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # what mlx_lm.load fetches from the Hugging Face hub
# flags that belong to the first --model alone (its adapter, draft model and served name)
FIRST_MODEL_ONLY = {"served_model_name": None, "adapter_path": None, "draft_model": None,
                    "num_draft_tokens": None}  # fmt: skip


def model_base(args: argparse.Namespace) -> argparse.Namespace:
    """The command line's flags as any model but the first takes them."""
    return argparse.Namespace(**{**vars(args), **FIRST_MODEL_ONLY})


def default_name(location: str) -> str:
    """The id a model is served under when no name is given: a GGUF file's
    stem, an embedded demo model's id, else the location as given."""
    from ..demo import DEMO_PREFIX, resolve_model

    if location.startswith(DEMO_PREFIX):
        return resolve_model(location)[1] or location
    if location.lower().endswith(".gguf"):
        return Path(location).stem
    return location


def read_models_file(path: str) -> tuple[list[dict[str, Any]], str | None]:
    """The entries of a models file and its default model's name (None: the
    first); ValueError naming the file and what is wrong."""
    where = f"--models-file {path}"
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{where}: cannot be read: {e}") from None
    try:
        if Path(path).suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error is a bad file
        raise ValueError(f"{where}: not valid {Path(path).suffix or 'JSON'}: {e}") from None
    default = None
    if isinstance(data, dict):
        unknown = sorted(set(data) - {"models", "default"})
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown} (models, default)")
        default, data = data.get("default"), data.get("models")
    if not isinstance(data, list) or not data:
        raise ValueError(f"{where}: needs a non-empty list of models ('models')")
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise ValueError(f"{where}: model {i} needs a 'model' (a path, GGUF file or repo)")
        unknown = sorted(set(entry) - ENTRY_KEYS)
        if unknown:
            raise ValueError(
                f"{where}: model {i} has unknown keys {unknown} ({sorted(ENTRY_KEYS)})"
            )
    if default is not None and not isinstance(default, str):
        raise ValueError(f"{where}: 'default' must be a model's name")
    return data, default


def file_entry(raw: dict[str, Any], base: argparse.Namespace, where: str) -> ModelEntry:
    """One model of a models file as a declared entry."""
    location = raw["model"]
    name = raw.get("name") or default_name(location)
    aliases = raw.get("aliases") or []
    flags = raw.get("flags") or []
    if not isinstance(name, str) or not isinstance(aliases, list):
        raise ValueError(f"{where}: 'name' must be text and 'aliases' a list of names")
    if not all(isinstance(a, str) and a for a in aliases):
        raise ValueError(f"{where}: every alias must be a non-empty name")
    if not isinstance(raw.get("pinned", False), bool):
        raise ValueError(f"{where}: 'pinned' must be true or false")
    if isinstance(flags, str):
        flags = shlex.split(flags)
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise ValueError(f"{where}: 'flags' must be serve flags, as one text or a list")
    options = model_flags(base, flags, f"{where} ({name})")
    options.model = location
    return ModelEntry(name, location, tuple(aliases), bool(raw.get("pinned")), True, options)


def declared_models(
    args: argparse.Namespace,
) -> tuple[argparse.Namespace, ModelEntry | None, list[ModelEntry]]:
    """The declared models: the default model's options (`args` itself for the
    first `--model`, whose name is decided with its source,
    `startup.model_source`; else the models file's default or first model,
    with its entry), then the others in order: the other `--model`s, then the
    file's."""
    base = model_base(args)
    others = [
        ModelEntry(default_name(location), location,
                   options=argparse.Namespace(**{**vars(base), "model": location}))
        for location in (args.models or [])[1:]
    ]  # fmt: skip
    if args.models_file is None:
        return args, None, others
    raw, default = read_models_file(args.models_file)
    where = f"--models-file {args.models_file}"
    listed = [file_entry(r, base, f"{where}, model {i}") for i, r in enumerate(raw)]
    if default is not None and default not in [e.name for e in listed]:
        raise ValueError(f"{where}: the default '{default}' is not one of its models")
    if args.models:
        return args, None, others + listed
    first = next((e for e in listed if e.name == default), listed[0])
    return first.options, first, [e for e in listed if e is not first]


def undeclared(name: str, hub: bool) -> bool:
    """Whether a request's `name` is a model mlx_lm.server would load: a model
    directory (config.json), a GGUF file, an embedded demo model, or a repo id
    (`hub`)."""
    from ..demo import DEMO_MODELS, DEMO_PREFIX

    if name.startswith(DEMO_PREFIX):
        return name[len(DEMO_PREFIX) :] in DEMO_MODELS
    try:
        path = Path(name).expanduser()
        if path.is_dir():
            return (path / "config.json").is_file()
        if path.is_file():
            return path.suffix.lower() == ".gguf"
    except (OSError, ValueError):
        return False
    return hub and HUB_ID.fullmatch(name) is not None

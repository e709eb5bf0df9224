"""Generation with quantized caches: mirrors of mlx-lm's entry points.

`make_prompt_cache`, `generate_step`, `stream_generate` and `generate` take
mlx-lm's arguments and behave like mlx-lm's, except that every KV layer is
quantized by the plan (mlx-lm quantizes only plain `KVCache`s and crashes on
sliding windows). Caches are built already quantized (or convert themselves
at `quantized_kv_start`), so mlx-lm's own loops run them unchanged.

One deliberate difference: `quantized_kv_start` defaults to 0 (quantize from
the first token); mlx-lm's default is 5000.
"""

from __future__ import annotations

import importlib
import json
import sys
import weakref
from collections.abc import Generator
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache

from . import attention
from .config import KVConfig, UnsupportedKVConfig
from .plan import KV_KINDS, KVPlan, plan_kv, twin_slot
from .speculative import (
    DEFAULT_DRAFT_TOKENS,
    check_speculation,
    prepare_for_speculation,
    split_caches,
)

# `mlx_lm.generate` the attribute is a function; the module is what we need.
mlx_generate = importlib.import_module("mlx_lm.generate")

_PLANS: dict[int, dict] = {}

KV_KEYS = tuple(KVConfig().as_kwargs())  # the KV keywords our generation functions add


def kv_config_from_kwargs(kwargs: dict) -> KVConfig:
    """Pop mlx-lm style KV keywords out of `kwargs` into a `KVConfig`."""
    return KVConfig.from_args(**{k: kwargs.pop(k) for k in KV_KEYS if k in kwargs})


def get_plan(model: nn.Module, kv_config: KVConfig, batch: bool = False) -> KVPlan:
    """The plan for `model` under `kv_config`, computed once per model."""
    key = id(model)
    if key not in _PLANS:
        _PLANS[key] = {}
        weakref.finalize(model, _PLANS.pop, key, None)
    plans = _PLANS[key]
    if (kv_config, batch) not in plans:
        plans[(kv_config, batch)] = plan_kv(model, kv_config, batch=batch)
    return plans[(kv_config, batch)]


def make_prompt_cache(
    model: nn.Module,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    max_kv_size: int | None = None,
    quantized_kv_start: int = 0,
    kv_key_bits: int | None = None,
    kv_value_bits: int | None = None,
    kv_rotation: str = "none",
    allow_partial_kv: bool = False,
    kv_skip_layers: tuple[int, ...] | None = None,
    kv_window_bits: int | None = None,
    kv_key_scales: str | None = None,
    kv_key_group_size: int | None = None,
    kv_residual: int | None = None,
    kv_sinks: int | None = None,
) -> list[Any]:
    """One cache per cache slot of the model (same length and order as
    mlx-lm's), every KV layer quantized as planned.

    With no bits requested it returns mlx-lm's own unquantized caches.
    Raises `ValueError` / `UnsupportedKVConfig` for a setting the model cannot
    honour, before any forward pass.
    """
    cfg = KVConfig.from_args(
        kv_bits, kv_group_size, kv_key_bits, kv_value_bits, kv_rotation,
        quantized_kv_start, max_kv_size, allow_partial_kv, kv_skip_layers, kv_window_bits,
        kv_key_scales, kv_key_group_size, kv_residual, kv_sinks,
    )  # fmt: skip
    if not cfg.enabled:
        return mlx_cache.make_prompt_cache(model, max_kv_size=max_kv_size)
    return get_plan(model, cfg).make_cache()


def quantize_prompt_cache(prompt_cache: list, plan: KVPlan) -> list:
    """Replace, in place, filled unquantized entries with their quantized twins
    as planned, `CacheList` members included (position, ring index and sink
    tokens preserved)."""
    for i, c in enumerate(prompt_cache):
        prompt_cache[i] = twin_slot(plan, i, c)
    return prompt_cache


def prepare_cache(model: nn.Module, prompt_cache: list | None, cfg: KVConfig) -> list | None:
    """The caches to generate with: the plan's (or, unquantized, mlx-lm's with
    `max_kv_size`), or `prompt_cache` quantized in place as planned; None when
    unquantized with nothing to bound (mlx-lm then makes its own)."""
    if not cfg.enabled:
        if prompt_cache is None and cfg.max_kv_size is not None:
            return mlx_cache.make_prompt_cache(model, max_kv_size=cfg.max_kv_size)
        return prompt_cache
    plan = get_plan(model, cfg)
    if prompt_cache is None:
        return plan.make_cache()
    if len(prompt_cache) != len(plan.layers) and len(prompt_cache) != len(
        {(p.slot) for p in plan.layers}
    ):
        raise UnsupportedKVConfig(
            f"prompt cache has {len(prompt_cache)} entries, the model has "
            f"{len({p.slot for p in plan.layers})} cache slots"
        )
    return quantize_prompt_cache(prompt_cache, plan)


def generate_step(
    prompt: mx.array,
    model: nn.Module,
    stream=mlx_generate.generation_stream,
    *,
    max_tokens: int = 256,
    sampler=None,
    logits_processors=None,
    max_kv_size: int | None = None,
    prompt_cache: list | None = None,
    prefill_step_size: int = 2048,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    prompt_progress_callback=None,
    input_embeddings: mx.array | None = None,
    kv_key_bits: int | None = None,
    kv_value_bits: int | None = None,
    kv_rotation: str = "none",
    allow_partial_kv: bool = False,
    kv_skip_layers: tuple[int, ...] | None = None,
    kv_window_bits: int | None = None,
    kv_key_scales: str | None = None,
    kv_key_group_size: int | None = None,
    kv_residual: int | None = None,
    kv_sinks: int | None = None,
) -> Generator[tuple[int, mx.array], None, None]:
    """mlx-lm's `generate_step`, with every KV layer quantized."""
    cfg = KVConfig.from_args(
        kv_bits, kv_group_size, kv_key_bits, kv_value_bits, kv_rotation,
        quantized_kv_start, max_kv_size, allow_partial_kv, kv_skip_layers, kv_window_bits,
        kv_key_scales, kv_key_group_size, kv_residual, kv_sinks,
    )  # fmt: skip
    prompt_cache = prepare_cache(model, prompt_cache, cfg)
    yield from mlx_generate.generate_step(
        prompt, model, stream,
        max_tokens=max_tokens, sampler=sampler, logits_processors=logits_processors,
        prompt_cache=prompt_cache, prefill_step_size=prefill_step_size,
        prompt_progress_callback=prompt_progress_callback, input_embeddings=input_embeddings,
    )  # fmt: skip


def stream_generate(model, tokenizer, prompt, max_tokens: int = 256, draft_model=None, **kwargs):
    """mlx-lm's `stream_generate`, with every KV layer quantized (the draft
    model's too, under speculative decoding, with windows made rewindable:
    see `mlx_kvq.speculative`)."""
    cfg = kv_config_from_kwargs(kwargs)
    prompt_cache = kwargs.pop("prompt_cache", None)
    if draft_model is None:
        kwargs["prompt_cache"] = prepare_cache(model, prompt_cache, cfg)
        yield from mlx_generate.stream_generate(model, tokenizer, prompt, max_tokens, **kwargs)
        return
    model_cache, draft_cache = split_caches(model, prompt_cache)
    # Without caches given, the plan's, even unquantized (raw storage): their windows rewind.
    model_cache = prepare_cache(model, model_cache, cfg) or get_plan(model, cfg).make_cache()
    draft_cache = (
        prepare_cache(draft_model, draft_cache, cfg) or get_plan(draft_model, cfg).make_cache()
    )
    check_speculation(model, draft_model, model_cache, draft_cache)
    num_draft = kwargs.get("num_draft_tokens", DEFAULT_DRAFT_TOKENS)
    prepare_for_speculation(model_cache, num_draft)
    prepare_for_speculation(draft_cache, num_draft)
    kwargs["prompt_cache"] = list(model_cache) + list(draft_cache)
    yield from mlx_generate.stream_generate(
        model, tokenizer, prompt, max_tokens, draft_model=draft_model, **kwargs
    )


def generate(model, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
    """mlx-lm's `generate` on top of our `stream_generate`."""
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec"
        )
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text


# -- prompt-cache files --------------------------------------------------------
def save_prompt_cache(file_name: str, cache: list, metadata: dict[str, str] | None = None) -> None:
    """mlx-lm's `save_prompt_cache`, recording the KV settings of the caches."""
    from .caches import cache_report

    meta = dict(metadata or {})
    meta["mlx_kvq"] = json.dumps(
        [{"kind": r["kind"], "quantized": r["quantized"]} for r in cache_report(cache)]
        + [{"settings": _cache_settings(cache)}]
    )
    mlx_cache.save_prompt_cache(file_name, cache, meta)


def _cache_settings(cache: list) -> str:
    """Each layout's settings once, in layer order ("sliding K 8b/g64 V 8b/g64; full ...")."""
    from .caches import KVQCache, leaves

    found = [leaf for c in cache for leaf in leaves(c) if isinstance(leaf, KVQCache)]
    return "; ".join(dict.fromkeys(leaf.describe() for leaf in found)) or "unquantized"


def load_prompt_cache(
    file_name: str, return_metadata: bool = False, expect: KVConfig | None = None
):
    """mlx-lm's `load_prompt_cache` with clear errors.

    A file that cannot be read (truncated, not safetensors, malformed
    metadata), that names a cache class outside `PROMPT_FILE_CLASSES`, or
    whose caches hold impossible values (a negative offset, an unknown
    dtype) raises `ValueError` with the reason (mlx-lm raises a bare
    `KeyError`, or loads them). With `expect`, a file whose quantized layers
    were stored with other settings is refused, checked on every layer
    (mlx-lm only looks at layer 0, a sliding layer on Gemma).
    """
    from .caches import PROMPT_FILE_CLASSES, register_for_prompt_files

    if not Path(file_name).exists():
        raise FileNotFoundError(f"prompt cache file {file_name} does not exist")
    try:
        _, meta = mx.load(str(file_name), return_metadata=True)
    except Exception as e:  # noqa: BLE001 - whatever the reader says is the file's fault
        raise ValueError(f"prompt cache file {file_name} cannot be read: {e}") from None
    classes = [
        v for k, v in sorted(meta.items(), key=lambda kv: _meta_order(kv[0])) if k.startswith("1.")
    ]
    if not classes:
        raise ValueError(
            f"prompt cache file {file_name} names no cache classes (not a prompt cache)"
        )
    unknown = sorted({c for c in classes if c not in PROMPT_FILE_CLASSES})
    if unknown:
        raise ValueError(
            f"prompt cache file {file_name} holds cache classes {unknown} that are not "
            "known to mlx-lm or mlx-kvq (written by another library or version?)"
        )
    register_for_prompt_files()  # mlx-lm's reader finds our classes by name
    attention.install()  # the caches it returns hand attention what only ours reads
    try:
        cache, metadata = mlx_cache.load_prompt_cache(str(file_name), return_metadata=True)
    except Exception as e:  # noqa: BLE001 - a malformed state is the file's fault
        raise ValueError(
            f"prompt cache file {file_name} is malformed: {type(e).__name__}: {e}"
        ) from None
    _check_counts(cache, file_name)
    if expect is not None:
        check_prompt_cache_settings(cache, expect, file_name)
    return (cache, metadata) if return_metadata else cache


def _check_counts(cache: list, file_name: str) -> None:
    """Refuse caches with a negative integer in their state (offsets, starts, sizes)."""
    from .caches import leaves

    for i, slot in enumerate(cache):
        for leaf in leaves(slot):
            for name, value in vars(leaf).items():
                if type(value) is int and value < 0:
                    raise ValueError(
                        f"prompt cache file {file_name}: layer {i} ({type(leaf).__name__}) "
                        f"has {name.lstrip('_')} = {value}; it cannot be negative"
                    )


def _meta_order(key: str):
    return [int(p) if p.isdigit() else p for p in key.split(".")]


def check_prompt_cache_settings(
    cache: list, expect: KVConfig, source: str = "prompt cache"
) -> None:
    """Refuse caches stored with KV settings other than `expect`, layer by layer
    (slots `expect` skips must hold unquantized caches, the others quantized;
    container slots leaf by leaf)."""
    from .caches import KVQCache, leaves, lookup

    for i, c in enumerate(cache):
        if i in expect.skip_layers:
            if any(isinstance(leaf, KVQCache) for leaf in leaves(c)):
                raise UnsupportedKVConfig(
                    f"{source}: layer {i} holds quantized caches, but "
                    "--kv-skip-layers leaves it unquantized; rebuild the prompt cache with "
                    "these settings or pass the settings it was made with"
                )
            continue
        for leaf in leaves(c):
            kind = lookup(leaf)
            if isinstance(leaf, KVQCache):
                got = (leaf.key_spec, leaf.value_spec)
                want = expect.specs(bounded=leaf.bounded)
                if got != want:
                    raise UnsupportedKVConfig(
                        f"{source}: layer {i} was stored as {leaf.describe()}, but "
                        f"{expect.describe()} was requested; rebuild the prompt cache with "
                        "these settings or pass the settings it was made with"
                    )
            elif expect.enabled and kind is not None and kind.name in (*KV_KINDS, "layer"):
                raise UnsupportedKVConfig(
                    f"{source}: layer {i} is unquantized ({type(leaf).__name__}), but "
                    f"{expect.describe()} was requested"
                )


class _CallableModule(sys.modules[__name__].__class__):
    """This module, callable as `generate(model, tokenizer, prompt, ...)`.

    `mlx_kvq.generate` names both this module (`from mlx_kvq.generate import
    save_prompt_cache`, `mlx_kvq.generate.load_prompt_cache`) and, as in
    mlx-lm's package, the `generate` function. The import system binds the
    submodule to the package attribute whenever it is first imported, so the
    module itself is made callable instead of racing that binding.
    """

    def __call__(self, model, tokenizer, prompt, verbose: bool = False, **kwargs) -> str:
        return generate(model, tokenizer, prompt, verbose=verbose, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

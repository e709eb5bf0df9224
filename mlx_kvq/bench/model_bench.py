"""A random-weight hybrid model: prefill and decode tokens/s, KV memory.

Caches are filled to the wanted context with random keys and values written
through the caches' own `update_and_fetch` (in 2048-token chunks, as a
chunked prefill writes them) instead of running the model over the prompt:
speed does not depend on what the cache holds, and a 16k-token prefill of
the whole model would dominate the run. Then

- decode: one token at a time with greedy sampling, `decode_tokens` steps
  per sample, the unquantized and quantized caches interleaved;
- prefill: one chunk of `prefill_chunk` tokens on top of `context - chunk`
  cached tokens (the marginal prefill speed at that depth), fresh caches per
  sample.
"""

from __future__ import annotations

import contextlib
import gc
import time

import mlx.core as mx
from mlx.utils import tree_flatten

from ..blas import use_linked_blas
from .settings import BenchSettings
from .timing import Stat, interleave, paired_ratio

FILL_CHUNK = 2048


def label(bits) -> str:
    """A configuration's name: unquantized, `N-bit`, or a `KVConfig`'s description."""
    if bits is None:
        return "unquantized"
    return f"{bits}-bit" if isinstance(bits, int) else bits.describe()


def build_model(config: dict, dtype: mx.Dtype, seed: int = 0):
    from ..plan import model_from_config

    mx.random.seed(seed)
    model = model_from_config(dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def count_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


class CacheMaker:
    """Fresh caches for one model: mlx-lm's own when unquantized, else the
    ones `mlx_kvq.make_prompt_cache(model, kv_bits=...)` returns (the KV
    plan's caches). Plans are kept here rather than in `make_prompt_cache`'s
    per-model cache, so they (and the model they reference) are freed with
    this object between sections."""

    def __init__(self, model, group_size: int):
        self.model, self.group_size = model, group_size
        self._plans: dict[int, object] = {}

    def __call__(self, bits: int | None) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        from ..config import KVConfig
        from ..plan import plan_kv

        if bits is None:
            return make_prompt_cache(self.model)
        if bits not in self._plans:
            kv = (
                bits
                if isinstance(bits, KVConfig)
                else KVConfig(bits=bits, group_size=self.group_size)
            )
            self._plans[bits] = plan_kv(self.model, kv)
        return self._plans[bits].make_cache()


def cache_arrays(caches: list) -> list[mx.array]:
    return [a for c in caches for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]


def kv_shapes(model) -> list[tuple[int, int, int]]:
    """(kv heads, key dim, value dim) per cache slot, from a lazy 1-token forward."""
    from mlx_lm.models.cache import make_prompt_cache

    proto = make_prompt_cache(model)
    model(mx.array([[1]]), cache=proto)
    return [(c.keys.shape[1], c.keys.shape[-1], c.values.shape[-1]) for c in proto]


def fill(caches: list, n: int, shapes, dtype: mx.Dtype, seed: int = 0) -> list:
    """Write `n` random tokens into every cache slot through `update_and_fetch`:
    `n - 1` in chunks, as a chunked prefill writes them, then one token, as a
    decode step does (which also trims sliding windows to their size)."""
    if n <= 0:
        return caches
    mx.random.seed(seed)
    blocks = {}
    for h, dk, dv in set(shapes):
        m = max(1, min(FILL_CHUNK, n - 1))
        blocks[(h, dk, dv)] = (
            mx.random.normal((1, h, m, dk)).astype(dtype),
            mx.random.normal((1, h, m, dv)).astype(dtype),
        )
    for c, shape in zip(caches, shapes, strict=True):
        kb, vb = blocks[shape]
        done = 0
        while done < n:
            m = 1 if done == n - 1 else min(FILL_CHUNK, n - 1 - done)
            c.update_and_fetch(kb[..., :m, :], vb[..., :m, :])
            done += m
            mx.eval(cache_arrays([c]))
    return caches


class Decoder:
    """Greedy one-token steps over a cache list."""

    def __init__(self, model, caches: list):
        self.model, self.caches = model, caches
        self.token = mx.array([[1]])

    def step(self) -> None:
        logits = self.model(self.token, cache=self.caches)
        self.token = mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)
        mx.eval(self.token)

    def timed(self, steps: int) -> float:
        t = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - t) / steps


def free() -> None:
    gc.collect()
    mx.clear_cache()


def decode_cell(
    model, make, shapes, dtype, ctx: int, configs, settings: BenchSettings
) -> dict[str, Stat]:
    """Seconds per decode step at `ctx` cached tokens, configurations interleaved."""
    decoders = {
        label(b): Decoder(model, fill(make(b), ctx, shapes, dtype, settings.seed))
        for b in configs
    }  # fmt: skip
    for d in decoders.values():
        d.step()
    steps = settings.decode_tokens
    candidates = {n: (lambda d=d: d.timed(steps)) for n, d in decoders.items()}
    return interleave(candidates, settings.decode_repeats, warmup=1)


def prefill_cell(
    model, make, shapes, dtype, ctx: int, chunk: int, configs, settings: BenchSettings
) -> dict[str, Stat]:
    """Seconds to prefill one `chunk` on top of `ctx - chunk` cached tokens."""
    mx.random.seed(settings.seed + 1)
    tokens = mx.random.randint(0, model.args.vocab_size, (1, chunk))

    def once(b) -> float:
        caches = fill(make(b), ctx - chunk, shapes, dtype, settings.seed)
        t = time.perf_counter()
        logits = model(tokens, cache=caches)
        mx.eval(logits[:, -1, :], cache_arrays(caches))
        return time.perf_counter() - t

    # No untimed warm-up: one chunk takes seconds on a CPU, and a cold first
    # sample of each configuration is outvoted by the median.
    return interleave(
        {label(b): (lambda b=b: once(b)) for b in configs}, settings.prefill_repeats, warmup=0
    )


def run(settings: BenchSettings, log=print) -> dict:
    config = settings.resolved_model_config()
    configs = [None, *settings.bits, *settings.kv_settings]
    out = {"config": config, "rows": []}
    for dtype_name in settings.dtypes:
        dtype = getattr(mx, dtype_name)
        model = build_model(config, dtype, settings.seed)
        out["params"] = count_params(model)
        try:  # some MLX ops have no CPU kernel in some dtypes (MoE gather_mm)
            mx.eval(model(mx.array([[1]])))
        except RuntimeError as e:
            out.setdefault("skipped", []).append({"dtype": dtype_name, "reason": str(e)})
            log(f"  model {dtype_name}: skipped, this backend cannot run it: {e}")
            del model
            free()
            continue
        shapes = kv_shapes(model)
        make = CacheMaker(model, settings.group_size)
        cells = [(ctx, False) for ctx in settings.contexts]
        if dtype_name == settings.reference_blas_dtype:
            cells += [(ctx, True) for ctx in settings.reference_blas_contexts]
        for ctx, reference in cells:
            with use_linked_blas() if reference else contextlib.nullcontext():
                row = _row(model, make, shapes, dtype, dtype_name, ctx, configs, settings)
            row["reference_blas"] = reference
            out["rows"].append(row)
            log(
                f"  model {dtype_name:8s} ctx={ctx:6d} {row['blas']}: decode "
                + "  ".join(f"{n} {_tps(row['decode_tps'][n])}" for n in row["decode_tps"])
                + " | prefill "
                + "  ".join(f"{n} {_tps(row['prefill_tps'][n])}" for n in row["prefill_tps"])
                + " | ratios decode "
                + " ".join(f"{k} {v['median']:.2f}x" for k, v in row["decode_ratio"].items())
                + " prefill "
                + " ".join(f"{k} {v['median']:.2f}x" for k, v in row["prefill_ratio"].items())
            )
        del model, make
        free()
    return out


def _row(model, make, shapes, dtype, dtype_name, ctx, configs, settings) -> dict:
    """Decode and prefill at one context, every configuration in the same rounds,
    on the BLAS bound now (named in the row)."""
    from ..blas import blas_info

    info = blas_info()
    row = {
        "dtype": dtype_name,
        "context": ctx,
        "blas": info.kind.value,
        "blas_detail": info.summary(),
    }
    stats = decode_cell(model, make, shapes, dtype, ctx, configs, settings)
    row["decode_tps"] = {n: s.rate(1.0).to_dict(3) for n, s in stats.items()}
    row["decode_ratio"] = _ratios(stats, configs)
    free()
    chunk = min(settings.prefill_chunk, ctx)
    pstats = prefill_cell(model, make, shapes, dtype, ctx, chunk, configs, settings)
    row["prefill_tps"] = {n: s.rate(chunk).to_dict(3) for n, s in pstats.items()}
    row["prefill_chunk"] = chunk
    row["prefill_ratio"] = _ratios(pstats, configs)
    free()
    return row


def _ratios(stats: dict[str, Stat], configs) -> dict[str, dict]:
    """Speed of each quantized setting relative to unquantized: unquantized
    time over quantized time, round by round (higher is better)."""
    base = stats[label(None)]
    return {
        label(b): paired_ratio(base, stats[label(b)]).to_dict(4) for b in configs if b is not None
    }


def _tps(d: dict) -> str:
    return f"{d['median']:.1f}/s" if d.get("median") is not None else "-"

"""Output quality under KV quantization: KL divergence and top-1 agreement first.

A text is cut into windows of `context` tokens. Each window is fed through
the model `chunk` tokens at a time, as prefill runs in generation, so the
caches (sliding windows included) and the quantized attention are exercised
exactly as they are when serving, never in one full forward pass. Every
window runs twice in lock step, chunk by chunk: once with mlx-lm's own
unquantized caches, once with the requested KV settings. Every position's
next-token distribution is compared:

- KL divergence KL(unquantized || quantized) of the next-token
  distributions (nats): its mean and its 99th percentile over positions;
- top-1 agreement: how often both runs rank the same token first;
- perplexity of the text under each run and its relative change (secondary:
  it averages over positions and hides disagreement).

Every figure comes with its spread across windows: the standard error of the
per-window values (standard deviation / sqrt(windows)). The storage cost is
measured from the bytes the planned caches actually hold (`held_storage`:
packed data, scales, biases and any full-precision part) at `context` tokens
and at `HELD_CONTEXT` tokens.

`evaluate` measures one setting; `evaluate_many` measures several against one
shared unquantized run (`mlx-kvq eval` is `mlx_kvq/commands/eval.py`). With
no model given, the embedded demo model and its two texts are used: the
held-out KJV books (in domain) and modern technical English (out of domain);
`demo:full`, the full-attention demo model, reads them the other way round.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import cache as mlx_cache

from .caches import KVQPagedSequence, PagedCache, Pages, page_caches, paged_block_size
from .config import AUTO_BLOCK_SIZE, KVConfig
from .generate import get_plan

DEFAULT_CONTEXT = 512
DEFAULT_CHUNK = 32
DEFAULT_WINDOWS = 4
HELD_CONTEXT = 2048  # the context the bits-per-element figure is quoted at
KL_PERCENTILE = 99


# -- measurement ----------------------------------------------------------------
def window_starts(n_tokens: int, context: int, windows: int) -> list[int]:
    """Start offsets of `windows` windows of `context` tokens spread evenly
    over `n_tokens` (overlapping only when the text is too short)."""
    if n_tokens <= context or windows <= 1:
        return [0]
    last = n_tokens - context
    starts = sorted({round(i * last / (windows - 1)) for i in range(windows)})
    return starts


def cut_windows(
    tokens: Sequence[int], context: int, windows: int, bos: int | None
) -> list[list[int]]:
    """Token windows of `context` tokens; each starts with `bos` when given
    (a window cut from the middle of the text gets it prepended)."""
    tokens = list(tokens)
    out = []
    for s in window_starts(len(tokens), context, windows):
        w = tokens[s : s + context]
        if bos is not None and w[0] != bos:
            w = [bos] + tokens[s : s + context - 1]
        out.append(w)
    return out


def _spans(n: int, chunk: int, decode: int) -> list[tuple[int, int]]:
    """(start, stop) of each forward pass over `n` positions: chunks of
    `chunk` tokens, then the last `decode` positions one token at a time."""
    decode = min(max(decode, 0), n)
    head = n - decode
    spans = [(s, min(head, s + chunk)) for s in range(0, head, chunk)]
    return spans + [(s, s + 1) for s in range(head, n)]


def _make_cache(model: nn.Module, cfg: KVConfig, block_size: int | str | None = None) -> list:
    """The caches of `cfg` for one window; with `block_size`, the layers that
    page in blocks of that many tokens, as the server holds them (a batch of
    one row over pools of their own); `AUTO_BLOCK_SIZE`: the server's own
    block size for this setting (`paged_block_size`)."""
    if not cfg.enabled:
        return mlx_cache.make_prompt_cache(model, max_kv_size=cfg.max_kv_size)
    plan = get_plan(model, cfg)
    caches = plan.make_cache()
    if not block_size:
        return caches
    if block_size == AUTO_BLOCK_SIZE:
        block_size = paged_block_size(
            (p.kind, p.window, p.key_spec, p.value_spec) for p in plan.kv_layers
        )
    return [_as_batch(c) for c in page_caches(caches, Pages(block_size))]


def _as_batch(cache):
    if type(cache) is mlx_cache.CacheList:
        return mlx_cache.CacheList(*(_as_batch(c) for c in cache.caches))
    return type(cache).merge([cache]) if isinstance(cache, KVQPagedSequence) else cache


def _log_probs(model: nn.Module, x: mx.array, cache: list) -> mx.array:
    logits = model(x, cache=cache)
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _model_dtype(model: nn.Module) -> mx.Dtype:
    from mlx.utils import tree_flatten

    for _, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating):
            return p.dtype
    return mx.float16


def _leaves(caches: list) -> list:
    out = []
    for c in caches:
        out.extend(c.caches if type(c) is mlx_cache.CacheList else [c])
    return out


def held_storage(
    model: nn.Module, cfg: KVConfig, context: int, block_size: int | str | None = None
) -> dict:
    """Bytes the caches of `cfg` hold after `context` tokens, measured.

    The planned caches (mlx-lm's own for an unquantized `cfg`) are filled
    with `context` tokens of K/V in the model's dtype as generation fills
    them, prefill chunks of at most 512 tokens then one decoded token (a
    window holds its whole last prefill chunk until the next token trims
    it), and their `nbytes` summed: packed data, scales, biases and any
    full-precision part all count.
    `bits_per_element` is 8 * bytes / (K and V elements held), so a float16
    cache is 16.0 whatever its layout.
    """
    plan = get_plan(model, cfg)
    caches = _make_cache(model, cfg, block_size)
    dtype = _model_dtype(model)
    held = elements = 0
    for p, c in zip(plan.layers, _leaves(caches), strict=True):
        if not p.is_kv:
            continue
        done = 0
        while done < context:
            n = 1 if done == context - 1 else min(512, context - 1 - done)
            if p.kind == "chunked":  # as the model does before each forward pass
                c.maybe_trim_front()
            k = mx.zeros((1, p.kv_heads, n, p.key_dim), dtype)
            v = mx.zeros((1, p.kv_heads, n, p.value_dim), dtype)
            mx.eval(c.update_and_fetch(k, v))
            done += n
        held += c.nbytes
        elements += c.size() * p.kv_heads * (p.key_dim + p.value_dim)
    fp16 = elements * 2
    return {
        "context": context,
        "paged_layers": sum(isinstance(c, PagedCache) for c in _leaves(caches)),
        "bytes": int(held),
        "fp16_bytes": int(fp16),
        "bits_per_element": 8.0 * held / elements if elements else 16.0,
        "ratio": held / fp16 if fp16 else 1.0,
    }


def _se(values: Sequence[float]) -> float:
    """Standard error of the mean of per-window values (0 with one window)."""
    if len(values) < 2:
        return 0.0
    return float(np.std(values, ddof=1) / math.sqrt(len(values)))


def _summary(kl: list[np.ndarray], agree: list[np.ndarray], d_nll: list[float]) -> dict:
    """Pooled figures, their spread, and the per-window values they come from."""
    kl_all = np.concatenate(kl)
    per_window = {
        "kl_mean": [float(x.mean()) for x in kl],
        f"kl_p{KL_PERCENTILE}": [float(np.percentile(x, KL_PERCENTILE)) for x in kl],
        "top1": [float(x.mean()) for x in agree],
        "d_nll": d_nll,
    }
    return {
        "kl_mean": float(kl_all.mean()),
        "kl_mean_se": _se(per_window["kl_mean"]),
        f"kl_p{KL_PERCENTILE}": float(np.percentile(kl_all, KL_PERCENTILE)),
        f"kl_p{KL_PERCENTILE}_se": _se(per_window[f"kl_p{KL_PERCENTILE}"]),
        "kl_max": float(kl_all.max()),
        "top1": float(np.concatenate(agree).mean()),
        "top1_se": _se(per_window["top1"]),
        "per_window": per_window,
    }


def evaluate_many(
    model: nn.Module,
    tokens: Sequence[int] | mx.array,
    kv_configs: Sequence[KVConfig | None],
    context: int = DEFAULT_CONTEXT,
    chunk: int = DEFAULT_CHUNK,
    windows: int = DEFAULT_WINDOWS,
    bos: int | None = None,
    baseline: KVConfig | None = None,
    progress: bool | None = None,
    decode: int = 0,
    held_context: int | None = HELD_CONTEXT,
    only_windows: Sequence[int] | None = None,
    block_size: int | str | None = None,
) -> list[dict]:
    """Measure every setting in `kv_configs` against one unquantized run.

    `baseline` is the reference setting (default: mlx-lm's own unquantized
    caches, with the first config's `max_kv_size`). The last `decode`
    positions of every window are fed one token at a time, as in decoding
    (in-place ring writes, one-query masks). `only_windows` runs just those
    of the `windows` windows (by index: a cheap slice of a larger run, whose
    `per_window` values it reproduces). `block_size`: the settings' layers
    that page are held in blocks of that many tokens, as the server holds
    them (`--kv-block-size`; None: each cache's own layout; AUTO_BLOCK_SIZE:
    the server's block size for each setting). Returns one
    result dict per setting (see `evaluate`).
    """
    if isinstance(tokens, mx.array):
        tokens = tokens.reshape(-1).tolist()
    if context < 2:
        raise ValueError(f"context must be at least 2 tokens, got {context}")
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 token, got {chunk}")
    if len(tokens) < 2:
        raise ValueError("the text must have at least 2 tokens")
    cfgs = [c if c is not None else KVConfig() for c in kv_configs]
    base_cfg = (
        baseline
        if baseline is not None
        else KVConfig(max_kv_size=cfgs[0].max_kv_size if cfgs else None)
    )
    for c in cfgs:  # plan (and refuse bad settings) before any work
        if c.enabled:
            get_plan(model, c)

    wins = cut_windows(tokens, context, windows, bos)
    if only_windows is not None:
        wins = [wins[i] for i in only_windows]
    n_chunks = sum(len(_spans(len(w) - 1, chunk, decode)) for w in wins)
    if progress is None:
        progress = sys.stderr.isatty()
    from tqdm import tqdm

    bar = tqdm(total=n_chunks, desc="eval", unit="chunk", disable=not progress, leave=False)
    base_nll: list[float] = []  # per window, summed
    nll: list[list[float]] = [[] for _ in cfgs]
    kl: list[list[np.ndarray]] = [[] for _ in cfgs]  # per window, per position
    agree: list[list[np.ndarray]] = [[] for _ in cfgs]
    # Seconds spent on the reference's forward passes, and on each setting's
    # (its forward passes and its scores against the reference).
    base_seconds = 0.0
    seconds = [0.0 for _ in cfgs]
    scored = 0
    for w in wins:
        ids = mx.array(w)
        n = len(w) - 1  # positions with a next token to predict
        base_cache = _make_cache(model, base_cfg)
        caches = [_make_cache(model, c, block_size) for c in cfgs]
        w_base = mx.array(0.0, mx.float32)
        w_nll = [mx.array(0.0, mx.float32) for _ in cfgs]
        w_kl: list[list[mx.array]] = [[] for _ in cfgs]
        w_agree: list[list[mx.array]] = [[] for _ in cfgs]
        for s, e in _spans(n, chunk, decode):
            x = ids[None, s:e]
            y = ids[s + 1 : e + 1]
            t0 = time.perf_counter()
            lp_b = _log_probs(model, x, base_cache)[0]
            top_b = mx.argmax(lp_b, axis=-1)
            p_b = mx.exp(lp_b)
            w_base = w_base - mx.take_along_axis(lp_b, y[:, None], axis=-1).sum()
            mx.eval(lp_b, top_b, p_b, w_base, base_cache)
            base_seconds += time.perf_counter() - t0
            # Each setting's graph evaluated on its own: its time is its own.
            for i, c in enumerate(caches):
                t0 = time.perf_counter()
                lp_q = _log_probs(model, x, c)[0]
                w_kl[i].append((p_b * (lp_b - lp_q)).sum(axis=-1))
                w_agree[i].append(mx.argmax(lp_q, axis=-1) == top_b)
                w_nll[i] = w_nll[i] - mx.take_along_axis(lp_q, y[:, None], axis=-1).sum()
                mx.eval(w_nll[i], w_kl[i][-1], w_agree[i][-1], c)
                seconds[i] += time.perf_counter() - t0
            scored += e - s
            bar.update(1)
        base_nll.append(w_base.item())
        for i in range(len(cfgs)):
            nll[i].append(w_nll[i].item())
            kl[i].append(np.array(mx.concatenate(w_kl[i])))
            agree[i].append(np.array(mx.concatenate(w_agree[i])).astype(np.float64))
    bar.close()

    ctx = max(len(w) for w in wins)
    ppl_b = math.exp(sum(base_nll) / scored)
    results = []
    for i, c in enumerate(cfgs):
        ppl = math.exp(sum(nll[i]) / scored)
        # Per window: mean change of the log-likelihood per token; its spread
        # gives the standard error of the relative perplexity change.
        lengths = [len(x) for x in kl[i]]
        d = [(a - b) / n for a, b, n in zip(nll[i], base_nll, lengths, strict=True)]
        stats = _summary(kl[i], agree[i], d)
        held = held_storage(model, c, ctx, block_size)
        result = {
            "setting": c.describe(),
            "kv_config": asdict(c),
            "context": ctx,
            "chunk": chunk,
            "decode": min(decode, ctx - 1),
            "windows": len(wins),
            "window_indices": list(only_windows or range(len(wins))),
            "tokens_scored": scored,
            **stats,
            "ppl_base": ppl_b,
            "ppl": ppl,
            "rel_ppl_change": ppl / ppl_b - 1.0,
            "rel_ppl_change_se": _se(d) * ppl / ppl_b,
            "paged_layers": held["paged_layers"],
            "bits_per_element_at_context": held["bits_per_element"],
            "kv_bytes_at_context": held["bytes"],
            "seconds": seconds[i],
            "reference_seconds": base_seconds,
        }
        if held_context:
            at = held if held_context == ctx else held_storage(model, c, held_context, block_size)
            result.update(
                held_context=held_context,
                bits_per_element=at["bits_per_element"],
                kv_bytes=at["bytes"],
                kv_fp16_bytes=at["fp16_bytes"],
                kv_ratio=at["ratio"],
            )
        else:
            result["bits_per_element"] = held["bits_per_element"]
        results.append(result)
    return results


def evaluate(
    model: nn.Module,
    tokens: Sequence[int] | mx.array,
    kv_config: KVConfig | None,
    context: int = DEFAULT_CONTEXT,
    chunk: int = DEFAULT_CHUNK,
    windows: int = DEFAULT_WINDOWS,
    bos: int | None = None,
    progress: bool | None = None,
    decode: int = 0,
    held_context: int | None = HELD_CONTEXT,
    only_windows: Sequence[int] | None = None,
) -> dict:
    """Quality of `kv_config` against unquantized caches on `tokens`.

    Returns a dict with `kl_mean` (mean KL(unquantized || quantized) in nats
    per scored token), `kl_p99` (its 99th percentile over positions),
    `kl_max`, `top1` (fraction of positions whose argmax agrees), each
    `*_se` the standard error from the spread across windows (0 with one
    window); `ppl_base` (unquantized), `ppl` (with `kv_config`),
    `rel_ppl_change` (ppl / ppl_base - 1) and `rel_ppl_change_se`;
    `tokens_scored`, `windows`, the setting and its storage cost measured
    from the bytes its caches hold: `bits_per_element` and `kv_bytes` at
    `held_context` tokens, `bits_per_element_at_context` at `context`;
    `per_window`, the per-window values behind the figures; `seconds`, the
    time of this setting's forward passes and scores, and
    `reference_seconds`, that of the unquantized run it is scored against.
    """
    return evaluate_many(
        model, tokens, [kv_config], context, chunk, windows, bos, progress=progress,
        decode=decode, held_context=held_context, only_windows=only_windows,
    )[0]  # fmt: skip


# -- reports ---------------------------------------------------------------------
P = f"p{KL_PERCENTILE}"
TABLE_HEADER = (
    f"| setting | bits/elem | mean KL (nats) | KL {P} | top-1 agree | rel. ppl change |\n"
    "|---|---:|---:|---:|---:|---:|"
)


def _pm(value: float, se: float, fmt: str) -> str:
    return f"{value:{fmt}} ± {se:{fmt}}"


def table_cells(r: dict) -> str:
    """The figures of one result as table cells, each with its standard error."""
    return (
        f"{_pm(r['kl_mean'], r['kl_mean_se'], '.2e')} | "
        f"{_pm(r[f'kl_{P}'], r[f'kl_{P}_se'], '.2e')} | "
        f"{100 * r['top1']:.2f}% ± {100 * r['top1_se']:.2f} | "
        f"{100 * r['rel_ppl_change']:+.3f}% ± {100 * r['rel_ppl_change_se']:.3f} |"
    )


def table_row(r: dict, label: str | None = None) -> str:
    return f"| {label or r['setting']} | {r['bits_per_element']:.2f} | {table_cells(r)}"


def format_table(results: Sequence[dict], labels: Sequence[str] | None = None) -> str:
    """A markdown table of results (one row per setting)."""
    rows = [table_row(r, labels[i] if labels else None) for i, r in enumerate(results)]
    return "\n".join([TABLE_HEADER, *rows])


def format_text_table(results: Sequence[dict]) -> str:
    """A markdown table of one setting on several texts (one row per text)."""
    lines = [
        f"| text | mean KL (nats) | KL {P} | top-1 agree | rel. ppl change | ppl unquantized |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['text']} | {table_cells(r)} {r['ppl_base']:.3f} |")
    return "\n".join(lines)


def load_eval_inputs(
    model_path: str | None, text_paths: Sequence[Path] | None, dtype: str = "auto"
):
    """(model, tokenizer, {text name: (token ids, bos id or None)}) for an eval run.

    Without a model the gemma demo model; a demo model (`demo:NAME`) brings
    its two texts, in-domain first, unless texts are given.
    """
    from mlx_lm import load

    from . import demo

    name = demo.demo_name(model_path)
    texts: dict[str, Path]
    if text_paths:
        texts = {Path(t).stem: Path(t) for t in text_paths}
    elif name is not None:
        texts = demo.demo_texts(name)
    else:
        raise ValueError("--text is required with --model (no evaluation text is known for it)")
    from .compute import prepare
    from .from_gguf import as_directory

    model, tokenizer = load(as_directory(demo.resolve_model(model_path)[0])[0])
    line = prepare(model, dtype).line()
    if line is not None:
        print(f"mlx-kvq: {line}", file=sys.stderr)
    out = {}
    for name, path in texts.items():
        text = Path(path).read_text()
        # The whole text is tokenized at once: silence the "longer than the
        # model's maximum length" warning (windows are cut afterwards).
        inner = getattr(tokenizer, "_tokenizer", tokenizer)
        if hasattr(inner, "model_max_length"):
            inner.model_max_length = max(inner.model_max_length or 0, len(text) + 1)
        ids = tokenizer.encode(text)
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None or not ids or ids[0] != bos:
            bos = None
        out[name] = (ids, bos)
    return model, tokenizer, out

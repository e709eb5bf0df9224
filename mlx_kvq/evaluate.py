"""Output quality under KV quantization: perplexity, KL and top-1 agreement.

A held-out text is cut into windows of `context` tokens. Each window is fed
through the model `chunk` tokens at a time, as prefill runs in generation, so
the caches (sliding windows included) and the quantized attention are
exercised exactly as they are when serving, never in one full forward pass.
Every window runs twice in lock step, chunk by chunk: once with mlx-lm's own
unquantized caches, once with the requested KV settings. Every position's
next-token distribution is scored:

- perplexity of the text under each run, and its relative change,
- mean KL divergence KL(unquantized || quantized) of the next-token
  distributions (nats per token),
- top-1 agreement: how often both runs rank the same token first.

`evaluate` measures one setting; `evaluate_many` measures several against one
shared unquantized run (`mlx-kvq eval` is `mlx_kvq/commands/eval.py`). With
no model given, the embedded demo model and its held-out text are used.
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
from mlx_lm.models import cache as mlx_cache

from .config import KVConfig
from .generate import get_plan

DEFAULT_CONTEXT = 512
DEFAULT_CHUNK = 32
DEFAULT_WINDOWS = 4


# -- measurement ----------------------------------------------------------------
def window_starts(n_tokens: int, context: int, windows: int) -> list[int]:
    """Start offsets of `windows` windows of `context` tokens spread evenly
    over `n_tokens` (overlapping only when the text is too short)."""
    if n_tokens <= context or windows <= 1:
        return [0]
    last = n_tokens - context
    starts = sorted({round(i * last / (windows - 1)) for i in range(windows)})
    return starts


def _windows(tokens: Sequence[int], context: int, windows: int, bos: int | None) -> list[list[int]]:
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


def _make_cache(model: nn.Module, cfg: KVConfig) -> list:
    if not cfg.enabled:
        return mlx_cache.make_prompt_cache(model, max_kv_size=cfg.max_kv_size)
    return get_plan(model, cfg).make_cache()


def _log_probs(model: nn.Module, x: mx.array, cache: list) -> mx.array:
    logits = model(x, cache=cache)
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _storage_cost(model: nn.Module, cfg: KVConfig, context: int) -> dict:
    """Bits per stored element (scales, biases and any full-precision tokens
    counted, relative to a 16-bit element) and bytes per token at `context`."""
    if not cfg.enabled:
        return {"bits_per_element": 16.0, "kv_bytes": None, "kv_ratio": 1.0}
    est = get_plan(model, cfg).estimate(context)
    return {
        "bits_per_element": 16.0 * est["ratio"],
        "kv_bytes": est["bytes"],
        "kv_fp16_bytes": est["fp16_bytes"],
        "kv_ratio": est["ratio"],
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
) -> list[dict]:
    """Measure every setting in `kv_configs` against one unquantized run.

    `baseline` is the reference setting (default: mlx-lm's own unquantized
    caches, with the first config's `max_kv_size`). The last `decode`
    positions of every window are fed one token at a time, as in decoding
    (in-place ring writes, one-query masks). Returns one result dict per
    setting (see `evaluate`).
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

    wins = _windows(tokens, context, windows, bos)
    n_chunks = sum(len(_spans(len(w) - 1, chunk, decode)) for w in wins)
    if progress is None:
        progress = sys.stderr.isatty()
    from tqdm import tqdm

    bar = tqdm(total=n_chunks, desc="eval", unit="chunk", disable=not progress, leave=False)
    zero = lambda: mx.array(0.0, mx.float32)  # noqa: E731
    base_nll = zero()
    stats = [{"nll": zero(), "kl": zero(), "kl_max": zero(), "agree": zero()} for _ in cfgs]
    scored = 0
    deltas: list[list[float]] = [[] for _ in cfgs]  # per window: mean nll change per token
    t0 = time.perf_counter()
    for w in wins:
        before = [base_nll.item(), *(st["nll"].item() for st in stats)]
        ids = mx.array(w)
        n = len(w) - 1  # positions with a next token to predict
        base_cache = _make_cache(model, base_cfg)
        caches = [_make_cache(model, c) for c in cfgs]
        for s, e in _spans(n, chunk, decode):
            x = ids[None, s:e]
            y = ids[s + 1 : e + 1]
            lp_b = _log_probs(model, x, base_cache)[0]
            nll_b = -mx.take_along_axis(lp_b, y[:, None], axis=-1)[:, 0]
            top_b = mx.argmax(lp_b, axis=-1)
            p_b = mx.exp(lp_b)
            base_nll = base_nll + nll_b.sum()
            outs = [base_nll, base_cache]
            for c, st in zip(caches, stats, strict=True):
                lp_q = _log_probs(model, x, c)[0]
                kl = (p_b * (lp_b - lp_q)).sum(axis=-1)
                st["nll"] = st["nll"] - mx.take_along_axis(lp_q, y[:, None], axis=-1)[:, 0].sum()
                st["kl"] = st["kl"] + kl.sum()
                st["kl_max"] = mx.maximum(st["kl_max"], kl.max())
                st["agree"] = (
                    st["agree"] + (mx.argmax(lp_q, axis=-1) == top_b).astype(mx.float32).sum()
                )
                outs.extend([st, c])
            mx.eval(outs)
            scored += e - s
            bar.update(1)
        base_w = base_nll.item() - before[0]
        for d, st, b in zip(deltas, stats, before[1:], strict=True):
            d.append((st["nll"].item() - b - base_w) / n)
    bar.close()
    seconds = time.perf_counter() - t0

    ppl_b = math.exp(base_nll.item() / scored)
    results = []
    for c, st, d in zip(cfgs, stats, deltas, strict=True):
        ppl = math.exp(st["nll"].item() / scored)
        # Standard error of the change, from its spread across windows.
        se = 0.0
        if len(d) > 1:
            mean = sum(d) / len(d)
            se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))
        results.append(
            {
                "setting": c.describe(),
                "kv_config": asdict(c),
                "context": max(len(w) for w in wins),
                "chunk": chunk,
                "decode": min(decode, max(len(w) for w in wins) - 1),
                "windows": len(wins),
                "tokens_scored": scored,
                "ppl_base": ppl_b,
                "ppl": ppl,
                "rel_ppl_change": ppl / ppl_b - 1.0,
                "rel_ppl_change_se": se * ppl / ppl_b,
                "kl_mean": st["kl"].item() / scored,
                "kl_max": st["kl_max"].item(),
                "top1": st["agree"].item() / scored,
                **_storage_cost(model, c, max(len(w) for w in wins)),
                "seconds": seconds,
            }
        )
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
) -> dict:
    """Quality of `kv_config` against unquantized caches on `tokens`.

    Returns a dict with `ppl_base` (unquantized), `ppl` (with `kv_config`),
    `rel_ppl_change` (ppl / ppl_base - 1) and `rel_ppl_change_se` (its
    standard error from the spread across windows; 0 with one window), `kl_mean` (mean KL(unquantized ||
    quantized) in nats per scored token), `kl_max`, `top1` (fraction of
    positions whose argmax agrees), `tokens_scored`, `windows`, the setting
    and its storage cost (`bits_per_element` counting scales and biases,
    `kv_bytes` and `kv_ratio` at `context` tokens).
    """
    return evaluate_many(
        model, tokens, [kv_config], context, chunk, windows, bos, progress=progress, decode=decode
    )[0]


# -- reports ---------------------------------------------------------------------
TABLE_HEADER = (
    "| setting | bits/elem | ppl unquantized | ppl quantized | rel. ppl change (± s.e.) "
    "| mean KL (nats) | top-1 agree |\n"
    "|---|---:|---:|---:|---:|---:|---:|"
)


def table_row(r: dict, label: str | None = None) -> str:
    return (
        f"| {label or r['setting']} | {r['bits_per_element']:.2f} | {r['ppl_base']:.4f} | "
        f"{r['ppl']:.4f} | {100 * r['rel_ppl_change']:+.3f}% ± {100 * r.get('rel_ppl_change_se', 0):.3f} | "
        f"{r['kl_mean']:.2e} | "
        f"{100 * r['top1']:.2f}% |"
    )


def format_table(results: Sequence[dict], labels: Sequence[str] | None = None) -> str:
    """A markdown table of results (one row per setting)."""
    rows = [table_row(r, labels[i] if labels else None) for i, r in enumerate(results)]
    return "\n".join([TABLE_HEADER, *rows])


def load_eval_inputs(model_path: str | None, text_path: Path | None):
    """(model, tokenizer, token ids, bos id or None) for an eval run."""
    from mlx_lm import load

    if model_path is None:
        from .demo import demo_model_path, heldout_path

        model_path, text_path = str(demo_model_path()), text_path or heldout_path()
    if text_path is None:
        raise ValueError("--text is required with --model (no held-out text is known for it)")
    model, tokenizer = load(model_path)
    text = Path(text_path).read_text()
    # The whole text is tokenized at once: silence the "longer than the
    # model's maximum length" warning (windows are cut afterwards).
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    if hasattr(inner, "model_max_length"):
        inner.model_max_length = max(inner.model_max_length or 0, len(text) + 1)
    ids = tokenizer.encode(text)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None or not ids or ids[0] != bos:
        bos = None
    return model, tokenizer, ids, bos

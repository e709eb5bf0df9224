"""Serving under a KV memory budget: how many sequences run at once, and how fast.

One budget for every KV setting (unquantized, 8-bit, 4-bit and the default
K4/V3 with rotation), sized by default to hold `budget_unquantized`
unquantized sequences; the same flood of `budget_requests` requests
(`budget_prompt` distinct random prompt tokens, `budget_tokens` generated,
no EOS) is submitted at once to mlx-kvq's engine in-process (no HTTP), which
admits them by bytes. Reported per setting: the sequences the budget holds
(from the plan), the most decoded together (measured), end-to-end generation
tokens/s (all generated tokens over the wall time from the first submission
to the last finish, prefill included: what the extra sequences buy),
decode tokens/s (generated tokens over the time mlx-lm's batch steps spent
decoding), and the most KV bytes held after any step against the budget.
Settings are measured in alternating order over `budget_repeats` rounds.
"""

from __future__ import annotations

import time

import mlx.core as mx

from .model_bench import build_model, free
from .serving_bench import BenchTokenizer, Completions, decode_totals
from .settings import BenchSettings
from .timing import Stat

SETTINGS = ("unquantized", "8-bit", "4-bit", "default")


def kv_setting(name: str, group_size: int):
    from ..config import KVConfig
    from ..defaults import DEFAULT_KV_CONFIG

    if name == "default":
        return DEFAULT_KV_CONFIG
    bits = None if name == "unquantized" else int(name.split("-")[0])
    return KVConfig(bits=bits, group_size=group_size)


def _flood(engine, n: int, settings: BenchSettings, vocab: int, seed: int) -> dict:
    """Submit `n` requests at once; wall time, generated tokens, decode time."""
    from ..engine import GenerationRequest, SamplingParams

    mx.random.seed(seed)
    prompts = mx.random.randint(1, vocab, (n, settings.budget_prompt)).tolist()
    ends = Completions(n)
    params = SamplingParams(max_tokens=settings.budget_tokens, temperature=0.0)
    metrics = engine.metrics
    d0, g0 = metrics.decode_time, metrics.gen_tokens
    metrics.max_batch_size = 0
    t0 = time.perf_counter()
    for p in prompts:
        engine.submit(GenerationRequest(p, params), ends.end)
    ends.wait("budget benchmark")
    wall = time.perf_counter() - t0
    return {
        "wall": wall,
        "tokens": ends.tokens,
        "decode_time": metrics.decode_time - d0,
        "decode_tokens": metrics.gen_tokens - g0,
        "at_once": metrics.snapshot().max_batch_size,
    }


def run(settings: BenchSettings, log=print) -> dict:
    from ..engine import Engine, EngineOptions, Shape
    from ..engine.budget import format_bytes, share_for
    from ..plan import plan_kv

    config = settings.resolved_model_config()
    dtype_name = settings.memory_dtype
    model = build_model(config, getattr(mx, dtype_name), settings.seed)
    vocab = config["vocab_size"]
    shape = Shape(settings.budget_prompt, settings.budget_prompt + settings.budget_tokens)
    concurrency = max(settings.budget_requests, 1)
    plans = {
        name: plan_kv(model, kv_setting(name, settings.group_size), batch=True) for name in SETTINGS
    }

    defaults = EngineOptions()

    def share(name: str, budget: int):
        return share_for(
            plans[name], budget, prefill_step=defaults.prefill_step_size,
            prompt_rows=defaults.prompt_concurrency,
        )  # fmt: skip

    budget = settings.budget_memory
    if budget is None:  # what `budget_unquantized` unquantized sequences need
        budget = share("unquantized", 0).cost.bound([shape] * settings.budget_unquantized)
    out = {
        "engine": "mlx_kvq.engine.Engine",
        "dtype": dtype_name,
        "budget": budget,
        "prompt": settings.budget_prompt,
        "tokens": settings.budget_tokens,
        "requests": settings.budget_requests,
        "rows": [],
    }
    engines: dict[str, Engine] = {}
    try:
        for name in SETTINGS:
            options = EngineOptions(
                decode_concurrency=concurrency, prompt_cache_size=0, kv_cache_memory=budget
            )
            engine = Engine(
                model, BenchTokenizer(vocab), plans[name], kv_setting(name, settings.group_size),
                options, metrics=decode_totals(),
            )  # fmt: skip
            engine.start()
            engine.readiness.ready_event.wait(timeout=3600)
            if not engine.readiness.ready:
                raise RuntimeError(f"budget benchmark: engine not ready ({name})")
            engines[name] = engine
        runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
        for r in range(settings.budget_repeats):
            for name in SETTINGS if r % 2 == 0 else reversed(SETTINGS):
                result = _flood(
                    engines[name], settings.budget_requests, settings, vocab, settings.seed + r
                )
                runs[name].append(result)
                log(
                    f"  round {r + 1} {name}: {result['at_once']} at once, "
                    f"{result['tokens'] / result['wall']:.1f} tok/s"
                )
        for name in SETTINGS:
            ledger = engines[name].budget
            row = {
                "setting": name,
                "label": ledger.share.cost.setting,
                "fits": share(name, budget).cost.sequences(budget, shape),
                "at_once": max(x["at_once"] for x in runs[name]),
                "tokens_per_s": Stat([x["tokens"] / x["wall"] for x in runs[name]]).to_dict(3),
                "decode_tokens_per_s": Stat(
                    [x["decode_tokens"] / x["decode_time"] for x in runs[name] if x["decode_time"]]
                ).to_dict(3),
                "peak_held": ledger.peak_held,
                "overruns": ledger.overruns,
                "preemptions": engines[name].metrics.snapshot().preemptions,
            }
            out["rows"].append(row)
            log(
                f"  budget {format_bytes(budget)} {dtype_name} {name:>11}: fits {row['fits']}, "
                f"{row['at_once']} at once, {row['tokens_per_s']['median']:.1f} tok/s "
                f"(decode {row['decode_tokens_per_s']['median']:.1f}), "
                f"peak {format_bytes(row['peak_held'])}"
            )
    finally:
        for engine in engines.values():
            engine.stop()
    del model, engines
    free()
    return out


def markdown(section: dict) -> list[str]:
    """The report's section: one row per KV setting."""
    from ..engine.budget import format_bytes

    rows = section["rows"]
    base = next((r for r in rows if r["setting"] == "unquantized"), None)
    lines = [
        "## Serving under a KV memory budget",
        "",
        f"{section['engine']} in-process, model dtype {section['dtype']}, one KV budget of "
        f"{format_bytes(section['budget'])} for every setting; {section['requests']} requests "
        f"submitted at once, each a {section['prompt']}-token prompt and {section['tokens']} "
        "generated tokens. Fits: whole sequences the budget holds at once (from the plan); at "
        "once: the most decoded together (measured; admitted by what they hold, they may "
        "outnumber whole ones, preempted when they grow past the budget); tokens/s: all generated tokens over the wall "
        "time from submission to the last finish, prefill included; decode tokens/s: generated "
        "tokens over the time mlx-lm's batch steps spent decoding (median, min-max over rounds).",
        "",
        "| setting | fits | at once | vs unquantized | tokens/s | vs unquantized "
        "| decode tokens/s | vs unquantized | most KV held | budget overruns | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tps, dec = r["tokens_per_s"], r["decode_tokens_per_s"]
        name = r["setting"] if r["label"] == r["setting"] else f"{r['setting']} ({r['label']})"
        rel_n = rel_t = rel_d = "-"
        if base and r is not base:
            rel_n = f"{r['at_once'] / max(base['at_once'], 1):.2f}x"
            rel_t = f"{tps['median'] / base['tokens_per_s']['median']:.2f}x"
            rel_d = f"{dec['median'] / base['decode_tokens_per_s']['median']:.2f}x"
        lines.append(
            f"| {name} | {r['fits']} | {r['at_once']} | {rel_n} | "
            f"{tps['median']:.1f} ({tps['min']:.1f}-{tps['max']:.1f}) | {rel_t} | "
            f"{dec['median']:.1f} ({dec['min']:.1f}-{dec['max']:.1f}) | {rel_d} | "
            f"{format_bytes(r['peak_held'])} | {r['overruns']} | {r.get('preemptions', 0)} |"
        )
    return lines + [""]

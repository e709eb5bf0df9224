"""Serving: aggregate generation tokens/s of the engine at N concurrent streams.

Runs mlx-kvq's serving engine (`mlx_kvq.engine.Engine`: mlx-lm's
`BatchGenerator` fed with the KV plan's caches, the path the HTTP server
uses) in-process, without HTTP. For each stream count, N requests with
distinct random prompts (no prompt-cache reuse) are submitted at once.
Aggregate generation tokens/s is wall-clock: the tokens generated after
every stream has its first token, over the time from that moment to the
last finish (decode only, all streams in the batch). mlx-lm's own decode
timer is kept in the JSON too; it times only the batch step call, so work
that the pipelined step leaves running past it is not counted. End-to-end
tokens/s is all generated tokens over the wall time from submission to the
last finish (prefill included).

Beside each engine figure, the same model's bare forward pass at batch N
(no engine, no scheduling, greedy tokens fed back, the same caches) gives
the ceiling that batching can reach on this backend: the engine's
efficiency is its figure over that ceiling. On a backend whose matrix
products are compute-bound already at batch 1 (MLX's CPU backend), the
ceiling itself grows far less than N-fold.
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx

from .model_bench import CacheMaker, build_model, free, label
from .settings import BenchSettings
from .timing import Stat, paired_ratio


class _Detokenizer:
    """Counts tokens; the benchmark never looks at text."""

    last_segment = ""

    def add_token(self, token: int) -> None:
        pass

    def finalize(self) -> None:
        pass

    def reset(self) -> None:
        pass


class BenchTokenizer:
    """The few tokenizer members the engine uses. No EOS: every request
    generates exactly its `max_tokens`."""

    eos_token_ids: list[int] = []

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [1 + ord(ch) % (self.vocab - 1) for ch in text]

    @property
    def detokenizer(self) -> _Detokenizer:
        return _Detokenizer()


def decode_totals():
    """Engine metrics that also keep running totals of decode work (mlx-lm's
    step timer), for the serving and budget sections."""
    from ..engine import EngineMetrics

    class DecodeTotals(EngineMetrics):
        def __init__(self):
            super().__init__()
            self.decode_time = 0.0
            self.gen_tokens = 0

        def record_step(self, prompt_tokens, prompt_time, gen_tokens, decode_time):
            self.decode_time += decode_time
            self.gen_tokens += gen_tokens
            super().record_step(prompt_tokens, prompt_time, gen_tokens, decode_time)

    return DecodeTotals()


class Completions:
    """Counts `n` requests' ends from the engine thread: generated tokens,
    errors, and an event set when the last one ends."""

    def __init__(self, n: int):
        self.left, self.tokens, self.errors = n, 0, []
        self.done = threading.Event()
        self._lock = threading.Lock()

    def end(self, event) -> None:
        from ..engine import ErrorEvent, FinishEvent

        if not isinstance(event, (FinishEvent, ErrorEvent)):
            return
        with self._lock:
            if isinstance(event, FinishEvent):
                self.tokens += event.usage.completion_tokens
            else:
                self.errors.append(event.message)
            self.left -= 1
            if self.left == 0:
                self.done.set()

    def wait(self, what: str) -> None:
        """Until every request ended; RuntimeError naming `what` on a failure."""
        if not self.done.wait(timeout=3600):
            raise RuntimeError(f"{what}: requests did not finish within an hour")
        if self.errors:
            raise RuntimeError(f"{what}: requests failed: {self.errors[:3]}")


def _run_once(engine, metrics, n: int, settings: BenchSettings, vocab: int, rng_seed: int) -> dict:
    from ..engine import GenerationRequest, SamplingParams, TokenEvent

    mx.random.seed(rng_seed)
    prompts = mx.random.randint(1, vocab, (n, settings.serving_prompt)).tolist()
    ends = Completions(n)
    token_times: list[list[float]] = [[] for _ in range(n)]

    def sink_for(i: int):
        def sink(event):
            if isinstance(event, TokenEvent):
                token_times[i].append(time.perf_counter())
            else:
                ends.end(event)

        return sink

    params = SamplingParams(max_tokens=settings.serving_tokens, temperature=0.0)
    d0, g0 = metrics.decode_time, metrics.gen_tokens
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(GenerationRequest(p, params), sink_for(i))
    ends.wait("serving benchmark")
    wall = time.perf_counter() - t0
    start = max(ts[0] for ts in token_times)
    end = max(ts[-1] for ts in token_times)
    after = sum(1 for ts in token_times for t in ts if t > start)
    return {
        "wall": wall,
        "tokens": ends.tokens,
        "decode_wall": end - start,
        "decode_tokens": after,
        "timer_decode_time": metrics.decode_time - d0,
        "timer_gen_tokens": metrics.gen_tokens - g0,
    }


def _forward_once(
    model, caches: list, n: int, settings: BenchSettings, vocab: int, seed: int
) -> float:
    """Generation tokens/s of the bare model at batch `n`: prefill the
    prompts, then `serving_tokens` greedy steps, pipelined as mlx-lm's
    generators do (step t+1 is built and queued before step t is awaited)."""
    mx.random.seed(seed)
    prompts = mx.random.randint(1, vocab, (n, settings.serving_prompt))

    def step(tokens: mx.array) -> mx.array:
        return mx.argmax(model(tokens, cache=caches)[:, -1:, :], axis=-1)

    y = step(prompts)
    mx.eval(y)
    t0 = time.perf_counter()
    for _ in range(settings.serving_tokens):
        next_y = step(y)
        mx.async_eval(next_y)
        mx.eval(y)
        y = next_y
    mx.eval(y)
    return n * settings.serving_tokens / (time.perf_counter() - t0)


def run(settings: BenchSettings, log=print) -> dict:
    from ..config import KVConfig
    from ..engine import Engine, EngineOptions
    from ..plan import plan_kv

    config = settings.resolved_model_config()
    dtype_name = settings.memory_dtype
    model = build_model(config, getattr(mx, dtype_name), settings.seed)
    vocab = config["vocab_size"]
    tokenizer = BenchTokenizer(vocab)
    out = {"engine": "mlx_kvq.engine.Engine", "dtype": dtype_name, "rows": []}
    configs = [None, *settings.serving_bits]
    engines: dict[str, tuple] = {}
    try:
        # One engine per cache setting, started (and warmed up) one after the
        # other; they then take turns, so only one computes at a time.
        for b in configs:
            kv = KVConfig(bits=b, group_size=settings.group_size)
            plan = plan_kv(model, kv, batch=True)
            metrics = decode_totals()
            options = EngineOptions(
                decode_concurrency=max(settings.streams),
                prompt_concurrency=max(settings.streams),
                prompt_cache_size=0,
            )
            engine = Engine(model, tokenizer, plan, kv, options, metrics=metrics)
            engines[label(b)] = (engine, metrics)
            engine.start()
            engine.readiness.ready_event.wait(timeout=3600)
            state = engine.readiness.get()
            if state.status != "ready":
                raise RuntimeError(
                    f"serving benchmark: engine not ready ({label(b)}): {state.reason}"
                )
        runs: dict[int, dict[str, list[dict]]] = {
            n: {name: [] for name in engines} for n in settings.streams
        }
        ceiling: dict[int, dict[str, list[float]]] = {
            n: {name: [] for name in engines} for n in settings.streams
        }
        bits_of = {label(b): b for b in configs}
        make_caches = CacheMaker(model, settings.group_size)
        names = list(engines)
        for r in range(settings.serving_repeats):
            for n in settings.streams:
                for name in names if r % 2 == 0 else reversed(names):
                    engine, metrics = engines[name]
                    seed = settings.seed + 1000 * r + n
                    runs[n][name].append(_run_once(engine, metrics, n, settings, vocab, seed))
                    caches = make_caches(bits_of[name])
                    ceiling[n][name].append(_forward_once(model, caches, n, settings, vocab, seed))
                    del caches
    finally:
        for engine, _ in engines.values():
            engine.stop()
    first = min(settings.streams)

    def gen_stat(n: int, name: str, wall: bool = True) -> Stat:
        t, k = (
            ("decode_wall", "decode_tokens") if wall else ("timer_decode_time", "timer_gen_tokens")
        )
        return Stat([x[k] / x[t] for x in runs[n][name] if x[t] > 0])

    for n in settings.streams:
        row: dict = {
            "streams": n,
            "generation_tps": {},
            "end_to_end_tps": {},
            "generation_ratio": {},
            "scaling": {},
            "model_forward_tps": {},
            "model_forward_scaling": {},
            "engine_efficiency": {},
        }
        for name, rs in runs[n].items():
            gen = gen_stat(n, name)
            forward = Stat(ceiling[n][name])
            row["generation_tps"][name] = gen.to_dict(3)
            row.setdefault("mlx_lm_timer_tps", {})[name] = gen_stat(n, name, wall=False).to_dict(3)
            row["end_to_end_tps"][name] = Stat([x["tokens"] / x["wall"] for x in rs]).to_dict(3)
            row["scaling"][name] = paired_ratio(gen, gen_stat(first, name)).to_dict(4)
            row["model_forward_tps"][name] = forward.to_dict(3)
            row["model_forward_scaling"][name] = paired_ratio(
                forward, Stat(ceiling[first][name])
            ).to_dict(4)
            row["engine_efficiency"][name] = paired_ratio(gen, forward).to_dict(4)
        for b in settings.serving_bits:
            row["generation_ratio"][label(b)] = paired_ratio(
                gen_stat(n, label(b)), gen_stat(n, label(None))
            ).to_dict(4)
        out["rows"].append(row)
        log(
            f"  serving {dtype_name} streams={n:3d}: generation "
            + "  ".join(f"{k} {v['median']:.1f}/s" for k, v in row["generation_tps"].items())
            + "  ratio "
            + " ".join(f"{k} {v['median']:.2f}x" for k, v in row["generation_ratio"].items())
            + f"  vs {first} stream(s) "
            + " ".join(f"{k} {v['median']:.2f}x" for k, v in row["scaling"].items())
            + "  bare forward "
            + "  ".join(f"{k} {v['median']:.1f}/s" for k, v in row["model_forward_tps"].items())
        )
    del model, engines
    free()
    return out

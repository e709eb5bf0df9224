"""Speculative decoding in `mlx-kvq serve`: correctness next to mlx_lm.server, speed,
and what a speculative request does to the others.

The model is the embedded demo model (gemma3_text, sliding windows of 128
tokens); the draft model is its own first 3 layers (a self-draft written to a
temporary directory: same tokenizer, about half the cost of a forward pass).

1. Correctness: one greedy request of `--tokens` tokens (its prompt plus
   answer run past the 128-token windows), speculative and plain, on
   `mlx-kvq serve --draft-model` (default quantized caches, and `--kv-bits
   0`) and on `mlx_lm.server` (`--draft-model`, and without); each
   speculative text is compared with plain decoding on the same server.
2. Speed, one request alone: speculative (the lane) against `draft_model:
   null` (the batch), interleaved rounds.
3. Interaction: one request starts alone (speculative, or plain), and
   `--background` plain requests arrive `--head-start` seconds later (the
   speculative sequence then moves into the batch): the tokens per second
   of the background requests and of the first one, against no first one.
4. Several draft requests at once: `--background` draft requests together
   (all in the batch: the engine is busy) against as many plain ones, and
   against mlx_lm.server --draft-model (which serves them one at a time).

Timings on a shared CPU are noisy: rounds are interleaved and medians of
per-request rates reported; compare ratios, not absolute numbers.

    python scripts/speculative_serving.py [--tokens 300] [--rounds 3] [--background 4]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvq_testing.server import MlxLmServerProcess, ServerProcess  # noqa: E402

PROMPT = "And God said unto Moses, Go in unto Pharaoh, and tell him, Thus saith the LORD God"


def self_draft(model: Path, out: Path, layers: int = 3) -> Path:
    """The first `layers` layers of `model` (gemma3_text) as a draft model directory."""
    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    cfg["layer_types"] = cfg["layer_types"][:layers]
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    weights = {}
    for f in model.glob("*.safetensors"):
        weights.update(mx.load(str(f)))
    kept = {
        k: v
        for k, v in weights.items()
        if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < layers
    }
    mx.save_safetensors(str(out / "model.safetensors"), kept, metadata={"format": "mlx"})
    return out


def complete(url: str, tokens: int, prompt: str = PROMPT, **extra) -> dict:
    t0 = time.monotonic()
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "default_model", "prompt": prompt, "max_tokens": tokens,
              "temperature": 0.0, **extra},
        timeout=3600,
    )  # fmt: skip
    r.raise_for_status()
    body = r.json()
    seconds = time.monotonic() - t0
    n = body["usage"]["completion_tokens"]
    return {"text": body["choices"][0]["text"], "tokens": n, "seconds": seconds, "tps": n / seconds}


def together(url: str, jobs: list[dict], tokens: int, head_start: float = 0.0) -> list[dict]:
    """Run requests concurrently, in order; each job is the extra fields of one
    request; the first starts `head_start` seconds before the others."""
    out: list[dict | None] = [None] * len(jobs)

    def run(i: int) -> None:
        out[i] = complete(url, tokens, f"{PROMPT} ({i})", **jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for i, t in enumerate(threads):
        t.start()
        time.sleep(head_start if i == 0 else 0.05)
    for t in threads:
        t.join()
    return out  # type: ignore[return-value]


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--background", type=int, default=4)
    parser.add_argument("--head-start", type=float, default=5.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--correctness-only", action="store_true")
    args = parser.parse_args()
    from mlx_kvq.demo import demo_model_path

    model = Path(demo_model_path())
    results: dict = {}
    null = {"draft_model": None}
    with tempfile.TemporaryDirectory() as tmp:
        draft = self_draft(model, Path(tmp) / "draft")

        # 1. correctness: each speculative text against plain decoding on the same server
        # (mlx-kvq's default KV caches are quantized, so its plain text is its own reference)
        pairs = {}
        for name, flags in (("mlx-kvq", []), ("mlx-kvq --kv-bits 0", ["--kv-bits", "0"])):
            with ServerProcess(model, "--draft-model", str(draft), *flags) as s:
                s.wait_ready()
                pairs[name] = (
                    complete(s.url, args.tokens)["text"],
                    complete(s.url, args.tokens, **null)["text"],
                )
        with MlxLmServerProcess(model) as s:
            s.wait_ready()
            plain = complete(s.url, args.tokens)["text"]
        with MlxLmServerProcess(model, "--draft-model", str(draft)) as s:
            s.wait_ready()
            pairs["mlx_lm.server"] = (complete(s.url, args.tokens)["text"], plain)
        pairs["mlx-kvq --kv-bits 0 against mlx_lm.server"] = (
            pairs["mlx-kvq --kv-bits 0"][0],
            plain,
        )
        results["correctness"] = {
            name: {"same": spec == ref, "first_difference_at_char": next(
                (i for i, (a, b) in enumerate(zip(spec, ref, strict=False)) if a != b), None)}
            for name, (spec, ref) in pairs.items()
        }  # fmt: skip
        print(json.dumps(results["correctness"], indent=1), flush=True)
        if args.correctness_only:
            print(json.dumps(results, indent=1))
            return 0

        # 2.-4. speed and interaction, mlx-kvq
        with ServerProcess(model, "--draft-model", str(draft)) as s:
            s.wait_ready()
            alone = {"speculative": [], "batch": []}
            inter = {"none": [], "speculative": [], "batch": []}
            extra_rate = {"speculative": [], "batch": []}
            many = {"draft": [], "plain": []}
            for _ in range(args.rounds):
                alone["speculative"].append(complete(s.url, args.tokens)["tps"])
                alone["batch"].append(complete(s.url, args.tokens, **null)["tps"])
                for case, first in (("none", []), ("speculative", [{}]), ("batch", [null])):
                    done = together(
                        s.url, first + [null] * args.background, args.tokens,
                        args.head_start if first else 0.0,
                    )  # fmt: skip
                    inter[case] += [d["tps"] for d in done[len(first) :]]
                    if first:
                        extra_rate[case].append(done[0]["tps"])
                for case, job in (("draft", {}), ("plain", null)):
                    done = together(s.url, [job] * args.background, args.tokens)
                    many[case].append(sum(d["tokens"] for d in done) / max(
                        d["seconds"] for d in done))  # fmt: skip
            m = s.metrics()
        with MlxLmServerProcess(model, "--draft-model", str(draft)) as s:
            s.wait_ready()
            mlx_lm_many = []
            for _ in range(args.rounds):
                done = together(s.url, [{}] * args.background, args.tokens)
                mlx_lm_many.append(sum(d["tokens"] for d in done) / max(
                    d["seconds"] for d in done))  # fmt: skip
        results["alone_tps"] = {k: median(v) for k, v in alone.items()}
        results["background_tps"] = {k: median(v) for k, v in inter.items()}
        results["first_request_tps"] = {k: median(v) for k, v in extra_rate.items()}
        results["together_total_tps"] = {
            f"mlx-kvq, {args.background} draft requests": median(many["draft"]),
            f"mlx-kvq, {args.background} plain requests": median(many["plain"]),
            f"mlx_lm.server --draft-model, {args.background} requests": median(mlx_lm_many),
        }
        results["metrics"] = {k: v for k, v in m.items() if "draft" in k}
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

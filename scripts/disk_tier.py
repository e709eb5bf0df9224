"""The prompt cache's disk tier on a real model: time to first token after a restart.

One long prompt (an agent's system prompt and tools are ~15,000 tokens;
SmolLM2's context is 8,192) is sent to a fresh engine with an empty
`--prompt-cache-dir` (cold: the whole prefill; the engine writes the
prompt's cache through to disk), then to another fresh engine on the same
directory (a restarted server: its prompt cache in memory is empty, the
prefix is read from disk). Rounds alternate cold and restart, each on its
own engine, in one process; the ratio is restart TTFT / cold TTFT per round.
`--drop-page-cache` asks the kernel to forget the files' pages before each
restart (posix_fadvise), so the restart reads from the disk, not from RAM.

Also reported: the bytes on disk per token of the prompt's chunk files
against what a float16 cache holds for the same tokens (the layers in
chunks: every full-attention layer), and the directory's bytes.

    nice -n 5 python scripts/disk_tier.py --model /work/models/smollm2-135m-f32 --tokens 8000
    nice -n 5 python scripts/disk_tier.py --model /work/models/gemma3-270m-f32 --tokens 15000
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from mlx_kvq.blas import use_fast_blas
from mlx_kvq.compute import prepare
from mlx_kvq.defaults import default_kv_config
from mlx_kvq.engine import Engine, EngineOptions, GenerationRequest, SamplingParams, TokenEvent
from mlx_kvq.engine.disk import DiskSettings
from mlx_kvq.engine.disk.records import read_header
from mlx_kvq.plan import has_bounded_layers, plan_kv

TEXT = Path("/usr/share/common-licenses/GPL-3")


class FirstToken:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.done = threading.Event()
        self.usage = None

    def __call__(self, event):
        if isinstance(event, TokenEvent) and self.first is None:
            self.first = time.perf_counter() - self.t0
        if hasattr(event, "usage") or hasattr(event, "message"):
            self.usage = getattr(event, "usage", event)
            self.done.set()


def run_once(
    model, tokenizer, plan, kv, prompt, directory: str, block_size: int
) -> tuple[FirstToken, str]:
    """One fresh engine on `directory` answering `prompt`: its first token's
    time, and the fingerprint its files carry."""
    options = EngineOptions(
        block_size=block_size or None, max_context=plan.max_context,
        disk=DiskSettings(directory, 20 << 30),
    )  # fmt: skip
    engine = Engine(model, tokenizer, plan, kv, options)
    engine.start()
    assert engine.readiness.ready_event.wait(600) and engine.readiness.ready, engine.state()
    sink = FirstToken()
    engine.submit(GenerationRequest(list(prompt), SamplingParams(max_tokens=4)), sink)
    assert sink.done.wait(3600), "the request never finished"
    engine.disk.flush()
    digest = engine.disk.directory.fp.digest
    engine.stop(60)
    return sink, digest


def drop_page_cache(directory: str) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_bytes(directory: str, fingerprint: str) -> tuple[int, int, int]:
    """(all record bytes, chunk file bytes, chunk data bytes)."""
    total = chunks = data = 0
    for root, _, files in os.walk(directory):
        for name in files:
            path = Path(root) / name
            if name.endswith((".kvc", ".kve")):
                total += path.stat().st_size
            if name.endswith(".kvc"):
                chunks += path.stat().st_size
                data += read_header(path, fingerprint)[0]["data_bytes"]
    return total, chunks, data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-bits", type=int, default=None, help="default: the model's default")
    ap.add_argument("--drop-page-cache", action="store_true")
    args = ap.parse_args()
    use_fast_blas()
    from mlx_lm import load

    model, tokenizer = load(args.model)
    prepare(model)
    if args.kv_bits is None:
        kv = default_kv_config(has_bounded_layers(model))
    else:
        from mlx_kvq.config import KVConfig

        kv = KVConfig(bits=args.kv_bits)
    plan = plan_kv(model, kv, batch=True)
    text = TEXT.read_text()
    ids = tokenizer.encode(text)
    prompt = (ids * (args.tokens // len(ids) + 1))[: args.tokens]
    print(
        f"model {args.model}, KV {kv.describe()}, prompt {len(prompt)} tokens, load {os.getloadavg()[0]:.1f}"
    )
    ratios = []
    for r in range(args.rounds):
        d = tempfile.mkdtemp(prefix="kvq-disk-")
        try:
            cold, digest = run_once(model, tokenizer, plan, kv, prompt, d, args.block_size)
            if args.drop_page_cache:
                drop_page_cache(d)
            warm, _ = run_once(model, tokenizer, plan, kv, prompt, d, args.block_size)
            ratio = warm.first / cold.first
            ratios.append(ratio)
            total, chunks, data = disk_bytes(d, digest)
            cached = warm.usage.cached_tokens
            print(
                f"round {r}: cold TTFT {cold.first:.2f}s, restart TTFT {warm.first:.3f}s "
                f"({cached} of {len(prompt)} prompt tokens read from disk): {ratio:.3f}x; "
                f"dir {total / 1e6:.1f} MB, chunk files {chunks / 1e6:.1f} MB ({data / 1e6:.1f} MB data)"
            )
            full = [p for p in plan.kv_layers if p.window is None]
            chunk_tokens = len(prompt) // 256 * 256
            fp16 = sum(p.bytes_per_token(False) / p.dtype_size * 2 for p in full) * chunk_tokens
            print(
                f"  chunk files per token: {chunks / chunk_tokens:.0f} bytes ({data / chunk_tokens:.0f} data), "
                f"float16 cache {fp16 / chunk_tokens:.0f}: {chunks / fp16:.4f}x ({data / fp16:.4f}x data)"
            )
        finally:
            shutil.rmtree(d, ignore_errors=True)
    print(f"restart / cold TTFT: median {statistics.median(ratios):.3f}x over {len(ratios)} rounds")


if __name__ == "__main__":
    main()

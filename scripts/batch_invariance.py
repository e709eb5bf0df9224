"""Whether a request's answer depends on the requests beside it or on the prompt cache.

    python scripts/batch_invariance.py --model /work/models/smollm2-135m-f32 \
      --setting '' --setting '--kv-bits 0'

Each setting's engine (in-process, the fast BLAS as the commands use it)
answers `--prompts` chat prompts (plain text for a base model) cut from
`--text` (windows of 100-300 words) one at a time on a fresh engine; then all at once on a fresh
engine, in order and reversed; then each again alone on that last engine,
whose prompt cache now holds every prompt. For each prompt and run it
prints whether the tokens equal the first run's, the first token where they
part, and the largest difference of the chosen token's log-probability
before it (0: bit-identical). `--temperature` with `--seed` checks seeded
sampling the same way. A difference says the results depend on how the
engine cuts a prompt into chunks (`runner.step`: every prompt of a step
takes the same number of tokens) or on where its prefix came from.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm import load  # noqa: E402

from mlx_kvq import use_fast_blas  # noqa: E402
from mlx_kvq.commands.flags import add_kv_flags, setting_namespaces  # noqa: E402
from mlx_kvq.commands.startup import kv_setting, model_source  # noqa: E402
from mlx_kvq.compute import prepare  # noqa: E402
from mlx_kvq.engine import Engine, EngineOptions, GenerationRequest, SamplingParams  # noqa: E402
from mlx_kvq.engine.requests import TokenEvent  # noqa: E402
from mlx_kvq.plan import plan_kv  # noqa: E402


class Answer:
    """The tokens of one request and the log-probability of each."""

    def __init__(self) -> None:
        self.tokens: list[tuple[int, float]] = []
        self.done = threading.Event()

    def __call__(self, event) -> None:
        if isinstance(event, TokenEvent):
            self.tokens.append((event.token, event.logprob))
        else:
            self.done.set()


def answers(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[Answer]:
    out = []
    for p in prompts:
        a = Answer()
        engine.submit(GenerationRequest(p, params), a)
        out.append(a)
    for a in out:
        a.done.wait()
    return out


def compare(alone: Answer, together: Answer) -> str:
    a, t = alone.tokens, together.tokens
    part = next((i for i, (x, y) in enumerate(zip(a, t, strict=False)) if x[0] != y[0]), None)
    seen = range(min(len(a), len(t)) if part is None else part)
    worst = max((abs(a[i][1] - t[i][1]) for i in seen), default=0.0)
    where = "equal" if part is None and len(a) == len(t) else f"part at token {part}"
    return f"{where}, max |d logprob| before {worst:.2e}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--setting", action="append", required=True, help="KV flags (repeat)")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=60)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    add_kv_flags(p)
    args = p.parse_args(argv)
    spaces = setting_namespaces(args.setting, args)
    source = model_source(args)
    use_fast_blas()
    model, tokenizer = load(args.model)
    prepare(model)
    words = Path(args.text).read_text().split()
    texts = [
        "Explain: " + " ".join(words[s : s + n])
        for i in range(args.prompts)
        for s, n in [((i * 997) % max(1, len(words) - 300), (100, 200, 300)[i % 3])]
    ]
    if tokenizer.chat_template:
        prompts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True
            )
            for t in texts
        ]
    else:  # a base model: the text itself
        prompts = [tokenizer.encode(t) for t in texts]
    print(f"prompts of {[len(x) for x in prompts]} tokens, {args.max_tokens} generated")
    params = SamplingParams(
        max_tokens=args.max_tokens, logprobs=True, temperature=args.temperature, seed=args.seed
    )
    alike_everywhere = 0
    for ns in spaces:
        cfg = kv_setting(ns, source, model)
        plan = plan_kv(model, cfg, batch=True)
        runs: dict[str, list[Answer]] = {}
        for name in ("alone", "together", "reversed"):
            engine = Engine(model, tokenizer, plan, cfg, EngineOptions())
            engine.start()
            try:
                engine.readiness.ready_event.wait()
                if name == "alone":
                    runs[name] = [answers(engine, [x], params)[0] for x in prompts]
                elif name == "together":
                    runs[name] = answers(engine, prompts, params)
                else:
                    runs[name] = answers(engine, prompts[::-1], params)[::-1]
                    runs["cached"] = [answers(engine, [x], params)[0] for x in prompts]
            finally:
                engine.stop()
        print(f"{cfg.describe()}:")
        every = 0
        for i, a in enumerate(runs["alone"]):
            parts = {name: compare(a, r[i]) for name, r in runs.items() if name != "alone"}
            same = all(x.startswith("equal") for x in parts.values())
            every += same
            print(f"  prompt {i}: " + "; ".join(f"{k} {v}" for k, v in parts.items()))
        print(f"  alike in every run: {every} of {len(prompts)}")
        alike_everywhere += every == len(prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())

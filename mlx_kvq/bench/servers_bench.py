"""Servers: `mlx-kvq serve` against `mlx_lm.server` over HTTP, on one real model.

Both servers run as processes on the same model directory and the same
BLAS, each recording the BLAS it bound (`server_process`: the arms, their
processes and readiness, shared with the agents section).

Startup is timed with each server alone on the machine, `server_starts`
times per server in an order that alternates (a server starting beside
another that holds its model loaded, even idle, started 1-2.5 s slower
here on Gemma 3 270M): the time to readiness is `/health` answering 200
for mlx-kvq and, for `mlx_lm.server` (whose `/health` answers while the
model still loads), its first completion answered; mlx-kvq's first answer
is recorded too. Then every server starts again (untimed), and the
scenarios run in rounds, the servers taking turns within a round in an
order that alternates between rounds, so that the machine's load falls on
every arm alike; every ratio is an arm's figure over `mlx_lm.server`'s in
the same round:

- `streams N`: N requests with distinct prompts sent at once, greedy,
  non-streaming; tokens/s is the completion tokens over the wall time from
  the first request sent to the last answer (prompt processing included:
  what a client sees);
- `mixed`: one long prompt beside several short ones, the same way;
- `long prompt`: time to the answer of one token (time to first token) for
  a long prompt never seen (cold), then for the same prompt again.

Every request goes to `/v1/completions` with a raw prompt (every model has
a tokenizer; not every model has a chat template). Prompts are cut from a
text by the model's tokenizer, at offsets distinct per request and round.
The answers' texts are compared between arms (greedy: a lossless setting
must say what `mlx_lm.server` says).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .server_process import (
    BASELINE,
    Answer,
    Server,
    arms,
    load_tokenizer,
    model_context,
    read_weights,
)
from .settings import BenchSettings
from .timing import Stat, format_spread, load_average, paired_ratio


@dataclass(frozen=True)
class Batch:
    """Requests sent at once: the wall time from the first sent to the last
    answered, and every answer in the order sent."""

    wall: float
    answers: tuple[Answer, ...]

    @property
    def completion_tokens(self) -> int:
        return sum(a.completion_tokens for a in self.answers)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall if self.wall > 0 else 0.0


def send_at_once(server: Server, prompts: list[str], max_tokens: int) -> Batch:
    """`prompts` sent together, one thread each; RuntimeError if any failed."""
    answers: list[Answer | None] = [None] * len(prompts)
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            answers[i] = server.complete(prompts[i], max_tokens)
        except Exception as e:  # noqa: BLE001 - reported below, naming the server
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{server.arm.name}: requests failed: {errors[:3]}\n{server.tail()}")
    return Batch(wall, tuple(answers))  # type: ignore[arg-type]


class Prompts:
    """Prompts of a given number of tokens, cut from a text by the model's
    tokenizer at distinct offsets (the text repeats if it is too short)."""

    def __init__(self, tokenizer, text: str):
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(tokenizer.encode(text))
        bos = getattr(tokenizer, "bos_token_id", None)
        if self.tokens and self.tokens[0] == bos:
            self.tokens = self.tokens[1:]
        self.next = 0

    def take(self, n: int) -> str:
        """The text of `n` tokens starting where the last one ended."""
        need = self.next + n
        while len(self.tokens) < need:
            self.tokens = self.tokens + self.tokens
        piece = self.tokens[self.next : need]
        self.next = need
        return self.tokenizer.decode(piece)


def _scenarios(settings: BenchSettings) -> list[tuple[str, list[int]]]:
    """(name, prompt lengths in tokens) of the throughput scenarios."""
    out = [(f"streams {n}", [settings.server_prompt] * n) for n in settings.server_streams]
    long, short, shorts = settings.server_mixed
    if long > 0:
        out.append((f"mixed 1x{long} + {shorts}x{short}", [long] + [short] * shorts))
    return out


def _read_text(settings: BenchSettings) -> str:
    if settings.server_text:
        return Path(settings.server_text).read_text(errors="replace")
    from ..demo import DEMO_HELDOUT, DEMO_MODERN

    return DEMO_MODERN.read_text() + "\n\n" + DEMO_HELDOUT.read_text()


def _check_lengths(settings: BenchSettings) -> None:
    """Refuse, before any server starts, a prompt longer than the model's
    context (`max_position_embeddings` in config.json): mlx-kvq serve answers
    it with a 400, and the run would end there after the other arms' work."""
    context = model_context(settings.server_model)
    long, short, shorts = settings.server_mixed
    for flag, tokens in (
        ("--server-long", settings.server_long + 1),
        ("--server-mixed", long + settings.server_tokens),
        ("--server-prompt", settings.server_prompt + settings.server_tokens),
    ):
        if context and tokens > context:
            raise ValueError(
                f"{flag}: {tokens} tokens (with the answer) exceed the model's context of "
                f"{context} tokens (max_position_embeddings); choose a shorter one"
            )


def run(settings: BenchSettings, log=print) -> dict:
    model = settings.server_model
    if not model:
        raise ValueError("the servers section needs a model: --model DIR (or FILE.gguf)")
    _check_lengths(settings)
    if settings.server_starts < 1:
        raise ValueError("--server-starts must be at least 1: startup is always timed")
    tokenizer = load_tokenizer(model)
    prompts = Prompts(tokenizer, _read_text(settings))
    read_weights(model)  # the same page cache for every start
    servers = [Server(arm, model) for arm in arms(settings.server_arms)]
    names = [s.arm.name for s in servers]
    warm = prompts.take(16)
    out: dict = {
        "model": model,
        "endpoint": "/v1/completions, greedy, non-streaming",
        "arms": {s.arm.name: s.arm.display(model) for s in servers},
        "load_average_start": load_average(),
    }  # fmt: skip
    scenarios = _scenarios(settings)
    tps: dict[str, dict[str, Stat]] = {name: {n: Stat() for n in names} for name, _ in scenarios}
    produced: dict[str, dict[str, int]] = {name: dict.fromkeys(names, 0) for name, _ in scenarios}
    texts: dict[str, list[str]] = {n: [] for n in names}
    prompt_tokens: dict[str, list[int]] = {n: [] for n in names}
    ttft = {kind: {n: Stat() for n in names} for kind in ("cold", "repeated")}
    ready = {n: Stat() for n in names}
    first = {n: Stat() for n in names}
    try:
        for k in range(settings.server_starts):
            for s in servers if k % 2 == 0 else servers[::-1]:
                s.start(warm)
                s.stop()
                ready[s.arm.name].samples.append(s.ready_s)
                first[s.arm.name].samples.append(s.first_answer_s)
                log(
                    f"  {s.arm.name}, alone: ready after {s.ready_s:.1f} s, first answer after "
                    f"{s.first_answer_s:.1f} s; BLAS {s.blas}"
                )
        for s in servers:
            s.start(warm)
        for r in range(settings.server_rounds):
            order = servers if r % 2 == 0 else servers[::-1]
            for name, lengths in scenarios:
                batch_prompts = [prompts.take(n) for n in lengths]
                for s in order:
                    b = send_at_once(s, batch_prompts, settings.server_tokens)
                    tps[name][s.arm.name].samples.append(b.tokens_per_s)
                    produced[name][s.arm.name] += b.completion_tokens
                    texts[s.arm.name] += [a.text for a in b.answers]
                    prompt_tokens[s.arm.name] += [a.prompt_tokens for a in b.answers]
                log(
                    f"  round {r + 1} {name}: "
                    + "  ".join(f"{n} {tps[name][n].samples[-1]:.1f}/s" for n in names)
                )
            if settings.server_long > 0:
                text = prompts.take(settings.server_long)
                for s in order:
                    cold = s.complete(text, 1)
                    again = s.complete(text, 1)
                    ttft["cold"][s.arm.name].samples.append(cold.seconds)
                    ttft["repeated"][s.arm.name].samples.append(again.seconds)
                log(
                    f"  round {r + 1} time to first token, {settings.server_long} tokens: "
                    + "  ".join(
                        f"{n} {ttft['cold'][n].samples[-1]:.2f} s / {ttft['repeated'][n].samples[-1]:.2f} s"
                        for n in names
                    )
                )
    finally:
        for s in servers:
            s.stop()
    base = names[0]
    out["startup"] = {
        s.arm.name: {
            "ready_s": ready[s.arm.name].median,
            "first_answer_s": first[s.arm.name].median,
            "ready": ready[s.arm.name].to_dict(2),
            "first_answer": first[s.arm.name].to_dict(2),
            "blas": s.blas,
        }
        for s in servers
    }
    out["readiness_ratio"] = {
        n: out["startup"][n]["ready_s"] / out["startup"][base]["ready_s"] for n in names[1:]
    }
    out["scenarios"] = []
    for name, lengths in scenarios:
        out["scenarios"].append(
            {
                "scenario": name,
                "requests": len(lengths),
                "prompt_tokens": lengths,
                "answer_tokens": settings.server_tokens,
                "completion_tokens": produced[name],
                "tokens_per_s": {n: tps[name][n].to_dict(3) for n in names},
                "ratio": {n: paired_ratio(tps[name][n], tps[name][base]).to_dict(4)
                          for n in names[1:]},
            }
        )  # fmt: skip
    if settings.server_long > 0:
        out["time_to_first_token"] = {
            "prompt_tokens": settings.server_long,
            **{
                kind: {
                    "seconds": {n: st[n].to_dict(3) for n in names},
                    "ratio": {n: paired_ratio(st[n], st[base]).to_dict(4) for n in names[1:]},
                }
                for kind, st in ttft.items()
            },
        }
    out["same_text"] = {
        a: {b: _agreement(texts[a], texts[b]) for b in names if b != a} for a in names
    }
    out["prompt_tokens_agree"] = all(prompt_tokens[n] == prompt_tokens[base] for n in names)
    out["load_average_end"] = load_average()
    _log_summary(out, names, log)
    return out


def _agreement(a: list[str], b: list[str]) -> dict:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    return {"same": same, "of": len(a)}


def _log_summary(out: dict, names: list[str], log) -> None:
    base = names[0]
    for n in names[1:]:
        log(
            f"  {n}: ready {out['startup'][n]['ready_s']:.1f} s vs {base}'s first answer "
            f"{out['startup'][base]['ready_s']:.1f} s: {out['readiness_ratio'][n]:.2f}x"
        )
    for sc in out["scenarios"]:
        log(
            f"  {sc['scenario']}: "
            + "  ".join(f"{n} {v['median']:.1f}/s" for n, v in sc["tokens_per_s"].items())
            + "  vs mlx_lm.server "
            + "  ".join(f"{n} {v['median']:.2f}x" for n, v in sc["ratio"].items())
        )
    t = out.get("time_to_first_token")
    if t:
        for kind in ("cold", "repeated"):
            log(
                f"  time to first token, {t['prompt_tokens']} tokens, {kind}: "
                + "  ".join(f"{n} {v['median']:.2f} s" for n, v in t[kind]["seconds"].items())
                + "  vs mlx_lm.server "
                + "  ".join(f"{n} {v['median']:.2f}x" for n, v in t[kind]["ratio"].items())
            )
    for n in names[1:]:
        s = out["same_text"][n][base]
        log(f"  {n}: {s['same']} of {s['of']} answers the same text as {base}")
    if not out["prompt_tokens_agree"]:
        log("  note: the servers counted different prompt tokens for the same prompts")


# -- goals and markdown -------------------------------------------------------------
# the stated serving goals, as ratios to mlx_lm.server in one run: (arm, scenario) -> at least
GOAL_TPS = {
    ("mlx-kvq default", "streams 1"): 1.0,
    ("mlx-kvq default", "streams 16"): 1.5,
    ("mlx-kvq --kv-bits 0", "streams 1"): 1.0,
    ("mlx-kvq --kv-bits 0", "streams 16"): 1.0,
    ("mlx-kvq default", "mixed"): 2.0,
}
GOAL_TTFT = {"cold": 1.0, "repeated": 0.5}  # at most, the default arm
GOAL_READINESS = 1.5  # at most: ready over mlx_lm.server's first answer


def goals(out: dict) -> list[dict]:
    """The stated goals this run measured, each with its value and whether met."""
    found: list[dict] = []
    for sc in out.get("scenarios", []):
        key = "mixed" if sc["scenario"].startswith("mixed") else sc["scenario"]
        for arm, r in sc["ratio"].items():
            want = GOAL_TPS.get((arm, key))
            if want is not None and r.get("median") is not None:
                found.append(
                    _goal(f"{arm} vs {BASELINE}, {sc['scenario']}, tokens/s", r["median"], want)
                )
    t = out.get("time_to_first_token")
    if t:
        for kind, want in GOAL_TTFT.items():
            r = t[kind]["ratio"].get("mlx-kvq default") or {}
            if r.get("median") is not None:
                found.append(
                    _goal(
                        f"mlx-kvq default vs {BASELINE}, time to first token, "
                        f"{t['prompt_tokens']}-token prompt, {kind}",
                        r["median"], want, at_most=True,
                    )
                )  # fmt: skip
    for arm, ratio in out.get("readiness_ratio", {}).items():
        if arm == "mlx-kvq default":
            found.append(
                _goal(
                    f"{arm} ready (/health 200) vs {BASELINE}'s first answer, from start",
                    ratio, GOAL_READINESS, at_most=True,
                )
            )  # fmt: skip
    return found


def _goal(name: str, value: float, target: float, at_most: bool = False) -> dict:
    met = value <= target if at_most else value >= target
    return {"goal": name, "value": value, "target": target, "at_most": at_most, "met": met}


def _header(first: str, unit: str, names: list[str], base: str) -> list[str]:
    """A table's header rows: `first`, each arm's figure in `unit`, each
    mlx-kvq arm's ratio to `base`."""
    cells = [first, *(f"{n} {unit}" for n in names), *(f"{n} / {base}" for n in names[1:])]
    return ["| " + " | ".join(cells) + " |", "|---|" + "---|" * (len(cells) - 1)]


def markdown(out: dict) -> list[str]:
    names = list(out["startup"])
    base = names[0]
    lines = [
        "## mlx-kvq serve against mlx_lm.server",
        "",
        f"Model `{out['model']}`; {out['endpoint']}; both servers on the BLAS recorded "
        "below; arms take turns within each round, in an order alternating between "
        f"rounds; load average {_loads(out.get('load_average_start'))} at the start, "
        f"{_loads(out.get('load_average_end'))} at the end. A ratio is the median of the "
        f"per-round ratios to {base} (min-max in parentheses).",
        "",
        f"Startup: each server alone, started {_times(out['startup'][base]['ready']['n'])}, "
        "in alternating order; medians (min-max).",
        "",
        "| arm | command | ready s | first answer s | BLAS |",
        "|---|---|---|---|---|",
    ]
    for n in names:
        st = out["startup"][n]
        lines.append(
            f"| {n} | `{out['arms'][n]}` | {format_spread(st['ready'])} "
            f"| {format_spread(st['first_answer'])} | {st['blas']} |"
        )
    lines += [
        "",
        f"Ready: `/health` 200 for mlx-kvq, the first completion answered for {base} "
        "(its `/health` answers while the model still loads).",
        "",
        *_header("scenario", "tok/s", names, base),
    ]
    for sc in out["scenarios"]:
        lines.append(
            f"| {sc['scenario']} ({sc['answer_tokens']} tokens each) | "
            + " | ".join(format_spread(sc["tokens_per_s"][n]) for n in names)
            + " | "
            + " | ".join(format_spread(sc["ratio"][n], "{:.2f}x") for n in names[1:])
            + " |"
        )
    t = out.get("time_to_first_token")
    if t:
        lines += [
            "",
            f"Time to first token (seconds to a one-token answer) on a "
            f"{t['prompt_tokens']}-token prompt never seen (cold), then the same prompt again:",
            "",
            *_header("prompt", "s", names, base),
        ]
        for kind in ("cold", "repeated"):
            lines.append(
                f"| {kind} | "
                + " | ".join(format_spread(t[kind]["seconds"][n], "{:.2f}") for n in names)
                + " | "
                + " | ".join(format_spread(t[kind]["ratio"][n], "{:.2f}x") for n in names[1:])
                + " |"
            )
    lines += ["", "Answers with the same text (greedy):", ""]
    for n in names[1:]:
        same = ", ".join(f"{m}: {v['same']} of {v['of']}" for m, v in out["same_text"][n].items())
        lines.append(f"- {n}: {same}")
    if not out.get("prompt_tokens_agree", True):
        lines.append("- the servers counted different prompt tokens for the same prompts")
    lines.append("")
    return lines


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def _loads(x) -> str:
    return "/".join(f"{v:.1f}" for v in x) if x else "-"

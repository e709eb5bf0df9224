"""Chat sessions that share a system prompt, sent at once to a server under a
tight KV budget: the scenario of agents (parallel subagents, clients
reconnecting after a restart) on a hybrid model.

A scripted hybrid model (`scripted.py`: sliding windows and full attention,
float32) answers every prompt with the same known text (`Sessions.answer`
tokens). Each session is one streaming `/v1/chat/completions` request with
`max_tokens` 32000: one system message shared by all (much longer than a
window) and a user message of its own. The budget is 1.5x what one whole
session holds plus what the others hold of their own, from the plan's
bytes per token (`Sessions.budget`). `send` sends them all at once and
reads the server's own counters after: served with the whole answer,
overruns, the most bytes held, the most decoding at once and the prompt
tokens computed. The test (tests/test_server_budget.py) runs it small; the
script (scripts/sessions_http.py) at any size.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .scripted import save_scripted_model

LETTERS = "abcdefghijklmnopqrstuvxyz"  # no "w", no digits: never a piece of the answer
WAIT_S = 600


@dataclass(frozen=True)
class Sessions:
    """The scenario's sizes."""

    sessions: int = 16
    system_tokens: int = 7700  # one token per byte of ordinary text (scripted.py's tokenizer)
    own_words: int = 40
    answer: int = 300  # tokens of the model's answer (then EOS)
    window: int = 128
    kv_heads: int = 4
    layers: int = 4  # sliding and full attention alternate
    max_tokens: int = 32000

    @property
    def pieces(self) -> list[str]:
        return [f"w{i:04d} " for i in range(self.answer)]

    @property
    def answer_text(self) -> str:
        return "".join(self.pieces)

    def save_model(self, path: str | Path) -> Path:
        """The scripted hybrid model that says `answer_text` to any prompt."""
        return save_scripted_model(
            path, {}, default=self.pieces, template="qwen3", arch="hybrid",
            window=self.window, kv_heads=self.kv_heads, layers=self.layers,
        )  # fmt: skip

    def conversations(self, seed: int = 51) -> list[list[dict[str, str]]]:
        """Each session's messages: the shared system message, its own user message."""
        rng = random.Random(seed)

        def words(n: int) -> list[str]:
            return ["".join(rng.choices(LETTERS, k=rng.randrange(2, 9))) for _ in range(n)]

        system = ""
        while len(system) < self.system_tokens:
            system += " ".join(words(50)) + ". "
        system = system[: self.system_tokens]
        return [
            [{"role": "system", "content": system},
             {"role": "user", "content": f"Session {i}: " + " ".join(words(self.own_words))}]
            for i in range(self.sessions)
        ]  # fmt: skip

    def texts(self, tokenizer: Any, seed: int = 51) -> list[str]:
        """Each session's plain prompt (`/v1/completions`, a model without a chat
        template): a shared text of at least `system_tokens` tokens, then
        `own_words` words of its own."""
        rng = random.Random(seed)

        def words(n: int) -> str:
            return " ".join("".join(rng.choices(LETTERS, k=rng.randrange(2, 9))) for _ in range(n))

        shared = ""
        while len(tokenizer.encode(shared)) < self.system_tokens:
            shared += words(50) + ". "
        return [f"{shared}\n\nSession {i}: {words(self.own_words)}" for i in range(self.sessions)]

    def prompts(self, tokenizer: Any, conversations: list[list[dict]]) -> list[list[int]]:
        """The sessions' prompts as the server renders them."""
        from mlx_kvq.engine.prompts import chat_tokens

        return [chat_tokens(tokenizer, c) for c in conversations]

    def plan_budget(self, plan: Any, prompts: list[list[int]]) -> int:
        """1.5x what one whole session holds (its prompt and answer), plus what
        each other session holds of its own (its tokens after the shared
        prefix, and its windows), at the plan's bytes per token: the quantized
        rows alone (a split layer's exact tail and a window's partly used
        blocks left out)."""
        shared = shared_prefix(prompts)
        one = _held(plan, len(prompts[0]) + self.answer)
        own = sum(
            _held(plan, len(p) + self.answer, len(p) - shared + self.answer) for p in prompts[1:]
        )
        return int(1.5 * one + own)

    def priced_budget(self, cost: Any, prompts: list[list[int]]) -> int:
        """The same as the KV budget prices sessions (`cost`: the server's
        `CostModel`): 1.5x one whole session decoding its last token, plus
        each other one less the shared prefix's whole blocks, which it maps."""
        from mlx_kvq.engine.budget import Shape

        per_block = sum(cost.block_bytes(s.key) for s in cost.slots if s.paged and not s.window)
        mapped = shared_prefix(prompts) // max(cost.block_size, 1) * per_block
        whole = [len(p) + self.answer for p in prompts]
        one = [cost.bound([Shape(n, n)], prompting=[]) for n in whole]
        return int(1.5 * one[0] + sum(b - mapped for b in one[1:]))


def shared_prefix(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with."""
    return min(len(_common(prompts[0], p)) for p in prompts[1:])


def _common(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _held(plan: Any, tokens: int, own: int | None = None) -> int:
    """Bytes a sequence of `tokens` tokens holds at the plan's bytes per token:
    every full-attention layer its tokens (`own` of them, the rest mapped
    from another), every window its size."""
    return sum(
        int(p.bytes_per_token() * ((tokens if own is None else own) if p.window is None
                                   else min(tokens, p.window)))
        for p in plan.kv_layers
    )  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    """What the server did with the sessions (its `/metrics` after them)."""

    sessions: int
    served: int  # with the whole answer and finish_reason "stop"
    errors: tuple[str, ...]
    overruns: float
    held_max: float
    budget: float
    decoding_at_once: float  # the largest batch since the counters were read before
    prompt_tokens: float  # prompt tokens computed for the sessions
    cached_tokens: float  # prompt tokens the prompt cache gave them
    preemptions: float

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "errors"} | {
            "errors": list(self.errors[:5])
        }


def chat_bodies(scenario: Sessions, conversations: list[list[dict]]) -> list[dict]:
    """The sessions as streaming `/v1/chat/completions` bodies, greedy."""
    return [
        {"model": "default_model", "messages": c, "max_tokens": scenario.max_tokens,
         "temperature": 0.0, "stream": True}
        for c in conversations
    ]  # fmt: skip


def text_bodies(scenario: Sessions, texts: list[str]) -> list[dict]:
    """The sessions as streaming `/v1/completions` bodies, greedy, each
    answering `answer` tokens at most."""
    return [
        {"model": "default_model", "prompt": t, "max_tokens": scenario.answer,
         "temperature": 0.0, "stream": True}
        for t in texts
    ]  # fmt: skip


def _stream(url: str, body: dict) -> tuple[str, str | None]:
    """One streaming (chat) completion: its text and finish reason."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    text, reason = [], None
    with httpx.stream("POST", url + path, json=body, timeout=WAIT_S) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
                reason = choice.get("finish_reason") or reason
    return "".join(text), reason


def send(server: Any, bodies: list[dict], answer: str | None = None) -> Outcome:
    """Send every body at once (the server idle and warm), wait for all, and
    read what the server counted. A session is served when it ends with
    `answer` and finish_reason "stop" (`answer` None: when it ends with
    "stop" or "length", having said something)."""
    before = server.metrics()
    results: dict[int, tuple[str, str | None] | Exception] = {}
    start = threading.Barrier(len(bodies))

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = _stream(server.url, bodies[i])
        except Exception as e:  # noqa: BLE001 - reported in the outcome
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    after = server.metrics()
    served, errors = 0, []
    for i in range(len(bodies)):
        got = results.get(i, RuntimeError("no answer"))
        if isinstance(got, Exception):
            errors.append(f"session {i}: {got}")
        elif got == (answer, "stop") or (
            answer is None and got[0] and got[1] in ("stop", "length")
        ):
            served += 1
        else:
            errors.append(f"session {i}: {got[1]} after {len(got[0])} characters")

    def delta(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    return Outcome(
        len(bodies), served, tuple(errors), after["mlx_kvq_kv_budget_overruns_total"],
        after["mlx_kvq_kv_bytes_held_max"], after["mlx_kvq_kv_cache_memory_bytes"],
        after["mlx_kvq_batch_size_max"], delta("mlx_kvq_prompt_tokens_total"),
        delta("mlx_kvq_prompt_cache_tokens_total"), delta("mlx_kvq_preemptions_total"),
    )  # fmt: skip

"""Agents: coding-agent sessions against `mlx_lm.server` and `mlx-kvq serve` over HTTP.

The workload of an agent that resends its whole, growing history every turn
(sizes are flags, defaults in `BenchSettings`):

- `agent_sessions` sessions at once, `agent_turns` turns each;
- one system prompt shared by every session: an agent's instructions and a
  tool list in JSON, as many whole lines and tools as fit in `agent_system`
  tokens;
- each turn adds a tool result (about `agent_tool_chars` characters of a
  Python source file: slices of the standard library's files, or of
  `agent_sources`, distinct per session and turn, the same in every run) and
  a short question; the server streams a greedy answer of up to
  `agent_tokens` tokens, which is appended to the history exactly as returned;
- from turn `agent_rewrite` on, each session's first tool result is replaced
  by a short placeholder, as agents clear old tool output (a history rewrite).

A model with a chat template gets `/v1/chat/completions` (a system message,
user messages with the tool result and the question, assistant messages with
the answers); one without (a base model) gets `/v1/completions` with the
history rendered as plain text in a fixed format (`User:` / `Assistant:`
turns after the system prompt). `agent_api` picks one explicitly.

The arms (`mlx_lm.server`, on the BLAS mlx-kvq binds, then one `mlx-kvq serve`
per entry of `agent_arms`) run one after the other in one run, each alone on
the machine: started, the workload, stopped. Per arm:

- wall time from the first request sent to the last answer;
- time to first token, client side: from a request sent to the first
  streamed chunk with text (or the finish), mean and p90 (nearest rank);
- prompt tokens sent, counted by the client with the model's tokenizer the
  way the servers count them (the chat template with the generation prompt,
  or the tokenizer on the text);
- tokens reused: `usage.prompt_tokens_details.cached_tokens`, asked for with
  `stream_options: {include_usage: true}` (None where a server reports none);
- tokens shared: for each request, the longest prefix its prompt shares with
  an earlier prompt of the run, or an earlier prompt followed by its answer
  (the answer's text tokenized alone, then the EOS token where the model
  stopped) when that answer was complete before this request was sent (the
  server's warm-up request included), at most the prompt's length less one
  (the last token is always computed): what a perfect prompt cache could
  reuse; summed;
- peak resident memory of the server process, sampled during the workload
  (psutil, else /proc), and its lifetime peak (VmHWM) where /proc has it;
- how many greedy answers equal `mlx_lm.server`'s;
- ratios against `mlx_lm.server` and against the `--kv-bits 0` arm.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np

from .server_process import (
    BASELINE,
    REQUEST_TIMEOUT_S,
    Arm,
    Server,
    arms,
    load_tokenizer,
    model_context,
    read_weights,
)
from .settings import BenchSettings
from .timing import load_average

UNQUANTIZED_FLAGS = ("--kv-bits", "0")
RSS_INTERVAL_S = 0.05
WARM_PROMPT = "def main():"
PLACEHOLDER = "[tool output cleared to save context]"

INSTRUCTIONS = (
    "You are a coding agent working in a Python repository on behalf of a developer.",
    "Work in small steps. Before you change a file, read the part you will change.",
    "Call one tool at a time and wait for its result before you call the next one.",
    "Keep answers short: say what you found and what you will do next.",
    "Never invent file contents, test results or command output: read or run them.",
    "Prefer the standard library. Do not add a dependency without asking the developer.",
    "When a test fails, read the failure, find the cause, and fix the cause, not the test.",
    "Follow the style of the code around your change: names, docstrings, type hints.",
    "Do not delete files or branches unless the developer asked for it in this session.",
    "If a request is unclear, ask one precise question instead of guessing.",
    "Tool results may be long. Quote only the lines you need in your answers.",
    "Older tool results may be cleared to save context; read the file again if needed.",
    "To call a tool, answer with one JSON object: "
    '{"tool": NAME, "arguments": {...}}, and nothing else.',
    "The tools you can call, as JSON (OpenAI function format):",
)

QUESTIONS = (
    "What does this code do? Answer in two sentences.",
    "Is there a bug in this code? Name the line if so.",
    "Which function here would you change to add logging, and why?",
    "Summarize the public names defined above.",
    "What would you test first in this code?",
    "Suggest a clearer name for one function above.",
    "Does this code handle errors well? Say briefly.",
    "What does the next step of the task need from this file?",
)

# the tool list: every action on every object, then again with a version suffix
_OBJECTS = (
    ("file", "a file of the repository", "path"),
    ("directory", "a directory of the repository", "path"),
    ("symbol", "a function, class or variable of the code", "name"),
    ("test", "a test of the suite", "node_id"),
    ("branch", "a git branch", "name"),
    ("commit", "a git commit", "sha"),
    ("issue", "an issue of the project's tracker", "number"),
    ("package", "an installed Python package", "name"),
    ("process", "a process the agent started", "pid"),
    ("note", "a note in the agent's scratch pad", "title"),
)
_ACTIONS = (
    ("read", "Return the contents of", {
        "start_line": ("integer", "first line to return, 1-based (default 1)"),
        "end_line": ("integer", "last line to return (default: the end)"),
    }),
    ("list", "List the entries matching a pattern, of", {
        "pattern": ("string", "a glob pattern the entries must match"),
    }),
    ("search", "Search for text in", {
        "query": ("string", "the text or regular expression to look for"),
        "limit": ("integer", "the most matches to return (default 50)"),
    }),
    ("create", "Create", {
        "content": ("string", "the full content of the new entry"),
    }),
    ("update", "Change", {
        "content": ("string", "the new content"),
        "reason": ("string", "one sentence the developer will read in the log"),
    }),
    ("delete", "Delete", {
        "reason": ("string", "why it must go; deletions are confirmed by the developer"),
    }),
)  # fmt: skip


class Api(Enum):
    """How the history reaches the server."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


# -- the workload ----------------------------------------------------------------------
def tool(k: int) -> dict:
    """The k-th tool of the list (OpenAI function format)."""
    rounds, i = divmod(k, len(_OBJECTS) * len(_ACTIONS))
    obj, what, key = _OBJECTS[i % len(_OBJECTS)]
    action, verb, extra = _ACTIONS[i // len(_OBJECTS)]
    suffix = f"_v{rounds + 1}" if rounds else ""
    props = {key: {"type": "string", "description": f"which {obj}: {what}"}}
    props |= {name: {"type": t, "description": d} for name, (t, d) in extra.items()}
    return {
        "type": "function",
        "function": {
            "name": f"{action}_{obj}{suffix}",
            "description": f"{verb} {what}.",
            "parameters": {"type": "object", "properties": props, "required": [key]},
        },
    }


def _render_system(lines: int, tools: int) -> str:
    text = "\n".join(INSTRUCTIONS[:lines])
    if tools:
        text += "\n[" + ",\n ".join(json.dumps(tool(k)) for k in range(tools)) + "]"
    return text


def system_prompt(tokenizer, target: int) -> tuple[str, int, int]:
    """(text, its tokens, tools listed): the instructions' lines, then whole
    tools, as many as fit in `target` tokens (at least one line)."""

    def units(n: int) -> tuple[int, int]:
        return min(n, len(INSTRUCTIONS)), max(0, n - len(INSTRUCTIONS))

    def size(n: int) -> int:
        return len(tokenizer.encode(_render_system(*units(n)), add_special_tokens=False))

    lo, hi = 1, len(INSTRUCTIONS) + 1
    while size(hi) <= target:  # grow the bound until past the target
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # the largest n with size(n) <= target (n = 1 at the least)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= target else (lo, mid)
    text = _render_system(*units(lo))
    return text, size(lo), units(lo)[1]


@dataclass(frozen=True)
class ToolResult:
    """A slice of a source file, as a read_file tool returned it."""

    name: str
    first_line: int
    last_line: int
    source: str

    def call(self) -> str:
        return f'read_file(path="{self.name}", start_line={self.first_line}, end_line={self.last_line})'

    def text(self) -> str:
        return f"Tool result of {self.call()}:\n```python\n{self.source}\n```"

    def cleared(self) -> str:
        return f"Tool result of {self.call()}: {PLACEHOLDER}"


def source_files(folder: str | None, chars: int) -> list[tuple[str, str]]:
    """(name, text) of the .py files of `folder` (the standard library by
    default) long enough for a slice from their second quarter, by name."""
    root = Path(folder) if folder else Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")):
        text = path.read_text(errors="replace")
        if len(text) >= 4 * chars:
            out.append((path.name, text))
    if not out:
        raise ValueError(
            f"--agent-sources: no .py file of {root} has {4 * chars} characters or more "
            "(four tool results' worth)"
        )
    return out


def tool_result(files: Sequence[tuple[str, str]], k: int, chars: int) -> ToolResult:
    """The k-th tool result: file k (mod the count), from a quarter into it
    (later slices of the same file further on), whole lines, about `chars`."""
    name, text = files[k % len(files)]
    start = (len(text) // 4 + (k // len(files)) * chars) % len(text)
    start = text.rfind("\n", 0, start) + 1  # the start of that line
    end = min(len(text), start + chars)
    cut = text.rfind("\n", start, end)
    if cut > start and end < len(text):
        end = cut
    first = text.count("\n", 0, start) + 1
    source = text[start:end]
    return ToolResult(name, first, first + source.count("\n"), source)


@dataclass(frozen=True)
class Workload:
    """What every arm is sent: the same system prompt, tool results and questions."""

    api: Api
    api_reason: str
    system: str
    system_tokens: int
    tools: int
    results: tuple[tuple[ToolResult, ...], ...]  # [session][turn]
    max_tokens: int
    rewrite: int  # 1-based turn from which the first tool result is cleared; 0: never
    sources: str

    @property
    def sessions(self) -> int:
        return len(self.results)

    @property
    def turns(self) -> int:
        return len(self.results[0])

    def user(self, session: int, turn: int, at: int) -> str:
        """Turn `turn`'s user message as sent at turn `at` (0-based both)."""
        r = self.results[session][turn]
        cleared = turn == 0 and 0 < self.rewrite <= at + 1
        body = r.cleared() if cleared else r.text()
        return f"{body}\n\n{QUESTIONS[(session + turn) % len(QUESTIONS)]}"

    def request(self, session: int, answers: Sequence[str]) -> dict:
        """The request body of the next turn of `session`, whose earlier turns
        were answered `answers`."""
        at = len(answers)
        users = [self.user(session, t, at) for t in range(at + 1)]
        body: dict = {
            "model": "default_model",
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.api is Api.CHAT:
            messages = [{"role": "system", "content": self.system}]
            for t, text in enumerate(users):
                messages.append({"role": "user", "content": text})
                if t < at:
                    messages.append({"role": "assistant", "content": answers[t]})
            body["messages"] = messages
        else:
            text = self.system
            for t, user in enumerate(users):
                text += f"\n\nUser: {user}\n\nAssistant:"
                if t < at:
                    text += answers[t]
            body["prompt"] = text
        return body


def prompt_ids(tokenizer, body: dict) -> list[int]:
    """The prompt's token ids as the servers count them: the chat template with
    the generation prompt, or the tokenizer on the text."""
    from ..engine.prompts import chat_tokens

    if "messages" in body:
        return chat_tokens(tokenizer, copy.deepcopy(body["messages"]))
    return list(tokenizer.encode(body["prompt"]))


def build_workload(settings: BenchSettings, tokenizer) -> Workload:
    from ..engine.prompts import has_chat_template

    templated = has_chat_template(tokenizer)
    if settings.agent_api == "auto":
        api = Api.CHAT if templated else Api.COMPLETIONS
        reason = "the model has a chat template" if templated else "the model has no chat template"
    else:
        api = Api.CHAT if settings.agent_api == "chat" else Api.COMPLETIONS
        reason = f"--agent-api {settings.agent_api}"
    system, system_tokens, tools = system_prompt(tokenizer, settings.agent_system)
    files = source_files(settings.agent_sources, settings.agent_tool_chars)
    results = tuple(
        tuple(
            tool_result(files, s * settings.agent_turns + t, settings.agent_tool_chars)
            for t in range(settings.agent_turns)
        )
        for s in range(settings.agent_sessions)
    )
    return Workload(
        api, reason, system, system_tokens, tools, results, settings.agent_tokens,
        settings.agent_rewrite, settings.agent_sources or "the Python standard library",
    )  # fmt: skip


def check_settings(settings: BenchSettings) -> None:
    """Refuse sizes that cannot make the workload (ValueError naming the flag)."""
    rewrite, turns = settings.agent_rewrite, settings.agent_turns
    if rewrite != 0 and not 2 <= rewrite <= turns:
        raise ValueError(
            f"--agent-rewrite {rewrite}: the turn that clears each session's first tool "
            f"result is one of turns 2 to {turns} (--agent-turns {turns}), or 0 for none"
        )
    if settings.agent_api not in ("auto", "chat", "completions"):
        raise ValueError(f"--agent-api {settings.agent_api}: choose auto, chat or completions")


def _check_context(workload: Workload, tokenizer, model: str) -> int:
    """The longest prompt the workload can reach (its last turn, every answer
    at `max_tokens`); ValueError if that and an answer exceed the model's context."""
    longest = 0
    for s in range(workload.sessions):
        body = workload.request(s, [""] * (workload.turns - 1))
        longest = max(longest, len(prompt_ids(tokenizer, body)))
    longest += (workload.turns - 1) * workload.max_tokens
    context = model_context(model)
    if context and longest + workload.max_tokens > context:
        raise ValueError(
            f"the agents workload reaches {longest + workload.max_tokens} tokens (its last "
            f"prompt and answer), past the model's context of {context} tokens "
            "(max_position_embeddings); choose fewer --agent-turns, a shorter --agent-system "
            "or --agent-tool-chars"
        )
    return longest


# -- one request, one session, one arm ---------------------------------------------------
@dataclass(frozen=True)
class Exchange:
    """One request of one session as the client saw it (seconds from the arm's start)."""

    session: int
    turn: int
    body: dict
    sent: float
    first_token: float  # seconds after `sent`
    done: float
    answer: str
    finish_reason: str | None
    usage: dict | None


def stream(url: str, body: dict, t0: float) -> tuple[float, float, str, str | None, dict | None]:
    """Send `body` and read its stream: (seconds to the first chunk with text or
    the finish, done at (from `t0`), answer, finish reason, usage)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    sent = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    usage: dict | None = None
    finish: str | None = None
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as r:
            for raw in r:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, ": keepalive" comments
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if chunk.get("error"):
                    raise RuntimeError(f"error event: {chunk['error']}")
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    parts.append(text)
                    finish = choice.get("finish_reason") or finish
                    if first is None and (text or finish):
                        first = time.perf_counter() - sent
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read()[:500]!r}") from e
    done = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream ended without a token or a finish reason")
    return first, done - t0, "".join(parts), finish, usage


@dataclass(frozen=True)
class ArmRun:
    """What one arm's run measured, before the tokenizer counts it."""

    wall: float
    exchanges: tuple[Exchange, ...]  # in the order sent
    peak_rss: int | None
    lifetime_peak_rss: int | None
    load_average: tuple[list[float] | None, list[float] | None]


def run_sessions(server: Server, workload: Workload) -> tuple[float, list[Exchange]]:
    """Every session at once, one thread each, turn after turn; (wall seconds,
    the exchanges in the order sent). RuntimeError naming the arm if any failed."""
    url = server.url + workload.api.value
    exchanges: list[Exchange] = []
    errors: list[str] = []
    lock = threading.Lock()
    t0 = time.perf_counter()

    def session(s: int) -> None:
        answers: list[str] = []
        try:
            for t in range(workload.turns):
                body = workload.request(s, answers)
                sent = time.perf_counter() - t0
                first, done, answer, finish, usage = stream(url, body, t0)
                with lock:
                    exchanges.append(Exchange(s, t, body, sent, first, done, answer, finish, usage))
                answers.append(answer)
        except Exception as e:  # noqa: BLE001 - reported below, naming the server
            errors.append(f"session {s}, turn {len(answers) + 1}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=session, args=(s,)) for s in range(workload.sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{server.arm.name}: requests failed: {errors[:3]}\n{server.tail()}")
    return wall, sorted(exchanges, key=lambda e: e.sent)


def _rss(pid: int) -> int | None:
    """Resident bytes of `pid` now (psutil, else /proc), None where neither answers."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        return _proc_status(pid, "VmRSS")
    except Exception:  # noqa: BLE001 - the process may have gone
        return None


def _proc_status(pid: int, key: str) -> int | None:
    """A `kB` line of /proc/PID/status in bytes (VmRSS, VmHWM), None without /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakRss:
    """The largest resident set of a process, sampled on a thread while in use."""

    def __init__(self, pid: int, interval_s: float = RSS_INTERVAL_S):
        self.pid = pid
        self.interval_s = interval_s
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            rss = _rss(self.pid)
            if rss is not None:
                self.peak = max(self.peak or 0, rss)
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        rss = _rss(self.pid)  # one last sample after the last answer
        if rss is not None:
            self.peak = max(self.peak or 0, rss)


def run_arm(arm: Arm, model: str, workload: Workload, log=print) -> tuple[ArmRun, Server]:
    """Start `arm`'s server, run the workload on it, stop it."""
    server = Server(arm, model)
    try:
        server.start(WARM_PROMPT)
        log(f"  {arm.name}: ready after {server.ready_s:.1f} s; BLAS {server.blas}")
        load_start = load_average()
        with PeakRss(server.pid) as rss:
            wall, exchanges = run_sessions(server, workload)
        lifetime = _proc_status(server.pid, "VmHWM")
        return ArmRun(
            wall, tuple(exchanges), rss.peak, lifetime, (load_start, load_average())
        ), server
    finally:
        server.stop()


# -- counting ----------------------------------------------------------------------------
def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True)
class Sent:
    """A request as the shared-prefix count sees it: ids, and times from the run's start."""

    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    sent: float
    done: float


def tokens_shared(requests: Sequence[Sent]) -> list[int]:
    """For each request (in the order sent), the longest prefix its prompt
    shares with an earlier request's prompt, or with that prompt followed by
    its answer when the answer was complete before this request was sent; at
    most the prompt's length less one (a server computes the last token)."""
    prompts = [np.asarray(r.prompt, dtype=np.int64) for r in requests]
    answered = [np.asarray(r.prompt + r.answer, dtype=np.int64) for r in requests]
    out = []
    for i, r in enumerate(requests):
        best = 0
        for j in range(i):
            earlier = answered[j] if requests[j].done <= r.sent else prompts[j]
            best = max(best, common_prefix(prompts[i], earlier))
        out.append(min(best, max(0, len(r.prompt) - 1)))
    return out


def answer_ids(tokenizer, exchange: Exchange) -> list[int]:
    """The answer as the server generated it, as near as a client can tell: its
    text tokenized alone, then the EOS token when the model stopped (a chat
    template renders it after the answer in the next prompt)."""
    ids = list(tokenizer.encode(exchange.answer, add_special_tokens=False))
    eos = getattr(tokenizer, "eos_token_id", None)
    if exchange.finish_reason == "stop" and eos is not None:
        ids.append(eos)
    return ids


def _p90(values: Sequence[float]) -> float:
    """The 90th percentile, nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def summarize(run: ArmRun, tokenizer, workload: Workload) -> dict:
    """One arm's figures: time, tokens sent, shared and reused, memory."""
    ids = [prompt_ids(tokenizer, e.body) for e in run.exchanges]
    answers = [answer_ids(tokenizer, e) for e in run.exchanges]
    # the server's warm-up request came first (it shares at least a BOS token)
    warm = Sent(tuple(tokenizer.encode(WARM_PROMPT)), (), -math.inf, -math.inf)
    sent = [
        Sent(tuple(p), tuple(a), e.sent, e.done)
        for p, a, e in zip(ids, answers, run.exchanges, strict=True)
    ]
    shared = tokens_shared([warm, *sent])[1:]
    cached = [
        ((e.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        for e in run.exchanges
    ]
    reported = [c for c in cached if c is not None]
    server_prompt = [(e.usage or {}).get("prompt_tokens") for e in run.exchanges]
    ttft = [e.first_token for e in run.exchanges]
    requests = [
        {
            "session": e.session + 1, "turn": e.turn + 1, "sent_s": round(e.sent, 3),
            "first_token_s": round(e.first_token, 3), "done_s": round(e.done, 3),
            "prompt_tokens": len(p), "server_prompt_tokens": sp, "shared": sh, "cached": c,
            "completion_tokens": (e.usage or {}).get("completion_tokens"),
            "finish_reason": e.finish_reason, "answer": e.answer,
        }
        for e, p, sp, sh, c in zip(run.exchanges, ids, server_prompt, shared, cached, strict=True)
    ]  # fmt: skip
    by_turn = []
    for t in range(workload.turns):
        rows = [r for r in requests if r["turn"] == t + 1]
        by_turn.append(
            {
                "turn": t + 1,
                "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
                "shared": sum(r["shared"] for r in rows),
                "cached": sum(r["cached"] or 0 for r in rows) if reported else None,
            }
        )
    total_shared = sum(shared)
    total_cached = sum(reported) if reported else None
    return {
        "wall_s": round(run.wall, 3),
        "requests": len(run.exchanges),
        "ttft_mean_s": round(statistics.fmean(ttft), 3),
        "ttft_p90_s": round(_p90(ttft), 3),
        "ttft_max_s": round(max(ttft), 3),
        "prompt_tokens": sum(len(p) for p in ids),
        "longest_prompt": max(len(p) for p in ids),
        "server_prompt_tokens": sum(x for x in server_prompt if x is not None),
        "prompt_tokens_agree": all(x == len(p) for x, p in zip(server_prompt, ids, strict=True)),
        "shared_tokens": total_shared,
        "cached_tokens": total_cached,
        "cached_reported": len(reported),
        "reused_of_shared": (
            total_cached / total_shared if total_cached is not None and total_shared else None
        ),
        "completion_tokens": sum(r["completion_tokens"] or 0 for r in requests),
        "peak_rss_bytes": run.peak_rss,
        "lifetime_peak_rss_bytes": run.lifetime_peak_rss,
        "load_average": {"start": run.load_average[0], "end": run.load_average[1]},
        "by_turn": by_turn,
        "requests_detail": requests,
    }


def same_answers(arm: dict, base: dict) -> dict:
    """How many of `arm`'s answers equal `base`'s for the same session and turn."""
    theirs = {(r["session"], r["turn"]): r["answer"] for r in base["requests_detail"]}
    same = sum(theirs.get((r["session"], r["turn"])) == r["answer"] for r in arm["requests_detail"])
    return {"same": same, "of": len(arm["requests_detail"])}


def ratios(arm: dict, other: dict) -> dict:
    """`arm` against `other`: wall as a speed-up (other's over arm's: above 1
    is faster), time to first token and peak memory as arm's over other's."""

    def over(a, b):
        return a / b if a is not None and b else None

    return {
        "wall_speedup": over(other["wall_s"], arm["wall_s"]),
        "ttft_mean": over(arm["ttft_mean_s"], other["ttft_mean_s"]),
        "ttft_p90": over(arm["ttft_p90_s"], other["ttft_p90_s"]),
        "peak_rss": over(arm["peak_rss_bytes"], other["peak_rss_bytes"]),
    }


# -- the section -------------------------------------------------------------------------
def run(settings: BenchSettings, log=print) -> dict:
    model = settings.server_model
    if not model:
        raise ValueError("the agents section needs a model: --model DIR (or FILE.gguf)")
    check_settings(settings)
    tokenizer = load_tokenizer(model)
    workload = build_workload(settings, tokenizer)
    longest = _check_context(workload, tokenizer, model)
    read_weights(model)  # the same page cache for every start
    arm_list = arms(settings.agent_arms)
    log(
        f"  {workload.sessions} sessions x {workload.turns} turns on {workload.api.value} "
        f"({workload.api_reason}); system prompt {workload.system_tokens} tokens "
        f"({workload.tools} tools); prompts up to about {longest} tokens"
    )
    out: dict = {
        "model": model,
        "api": workload.api.value,
        "api_reason": workload.api_reason,
        "workload": {
            "sessions": workload.sessions, "turns": workload.turns,
            "system_tokens": workload.system_tokens, "tools": workload.tools,
            "tool_chars": settings.agent_tool_chars, "answer_tokens": workload.max_tokens,
            "rewrite_turn": workload.rewrite, "sources": workload.sources,
            "tool_results": [[f"{r.name}:{r.first_line}-{r.last_line}" for r in row]
                             for row in workload.results],
        },
        "arms": {},
    }  # fmt: skip
    for arm in arm_list:
        arm_run, server = run_arm(arm, model, workload, log)
        figures = summarize(arm_run, tokenizer, workload)
        figures |= {"command": arm.display(model), "flags": list(arm.flags), "blas": server.blas}
        out["arms"][arm.name] = figures
        log("  " + _line(arm.name, figures))
    base = out["arms"][BASELINE]
    unquantized = next(
        (a.name for a in arm_list if a.flags == UNQUANTIZED_FLAGS), None
    )  # the --kv-bits 0 arm, if run
    out["unquantized_arm"] = unquantized
    for arm in arm_list:
        figures = out["arms"][arm.name]
        figures["same_answers"] = same_answers(figures, base)
        figures["vs_baseline"] = ratios(figures, base)
        if unquantized:
            figures["vs_unquantized"] = ratios(figures, out["arms"][unquantized])
    for name, figures in out["arms"].items():
        if name != BASELINE:
            v = figures["vs_baseline"]
            s = figures["same_answers"]
            log(
                f"  {name}: {v['wall_speedup']:.2f}x {BASELINE}'s wall, time to first token "
                f"{v['ttft_mean']:.2f}x; {s['same']} of {s['of']} answers the same"
            )
    return out


def _line(name: str, f: dict) -> str:
    reused = "not reported" if f["cached_tokens"] is None else f"{f['cached_tokens']:,}"
    return (
        f"{name}: wall {f['wall_s']:.1f} s, first token {f['ttft_mean_s']:.2f} s mean / "
        f"{f['ttft_p90_s']:.2f} s p90, {f['prompt_tokens']:,} prompt tokens, "
        f"{f['shared_tokens']:,} shared, {reused} reused, peak RSS {_mib(f['peak_rss_bytes'])} MiB"
    )


# -- goals and markdown ------------------------------------------------------------------
GOAL_REUSED_OF_SHARED = 0.95  # every mlx-kvq arm: reused over shared, at least
GOAL_WALL_VS_BASELINE = 2.5  # the default arm: speed-up over mlx_lm.server, at least
GOAL_TTFT_VS_BASELINE = 0.2  # the default arm: mean time to first token, at most
GOAL_WALL_VS_UNQUANTIZED = 1.0  # the default arm: speed-up over --kv-bits 0, at least
DEFAULT_ARM = "mlx-kvq default"


def goals(out: dict) -> list[dict]:
    """The stated agent-workload goals this run measured, each with its value and whether met."""
    found: list[dict] = []
    for name, f in out["arms"].items():
        if name != BASELINE and f["reused_of_shared"] is not None:
            found.append(
                _goal(f"agents: {name}, tokens reused / tokens shared", f["reused_of_shared"],
                      GOAL_REUSED_OF_SHARED)
            )  # fmt: skip
    f = out["arms"].get(DEFAULT_ARM)
    if f:
        v = f["vs_baseline"]
        found.append(
            _goal(f"agents: {DEFAULT_ARM} vs {BASELINE}, wall time (speed-up)",
                  v["wall_speedup"], GOAL_WALL_VS_BASELINE)
        )  # fmt: skip
        found.append(
            _goal(f"agents: {DEFAULT_ARM} vs {BASELINE}, mean time to first token",
                  v["ttft_mean"], GOAL_TTFT_VS_BASELINE, at_most=True)
        )  # fmt: skip
        u = f.get("vs_unquantized")
        if u and out.get("unquantized_arm") != DEFAULT_ARM:
            found.append(
                _goal(f"agents: {DEFAULT_ARM} vs {out['unquantized_arm']}, wall time (speed-up)",
                      u["wall_speedup"], GOAL_WALL_VS_UNQUANTIZED)
            )  # fmt: skip
    return found


def _goal(name: str, value: float, target: float, at_most: bool = False) -> dict:
    met = value <= target if at_most else value >= target
    return {"goal": name, "value": value, "target": target, "at_most": at_most, "met": met}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def markdown(out: dict) -> list[str]:
    w = out["workload"]
    names = list(out["arms"])
    unq = out.get("unquantized_arm")
    rewrite = (
        f"from turn {w['rewrite_turn']} on, each session's first tool result is replaced by "
        "a placeholder"
        if w["rewrite_turn"]
        else "no history rewrite"
    )
    longest = max(f["longest_prompt"] for f in out["arms"].values())
    lines = [
        "## Agent sessions: mlx-kvq serve against mlx_lm.server",
        "",
        f"Model `{out['model']}`; `{out['api']}` ({out['api_reason']}), streamed, greedy. "
        f"{w['sessions']} sessions at once, {w['turns']} turns each; one shared system prompt "
        f"of {w['system_tokens']:,} tokens (an agent's instructions and {w['tools']} tools in "
        f"JSON); each turn a tool result of about {w['tool_chars']:,} characters of Python "
        f"({w['sources']}) and a question; answers of up to {w['answer_tokens']} tokens "
        f"appended as returned; {rewrite}. Prompts grew to {longest:,} tokens. The arms ran "
        "one after the other, each alone on the machine.",
        "",
        "| arm | wall s | vs mlx_lm.server | vs `--kv-bits 0` | first token mean / p90 s "
        "| vs mlx_lm.server | prompt tokens | shared | reused | reused / shared "
        "| peak RSS MiB | same answers as mlx_lm.server |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        f = out["arms"][n]
        v = f["vs_baseline"]
        u = f.get("vs_unquantized") or {}
        reused = "not reported" if f["cached_tokens"] is None else f"{f['cached_tokens']:,}"
        share = "-" if f["reused_of_shared"] is None else f"{f['reused_of_shared']:.0%}"
        base = n == BASELINE
        lines.append(
            f"| {n} | {f['wall_s']:.1f} | {'' if base else _x(v['wall_speedup'])} "
            f"| {'' if n == unq or not u else _x(u['wall_speedup'])} "
            f"| {f['ttft_mean_s']:.2f} / {f['ttft_p90_s']:.2f} "
            f"| {'' if base else _x(v['ttft_mean'])} | {f['prompt_tokens']:,} "
            f"| {f['shared_tokens']:,} | {reused} | {share} | {_mib(f['peak_rss_bytes'])} "
            f"| {'' if base else '{same} of {of}'.format(**f['same_answers'])} |"
        )
    lines += [
        "",
        "Wall: from the first request sent to the last answer; a ratio of walls is a "
        "speed-up (above 1: faster). First token: client side, from a request sent to the "
        "first streamed text; its ratio is the arm's over the other's (below 1: sooner). "
        "Prompt tokens: counted by the client with the model's tokenizer as the servers "
        "count them. Shared: for each request, the longest prefix its prompt shares with an "
        "earlier prompt, or an earlier prompt and its answer (at most its length less one): "
        "what a perfect prompt cache could reuse. Reused: "
        "`usage.prompt_tokens_details.cached_tokens`. Peak RSS: the server process, sampled "
        "during the workload.",
        "",
        "Reused / shared by turn (the prompt tokens of all sessions' requests of that turn):",
        "",
        "| turn | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for t in range(w["turns"]):
        cells = []
        for n in names:
            row = out["arms"][n]["by_turn"][t]
            cached = "-" if row["cached"] is None else f"{row['cached']:,}"
            cells.append(f"{cached} / {row['shared']:,} of {row['prompt_tokens']:,}")
        mark = " (rewrite)" if t + 1 == w["rewrite_turn"] else ""
        lines.append(f"| {t + 1}{mark} | " + " | ".join(cells) + " |")
    lines += ["", "| arm | command | BLAS | load average at start / end |", "|---|---|---|---|"]
    for n in names:
        f = out["arms"][n]
        loads = " / ".join(_loads(f["load_average"][k]) for k in ("start", "end"))
        lines.append(f"| {n} | `{f['command']}` | {f['blas']} | {loads} |")
    notes = [n for n in names if out["arms"][n]["cached_tokens"] is None]
    if notes:
        lines.append("")
        lines.append(f"- no `cached_tokens` reported by: {', '.join(notes)}")
    disagree = [n for n in names if not out["arms"][n]["prompt_tokens_agree"]]
    if disagree:
        lines.append(
            f"- the server counted other prompt tokens than the client for: {', '.join(disagree)}"
        )
    lines.append("")
    return lines


def _loads(x) -> str:
    return "/".join(f"{v:.1f}" for v in x) if x else "-"

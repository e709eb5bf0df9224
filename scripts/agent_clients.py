"""The real coding-agent CLIs against `mlx-kvq serve`: Claude Code and Codex.

Writes a scripted model (tests/kvq_testing/scripted.py, Qwen3-style template,
context raised to 131,072 tokens; see `script` for what it says), starts `mlx-kvq serve` on it with
an API key, then runs:

1. `claude -p` (Anthropic Messages, streamed, `?beta=true`, x-api-key) and
   a second turn with `claude -p --continue`: both must exit 0 and print the
   answer; the second turn's `cache_read_input_tokens` must be at least 90%
   of its prompt and its time to first token at most 10% of the first's
   (prefix reuse across turns, the billing-header block dropped); then a
   fresh `claude -p` whose answer is a call of its Read tool: Claude Code
   reads the file, sends the result back, and prints the final answer;
2. `codex exec` (OpenAI Responses, streamed, store false, function,
   namespace and hosted web_search tools) whose answer is a call of its
   exec_command tool: Codex runs `cat notes.txt`, sends the output back in
   the whole history, and prints the final answer (exit 0).

    python scripts/agent_clients.py [--npm-dir /work/agents-npm] [--claude-tools Read]
        [--skip-codex] [--json out.json] [-- extra mlx-kvq serve flags]

The CLIs come from npm (`npm install --prefix DIR @anthropic-ai/claude-code
@openai/codex`), never from this repository. `--claude-tools` is passed to
Claude Code's `--tools` (its full default set makes a ~77k-token prompt, on
this model's byte-level tokenizer; "default" sends it all). Each CLI runs
with a fresh HOME and no network but the server. Exit status 1 when a check
fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvq_testing.scripted import save_scripted_model  # noqa: E402
from kvq_testing.server import ServerProcess  # noqa: E402

ANSWER = "The secret word is mango."
TOOL_ANSWER = "The notes give the launch code."
NOTES = "The launch code is 7421.\n"


def script(work: Path) -> dict[str, list[str]]:
    """A plain answer, one tool call for each CLI's own tool (Claude Code's
    Read, Codex's exec_command), and the answer once a tool result is in the
    prompt (the template wraps it in <tool_response>, listed last so it wins)."""

    def call(name: str, arguments: dict) -> list[str]:
        body = json.dumps({"name": name, "arguments": arguments})
        return ["<think>", "\nI should read the notes.\n", "</think>",
                "<tool_call>", f"\n{body}\n", "</tool_call>"]  # fmt: skip

    return {
        "zebracorn": ["The secret word is ", "mango", "."],
        "tapioca": call("Read", {"file_path": str(work / "notes.txt")}),
        "cassava": call("exec_command", {"cmd": "cat notes.txt"}),
        "<tool_response>": [TOOL_ANSWER],
    }


KEY = "sk-local-agents"
CONTEXT = 131_072
CLI_TIMEOUT_S = 900


def write_model(root: Path, work: Path) -> Path:
    path = save_scripted_model(root / "model", script(work), arch="llama")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, str, float]:
    start = time.monotonic()
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                       timeout=CLI_TIMEOUT_S)  # fmt: skip
    return p.returncode, p.stdout, p.stderr, time.monotonic() - start


def claude_turns(npm: Path, url: str, tools: str, work: Path) -> list[dict]:
    home = Path(tempfile.mkdtemp(prefix="claude-home-"))
    env = {**os.environ, "HOME": str(home), "ANTHROPIC_BASE_URL": url,
           "ANTHROPIC_API_KEY": KEY, "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}  # fmt: skip
    binary = str(npm / "node_modules" / ".bin" / "claude")
    turns = []
    for extra, prompt in (([], "Tell me the zebracorn secret word"),
                          (["--continue"], "And the zebracorn word once more?")):  # fmt: skip
        turns.append(claude_run(binary, prompt, tools, extra, env, work))
    fresh = {**env, "HOME": tempfile.mkdtemp(prefix="claude-home-")}
    turns.append(claude_run(binary, "Read my tapioca notes", tools, [], fresh, work))
    return turns


def claude_run(
    binary: str, prompt: str, tools: str, extra: list[str], env: dict, work: Path
) -> dict:
    cmd = [binary, "-p", prompt, "--output-format", "json", "--tools", tools, *extra]
    rc, out, err, wall = run(cmd, env, work)
    try:
        result = json.loads(out)
    except json.JSONDecodeError:
        result = {}
    usage = result.get("usage", {})
    prompt_tokens = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
    return {
        "command": " ".join(["claude", "-p", repr(prompt), "--tools", tools, *extra]),
        "exit": rc, "answer": result.get("result"), "wall_s": round(wall, 2),
        "num_turns": result.get("num_turns"),
        "ttft_ms": result.get("ttft_ms"), "prompt_tokens": prompt_tokens,
        "cache_read_input_tokens": usage.get("cache_read_input_tokens"),
        "stderr_tail": err[-400:],
    }  # fmt: skip


def codex_turn(npm: Path, url: str, work: Path) -> dict:
    home = Path(tempfile.mkdtemp(prefix="codex-home-"))
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text(
        'model = "default_model"\nmodel_provider = "local"\n[model_providers.local]\n'
        f'name = "local"\nbase_url = "{url}/v1"\nwire_api = "responses"\n'
        'env_key = "LOCAL_KEY"\n'
    )
    env = {**os.environ, "HOME": str(home), "CODEX_HOME": str(home / ".codex"),
           "LOCAL_KEY": KEY}  # fmt: skip
    binary = str(npm / "node_modules" / ".bin" / "codex")
    prompt = "Show me my cassava notes"
    rc, out, err, wall = run([binary, "exec", "--skip-git-repo-check", prompt], env, work)
    return {"command": f"codex exec --skip-git-repo-check {prompt!r}", "exit": rc,
            "answer": out.strip(), "wall_s": round(wall, 2), "stderr_tail": err[-1500:]}  # fmt: skip


def checks(report: dict) -> list[tuple[str, bool]]:
    out = []
    runs = report.get("claude", [])
    turns, tool_run = runs[:2], runs[2:]
    for i, t in enumerate(turns, 1):
        out.append((f"claude turn {i}: exit 0 and the answer printed",
                    t["exit"] == 0 and t["answer"] == ANSWER))  # fmt: skip
    for t in tool_run:
        out.append(("claude with a tool call: exit 0, Read ran, the answer printed",
                    t["exit"] == 0 and t["num_turns"] == 2 and t["answer"] == TOOL_ANSWER))  # fmt: skip
    if len(turns) == 2 and all(t["prompt_tokens"] and t["ttft_ms"] for t in turns):
        first, second = turns
        reuse = (second["cache_read_input_tokens"] or 0) / second["prompt_tokens"]
        ratio = second["ttft_ms"] / first["ttft_ms"]
        report["reuse"] = {"cache_read_share": round(reuse, 4), "ttft_ratio": round(ratio, 4)}
        out.append((f"turn 2 read {reuse:.1%} of its prompt from the cache (>= 90%)",
                    reuse >= 0.9))  # fmt: skip
        out.append((f"turn 2 time to first token {ratio:.1%} of turn 1's (<= 10%)",
                    ratio <= 0.1))  # fmt: skip
    if "codex" in report:
        c = report["codex"]
        out.append(("codex exec with a tool call: exit 0, exec_command ran, the answer printed",
                    c["exit"] == 0 and TOOL_ANSWER in c["answer"]
                    and "7421" in c["stderr_tail"] + c["answer"]))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--npm-dir", type=Path, default=Path("/work/agents-npm"))
    parser.add_argument("--claude-tools", default="Read")
    parser.add_argument("--skip-codex", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("serve_args", nargs="*", help="extra mlx-kvq serve flags (after --)")
    args = parser.parse_args(argv)
    for name in ("claude", *(() if args.skip_codex else ("codex",))):
        if not (args.npm_dir / "node_modules" / ".bin" / name).exists():
            print(f"{name} is not installed under {args.npm_dir} (npm install --prefix ...)")
            return 2
    with tempfile.TemporaryDirectory(prefix="agent-clients-") as tmp:
        root = Path(tmp)
        work = root / "work"
        work.mkdir()
        (work / "notes.txt").write_text(NOTES)
        model = write_model(root, work)
        report: dict = {"model": "scripted llama, qwen3 template, context 131,072"}
        with ServerProcess(model, *args.serve_args, api_key=KEY) as server:
            server.wait_ready()
            report["claude"] = claude_turns(args.npm_dir, server.url, args.claude_tools, work)
            if not args.skip_codex:
                report["codex"] = codex_turn(args.npm_dir, server.url, work)
            m = server.metrics()
            report["metrics"] = {k: m.get(k) for k in (
                "mlx_kvq_prompt_cache_hits_total", "mlx_kvq_prompt_cache_misses_total",
                "mlx_kvq_prompt_cache_tokens_total",
                'mlx_kvq_hosted_tools_ignored_total{type="web_search"}')}  # fmt: skip
    results = checks(report)
    report["checks"] = [{"check": c, "ok": ok} for c, ok in results]
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    for check, ok in results:
        print(("ok   " if ok else "FAIL ") + check)
    return 0 if results and all(ok for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())

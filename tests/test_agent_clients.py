"""Claude Code itself against `mlx-kvq serve` (scripts/agent_clients.py), when
it is installed: two `claude -p` turns exit 0 and print the scripted
model's answer, and the second reads at least 90% of its prompt from the
prompt cache; a third, whose answer is a call of Claude Code's Read tool,
prints the answer the model gives once the file's text is in its prompt. Skipped without the CLI (`npm install --prefix /work/agents-npm
@anthropic-ai/claude-code`, or MLX_KVQ_AGENT_NPM=DIR); Codex, slower on this
model's byte-level tokenizer, runs in the script only. Times are recorded by
the script, never asserted here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NPM = Path(os.environ.get("MLX_KVQ_AGENT_NPM", "/work/agents-npm"))
CLAUDE = NPM / "node_modules" / ".bin" / "claude"


@pytest.mark.skipif(not CLAUDE.exists(), reason=f"Claude Code is not installed under {NPM}")
def test_claude_code_two_turns(tmp_path):
    out = tmp_path / "run.json"
    subprocess.run([sys.executable, str(REPO / "scripts" / "agent_clients.py"), "--skip-codex",
                    "--npm-dir", str(NPM), "--json", str(out)], timeout=900, cwd=REPO)  # fmt: skip
    report = json.loads(out.read_text())
    first, second, tool = report["claude"]
    for turn in (first, second):
        assert turn["exit"] == 0, turn["stderr_tail"]
        assert turn["answer"] == "The secret word is mango."
    assert second["cache_read_input_tokens"] >= 0.9 * second["prompt_tokens"]
    # the model called Claude Code's Read tool, which read the file and sent the result back
    assert (tool["exit"], tool["num_turns"]) == (0, 2), tool["stderr_tail"]
    assert tool["answer"] == "The notes give the launch code."

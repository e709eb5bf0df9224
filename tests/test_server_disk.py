"""`mlx-kvq serve --prompt-cache-dir`: a server killed while it writes, then restarted.

The first server answers while its writer is held halfway through its
first file (writes never hold requests up) and is killed there (SIGKILL).
The next server on the directory removes the partial file at startup and
never reads it: the same request computes its prefix and gets the same
text. Once that server has written and stopped, a third one reads the
prefix back instead of prefilling it, and `/status` and `/metrics` say so.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from kvq_testing.server import ServerProcess
from kvq_testing.tiny import save_tiny_model

from mlx_kvq.commands import build_parser
from mlx_kvq.commands.serve import check_prompt_cache_dir
from mlx_kvq.engine.disk.records import is_temporary

PROMPT = (
    "A cache keeps recent results close at hand so that the same work is not done twice. "
    "If the cache grows too large, the oldest entries are removed first. "
) * 5  # 350 tokens: a chunk file of 256 tokens and an entry


def _complete(server: ServerProcess) -> dict:
    r = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _disk(server: ServerProcess) -> dict:
    return httpx.get(server.url + "/status", timeout=10).json()["prompt_cache_disk"]


def _temporary(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and is_temporary(p.name)]


def test_a_server_killed_while_writing_leaves_nothing_a_restart_uses(tmp_path):
    model = save_tiny_model(tmp_path / "model", "llama")
    root, gate = tmp_path / "cache", tmp_path / "gate"
    flags = ("--prompt-cache-dir", str(root), "--kv-bits", "4")
    with ServerProcess(model, *flags, "--prompt-cache-write-gate", str(gate)) as first:
        first.wait_ready()
        cold = _complete(first)  # answered while the writer waits inside its first file
        deadline = time.monotonic() + 60
        while not Path(str(gate) + ".waiting").exists():
            assert time.monotonic() < deadline, first.log()[-3000:]
            time.sleep(0.05)
        partial = _temporary(root)
        assert len(partial) == 1 and partial[0].stat().st_size > 0
        first.proc.kill()
        first.proc.wait(30)
    assert _cached(cold) == 0 and _temporary(root) == partial

    with ServerProcess(model, *flags) as second:
        second.wait_ready()
        assert "removed 1 partial file(s) a writer left when it stopped" in second.log()
        assert _temporary(root) == []
        again = _complete(second)
        assert again["choices"][0]["text"] == cold["choices"][0]["text"]
        assert _cached(again) == 0  # nothing complete was on disk: the prefix was computed
        deadline = time.monotonic() + 60
        while (disk := _disk(second))["writes"] == 0 or disk["queued_bytes"]:
            assert time.monotonic() < deadline, disk
            time.sleep(0.05)
        assert disk["misses"] == 1 and disk["hits"] == 0 and disk["entries"] >= 1

    with ServerProcess(model, *flags) as third:
        third.wait_ready()
        restarted = _complete(third)
        disk = _disk(third)
        metrics = third.metrics()
    prompt_tokens = restarted["usage"]["prompt_tokens"]
    assert restarted["choices"][0]["text"] == cold["choices"][0]["text"]
    assert _cached(restarted) == prompt_tokens - 1
    assert disk["hits"] == 1 and disk["tokens_read"] == prompt_tokens - 1
    assert disk["bytes"] <= disk["max_bytes"] and disk["skips"] == {}
    assert metrics["mlx_kvq_prompt_cache_disk_hits_total"] == 1
    assert metrics["mlx_kvq_prompt_cache_disk_tokens_total"] == prompt_tokens - 1
    assert metrics['mlx_kvq_prompt_cache_disk_skips_total{reason="corrupt"}'] == 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--prompt-cache-disk-bytes", "1GB"], "needs --prompt-cache-dir"),
        (["--prompt-cache-dir", "{tmp}/d", "--prompt-cache-size", "0"], "needs the prompt cache"),
        (["--prompt-cache-dir", "{tmp}/file/d"], "cannot be used"),
        (["--prompt-cache-dir", "{tmp}/d", "--prompt-cache-disk-bytes", "0"], "at least 1 byte"),
    ],
)
def test_a_disk_tier_that_cannot_work_is_refused_at_startup(tmp_path, argv, message):
    (tmp_path / "file").write_text("not a directory")
    args = build_parser().parse_args(["serve", *(a.format(tmp=tmp_path) for a in argv)])
    with pytest.raises(ValueError, match=message):
        check_prompt_cache_dir(args)

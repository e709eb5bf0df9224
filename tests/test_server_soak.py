"""Soak: 120 sequential multi-turn chat requests with `--prompt-cache-bytes` set.

All through HTTP. After every request (an idle point) the prompt-cache bytes
reported by /metrics are within the cap, the KV bytes held by live sequences
are back to zero, and the process's MLX memory net of the prompt cache stays
at the level of the first idle point (no leak), while the cache is actually
reused across turns and evicts to stay under the cap.
"""

from __future__ import annotations

import time

import pytest
from kvq_testing.server import ServerProcess
from kvq_testing.tiny import save_tiny_model

REQUESTS = 120
TURNS = 5  # turns per conversation
# bytes: a few conversations' worth, so eviction is exercised (the default's
# split layout keeps a short chat's tokens in 16 bits: ~270 KB an entry here)
CAP = 900_000
MEMORY_SLACK = 4 * 2**20  # allocator granularity and small transient buffers
WAIT_S = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("soak") / "m", "llama:sliding")
    args = ("--prompt-cache-bytes", str(CAP), "--prompt-cache-size", "64", "--max-tokens", "4")
    with ServerProcess(path, *args) as s:
        s.wait_ready()
        yield s


def idle_metrics(server):
    """Metrics once the batch is empty again (the engine publishes after each step)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        m = server.metrics()
        assert m["mlx_kvq_prompt_cache_bytes"] <= CAP  # never over, even mid-step
        if m["mlx_kvq_batch_size"] == 0 and m["mlx_kvq_kv_bytes_live"] == 0:
            return m
        assert time.monotonic() < deadline, f"never idle: {m}"
        time.sleep(0.01)


def test_soak_prompt_cache_stays_within_its_byte_cap(server):
    client = server.client()
    levels, cached_turns = [], 0
    messages: list[dict] = []
    for i in range(REQUESTS):
        if i % TURNS == 0:
            messages = [{"role": "system", "content": f"Conversation {i // TURNS}."}]
        messages.append({"role": "user", "content": f"Turn {i % TURNS}: and then?"})
        if i % 7 == 0:  # part of the traffic streams
            text, usage = "", None
            for chunk in client.chat.completions.create(
                model="default_model", messages=messages, stream=True,
                stream_options={"include_usage": True},
            ):  # fmt: skip
                usage = chunk.usage or usage
                text += "".join(c.delta.content or "" for c in chunk.choices)
        else:
            r = client.chat.completions.create(model="default_model", messages=messages)
            text, usage = r.choices[0].message.content, r.usage
        assert 0 < usage.completion_tokens <= 4
        cached_turns += usage.prompt_tokens_details.cached_tokens > 0
        messages.append({"role": "assistant", "content": text})

        m = idle_metrics(server)
        levels.append(m["mlx_kvq_mlx_active_memory_bytes"] - m["mlx_kvq_prompt_cache_bytes"])

    m = server.metrics()
    assert m["mlx_kvq_prompt_cache_evictions_total"] > 0  # the cap was exercised
    assert m["mlx_kvq_prompt_cache_hits_total"] > REQUESTS // 2
    assert cached_turns >= REQUESTS * (TURNS - 1) // TURNS - 5  # later turns reuse earlier ones
    assert m['mlx_kvq_requests_total{status="ok"}'] >= REQUESTS
    assert max(levels) <= levels[0] + MEMORY_SLACK, (levels[0], max(levels))
    print(
        f"soak: prompt cache {m['mlx_kvq_prompt_cache_bytes']:.0f} B of {CAP} B cap, "
        f"{m['mlx_kvq_prompt_cache_entries']:.0f} entries, "
        f"{m['mlx_kvq_prompt_cache_evictions_total']:.0f} evictions, "
        f"{m['mlx_kvq_prompt_cache_hits_total']:.0f} hits; idle memory net of the cache "
        f"{levels[0] / 2**20:.2f}..{max(levels) / 2**20:.2f} MiB"
    )

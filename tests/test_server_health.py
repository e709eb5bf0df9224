"""Startup and readiness of the real server process.

`/health` is 503 ("warming_up") until a warm-up has generated through every
cache kind in quantized form, past every sliding window and past
`--quantized-kv-start`, then 200 with the plan and the warm-up's proof. The
warm-up is held at a gate file so the 503 phase is observed without timing.
Settings the plan refuses exit non-zero before the port opens.
"""

from __future__ import annotations

import sys
import threading

import httpx
import pytest
from kvq_testing.server import ServerProcess
from kvq_testing.tiny import save_tiny_model


def check_quantized_warmup(body, kinds=("sliding", "full")):
    warm = body["warmup"]
    for where in ("batch", "extracted"):
        for kind in kinds:
            s = warm[where][kind]
            assert s["slots"] > 0 and s["quantized"] == s["slots"], (where, kind, s)
    assert warm["sequence_tokens"] > body["plan"]["max_window"]
    assert warm["batch_size"] == 3  # the long sequence and the two that joined it decoded together
    if sys.platform == "linux":  # the BLAS MLX's float products use, as resolved by the loader
        assert body["blas"]["fast"] is True and body["blas"]["library"], body["blas"]
    assert body["native_kernels"]
    return warm


def gated_start(server, gate):
    server.wait_for("/live", 200)
    r = server.health()
    assert r.status_code == 503 and r.json() == {"status": "warming_up"}
    assert server.metrics()["mlx_kvq_ready"] == 0
    gate.touch()
    return server.wait_ready().json()


def test_gemma4_kv_shared_warms_up_through_quantized_window_and_full(tmp_path):
    path = save_tiny_model(tmp_path / "gemma4", "gemma4_text:kv_shared")
    gate = tmp_path / "gate"
    with ServerProcess(path, "--warmup-gate", str(gate)) as s:
        s.wait_for("/live", 200)
        # A request sent while warming up waits and is served once ready.
        early = {}
        t = threading.Thread(target=lambda: early.update(r=httpx.post(
            s.url + "/v1/chat/completions", timeout=120,
            json={"messages": [{"role": "user", "content": "early"}], "max_tokens": 3})))  # fmt: skip
        t.start()
        body = gated_start(s, gate)
        t.join(120)
        assert early["r"].status_code == 200, early["r"].text

        plan = body["plan"]
        assert plan["layers_by_kind"]["shared"] == 2
        assert {"sliding", "full"} <= set(plan["layers_by_kind"])
        from mlx_kvq.defaults import DEFAULT_KV_CONFIG as default  # no --kv-bits given

        assert plan["bits"]["keys"] == default.key_spec.bits
        assert plan["bits"]["values"] == default.value_spec.bits
        assert plan["bits"]["windows"] == default.window_bits
        assert plan["quantized_layers"] == plan["kv_layers"] > 0
        assert 0 < plan["bytes_per_token"] < plan["fp16_bytes_per_token"]
        check_quantized_warmup(body)
        assert "KV layers quantized" in s.log()  # the plan table is logged at startup
        assert s.metrics()["mlx_kvq_ready"] == 1


def test_gpt_oss_sinks_warm_up_past_quantized_kv_start(tmp_path):
    path = save_tiny_model(tmp_path / "gpt_oss", "gpt_oss")
    gate = tmp_path / "gate"
    with ServerProcess(path, "--warmup-gate", str(gate), "--quantized-kv-start", "20") as s:
        body = gated_start(s, gate)
        assert body["plan"]["sinks"] is True
        assert body["plan"]["bits"]["quantized_kv_start"] == 20
        warm = check_quantized_warmup(body)
        assert warm["sequence_tokens"] > 20
        r = s.client().chat.completions.create(
            model="default_model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert r.usage.completion_tokens > 0
        assert s.health().status_code == 200


def test_refused_settings_exit_before_the_port_opens(tmp_path):
    path = save_tiny_model(tmp_path / "m", "llama:sliding")
    # head_dim 64 is not divisible by group size 128: the plan names the layer.
    s = ServerProcess(path, "--kv-group-size", "128")
    with s:
        assert s.run_to_exit() == 2
        log = s.log()
    assert "head dimension 64" in log and "cache slot" in log
    assert "Uvicorn running" not in log
    with pytest.raises(httpx.TransportError):
        httpx.get(s.url + "/live", timeout=2)


def test_without_model_serves_the_demo_or_says_why(tmp_path):
    try:
        from mlx_kvq.demo import demo_model_path

        demo_model_path()
    except (ImportError, FileNotFoundError):
        with ServerProcess(None) as s:
            assert s.run_to_exit() == 2
            assert "no --model given and the embedded demo model is not available" in s.log()
        return
    with ServerProcess(None) as s:
        body = s.wait_ready().json()
        assert body["model"] == "mlx-kvq-demo"
        check_quantized_warmup(body)
        assert [m.id for m in s.client().models.list().data] == ["mlx-kvq-demo"]

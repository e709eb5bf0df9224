"""Measure what a hostile client can do to `mlx-kvq serve` (docs/reliability.md).

Starts the server on the demo model (or `--model`) on a free loopback port
and reports, as JSON:

- `huge_chat`: a 100,000-message chat request (3.5 MB) sent while a stream
  runs and `/live` is polled: its status and time to answer, the slowest
  `/live` answer, the longest gap between two chunks of the stream, and the
  server's peak resident memory before and after;
- `huge_prompt`: the same for a 7.2 MB completion prompt;
- `near_bound_chat`: the same for 60,000 messages (120,000 characters: under
  the demo model's bound of 2,048 tokens x 60 characters, so it is parsed,
  validated, rendered and tokenized before the exact count refuses it);
- `client_template`: a chat request carrying its own nested-loop template;
- `cross_site`: a text/plain POST from a foreign Origin and a foreign Host;
- `idle_connection`: seconds until an idle connection is closed.

    python scripts/hardening_probe.py [--model DIR] [-- extra serve flags]

Run it against another checkout by putting that checkout first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def under_load(url: str, pid: int, path: str, body: dict) -> dict:
    """Send `body` to `path` while a stream runs and /live is polled."""
    arrivals: list[float] = []
    stream_started = threading.Event()

    def stream() -> None:
        sbody = {"prompt": "In the beginning", "max_tokens": 1500, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=sbody, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        arrivals.append(time.monotonic())
                        stream_started.set()
        except httpx.HTTPError:
            pass

    threading.Thread(target=stream, daemon=True).start()
    stream_started.wait(120)
    time.sleep(0.3)
    rss_before = peak_rss_mb(pid)
    result: dict = {}
    raw = json.dumps(body).encode()

    def send() -> None:
        t = time.monotonic()
        try:
            r = httpx.post(url + path, content=raw, timeout=300,
                           headers={"Content-Type": "application/json"})  # fmt: skip
            result["status"] = r.status_code
            result["code"] = r.json().get("error", {}).get("code") if r.status_code != 200 else None
        except httpx.HTTPError as e:
            result["status"] = repr(e)
        result["answered_s"] = round(time.monotonic() - t, 3)
        result["end"] = time.monotonic()

    start = time.monotonic()
    sender = threading.Thread(target=send)
    sender.start()
    live = []
    while sender.is_alive():
        t = time.monotonic()
        try:
            httpx.get(url + "/live", timeout=60)
        except httpx.HTTPError:
            pass
        live.append(time.monotonic() - t)
        time.sleep(0.02)
    sender.join()
    window = [a for a in arrivals if start <= a <= result["end"] + 0.5]
    gaps = [b - a for a, b in zip(window, window[1:], strict=False)]
    return {
        "bytes": len(raw),
        "status": result["status"],
        "code": result.get("code"),
        "answered_s": result["answered_s"],
        "live_max_s": round(max(live), 3),
        "live_polls": len(live),
        "stream_chunks_in_window": len(window),
        "stream_max_gap_s": round(max(gaps), 3) if gaps else None,
        "peak_rss_mb_before": round(rss_before),
        "peak_rss_mb_after": round(peak_rss_mb(pid)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("serve_flags", nargs="*")
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlx_kvq", "serve", "--port", str(port), *args.serve_flags]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        out: dict = {"command": " ".join(cmd[1:])}
        huge = {"messages": [{"role": "user", "content": "hi"}] * 100_000, "max_tokens": 2}
        out["huge_chat"] = under_load(url, proc.pid, "/v1/chat/completions", huge)
        prompt = "And God said, Let there be light. " * 212_000
        out["huge_prompt"] = under_load(url, proc.pid, "/v1/completions",
                                        {"prompt": prompt, "max_tokens": 2})  # fmt: skip
        near = {"messages": [{"role": "user", "content": "hi"}] * 60_000, "max_tokens": 2}
        out["near_bound_chat"] = under_load(url, proc.pid, "/v1/chat/completions", near)
        hog = "{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}"
        t = time.monotonic()
        r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": hog}})  # fmt: skip
        out["client_template"] = {"status": r.status_code,
                                  "answered_s": round(time.monotonic() - t, 3)}  # fmt: skip
        plain = httpx.post(url + "/v1/completions", timeout=60,
                           content=b'{"prompt": "hi", "max_tokens": 2}',
                           headers={"Content-Type": "text/plain",
                                    "Origin": "https://evil.example"})  # fmt: skip
        no_origin = httpx.post(url + "/v1/completions", timeout=60,
                               content=b'{"prompt": "hi", "max_tokens": 2}',
                               headers={"Content-Type": "text/plain"})  # fmt: skip
        rebound = httpx.get(url + "/status", headers={"Host": f"evil.example:{port}"}, timeout=60)
        out["cross_site"] = {"text_plain_foreign_origin": plain.status_code,
                             "text_plain_no_origin": no_origin.status_code,
                             "foreign_host": rebound.status_code}  # fmt: skip
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(120)
            t = time.monotonic()
            try:
                s.recv(1)
                out["idle_connection"] = {"closed_after_s": round(time.monotonic() - t, 2)}
            except TimeoutError:
                out["idle_connection"] = {"closed_after_s": None, "held_for_s": 120}
        print(json.dumps(out, indent=1))
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The process group and the few collectives mlx-kvq adds on top of mlx-lm's.

All control traffic (status after planning, per-rank KV bytes, the engine's
per-step commands) goes through two primitives, `gather_json` and
`exchange`, run on the CPU stream like mlx-lm's own barrier. Every rank must
call them in the same order: they are collectives.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

import mlx.core as mx
import numpy as np


@lru_cache(maxsize=1)
def world() -> mx.distributed.Group:
    """The group `mlx.launch` (or MLX_RANK + MLX_HOSTFILE) set up; size 1 otherwise."""
    return mx.distributed.init()


def launched() -> bool:
    """True when this process is one rank of a group of two or more."""
    return world().size() > 1


def rank() -> int:
    return world().rank()


def size() -> int:
    return world().size()


def drain() -> None:
    """Wait for model work already queued (mlx-lm's generation stream).

    mlx-lm queues the next decode step before handing out the current token,
    so a loop that stops early leaves one step, with its collectives, in
    flight. A control collective issued on another stream meanwhile would
    interleave with those on the wire; draining first keeps every rank's
    collectives in the same order.
    """
    import importlib

    stream = importlib.import_module("mlx_lm.generate").generation_stream
    mx.synchronize(stream)


def all_gather(x: mx.array, group: mx.distributed.Group | None = None) -> mx.array:
    g = group or world()
    drain()
    return mx.distributed.all_gather(x, group=g, stream=mx.cpu)


def all_sum(x: mx.array, group: mx.distributed.Group | None = None) -> mx.array:
    g = group or world()
    drain()
    return mx.distributed.all_sum(x, group=g, stream=mx.cpu)


def gather_json(obj, group: mx.distributed.Group | None = None) -> list:
    """Every rank's `obj` (JSON-serialisable), in rank order, on every rank."""
    g = group or world()
    if g.size() == 1:
        return [json.loads(json.dumps(obj))]
    data = json.dumps(obj, default=str).encode()
    sizes = all_gather(mx.array([len(data)], dtype=mx.int64), g).tolist()
    width = max(sizes)
    buf = np.zeros(width, dtype=np.uint8)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    rows = np.array(all_gather(mx.array(buf), g)).reshape(g.size(), width)
    return [json.loads(rows[i, : sizes[i]].tobytes()) for i in range(g.size())]


def broadcast_json(obj, group: mx.distributed.Group | None = None):
    """Rank 0's `obj`, on every rank (other ranks pass anything)."""
    return gather_json(obj if (group or world()).rank() == 0 else None, group)[0]


HEADER = 8  # int64 fields every rank contributes per engine step


def exchange(header: list[int], payload: bytes | None, group: mx.distributed.Group | None = None):
    """One engine step's control collective.

    Every rank contributes `HEADER` int64 numbers (its own status and KV
    bytes); rank 0 also contributes `payload` (the step's commands), whose
    length travels in its header field 0. Returns (all headers, payload) on
    every rank; the payload costs a second collective only when non-empty.
    """
    g = group or world()
    head = list(header) + [0] * (HEADER - len(header))
    if g.rank() == 0:
        head[0] = len(payload or b"")
    else:
        head[0] = 0
    rows = all_gather(mx.array(head, dtype=mx.int64), g).tolist()
    headers = [rows[i * HEADER : (i + 1) * HEADER] for i in range(g.size())]
    n = headers[0][0]
    if n == 0:
        return headers, b""
    if g.rank() == 0:
        data = mx.array(np.frombuffer(payload, dtype=np.uint8))
    else:
        data = mx.zeros((n,), dtype=mx.uint8)
    out = all_sum(data, g)
    mx.eval(out)  # on rank 0 too: a collective left lazy is never sent
    return headers, (np.array(out).tobytes() if g.rank() else payload)


def ring_leader_host(hostfile: str) -> str:
    """Rank 0's address in a ring hostfile (`MLX_HOSTFILE`: a JSON list of
    ranks, each a list of "ip:port" strings, as `mlx.launch` writes it).
    A file that cannot be read that way raises ValueError naming it: the
    heartbeat would otherwise listen on the wrong host."""
    expected = 'expected a JSON list of ranks, each a list of "ip:port" strings'
    try:
        with open(hostfile) as f:
            hosts = json.load(f)
    except OSError as e:
        raise ValueError(f"MLX_HOSTFILE={hostfile}: cannot be read ({e})") from e
    except ValueError as e:
        raise ValueError(f"MLX_HOSTFILE={hostfile}: not JSON ({e}); {expected}") from e
    first = hosts[0] if isinstance(hosts, list) and hosts else None
    if isinstance(first, list):
        first = first[0] if first else None
    if not isinstance(first, str) or not first.strip():
        raise ValueError(
            f"MLX_HOSTFILE={hostfile}: rank 0 has no address ({json.dumps(hosts)[:80]}); {expected}"
        )
    return first.rsplit(":", 1)[0]


def env_leader_host() -> str:
    """The address of rank 0 as the launcher knows it (for the heartbeat channel).

    `MLX_KVQ_HEARTBEAT_HOST` wins; otherwise rank 0's address from the ring
    hostfile (`MLX_HOSTFILE`, which must be well formed: `ring_leader_host`),
    the JACCL coordinator or NCCL's host; else loopback.
    """
    explicit = os.environ.get("MLX_KVQ_HEARTBEAT_HOST")
    if explicit:
        return explicit
    hostfile = os.environ.get("MLX_HOSTFILE")
    if hostfile:
        return ring_leader_host(hostfile)
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    return os.environ.get("NCCL_HOST_IP") or "127.0.0.1"

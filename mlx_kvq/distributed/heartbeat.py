"""A heartbeat side channel between the ranks: the group's watchdog.

MLX collectives have no timeout: if a peer dies, the others block in their
next collective forever. So besides MLX's own links, every rank keeps one
plain TCP connection to rank 0 (on rank 0's address from the hostfile, an
ephemeral port announced through one collective at startup) and both ends
send a small JSON line every `interval` seconds. Rank 0 declares a rank lost
when its connection closes (the process exited or was killed: noticed at
once) or when nothing arrived for `timeout` seconds (host down, network
partition, a frozen process). A rank whose engine fails says so on the
channel before it stops, so rank 0 can give the reason. Followers treat the
loss of rank 0 the same way.

What to do on a loss is the caller's `on_lost(RankLoss)`: at startup the
group exits; once serving, rank 0 fails readiness (503 with the reason) and
every in-flight request.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .group import broadcast_json, env_leader_host, world

log = logging.getLogger("mlx_kvq.distributed")

INTERVAL_S = float(os.environ.get("MLX_KVQ_HEARTBEAT_INTERVAL", "0.5"))
TIMEOUT_S = float(os.environ.get("MLX_KVQ_HEARTBEAT_TIMEOUT", "10"))
CONNECT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RankLoss:
    """A rank (None: the whole group, e.g. a stuck step) that can no longer take part.

    `reported` is True when the rank said why itself before it stopped.
    """

    rank: int | None
    reason: str
    reported: bool = False


LostCallback = Callable[[RankLoss], None]


def abort_on_loss(loss: RankLoss) -> None:
    """Startup / CLI policy: nothing can be served without every rank; leave now."""
    who = "the group" if loss.rank is None else f"rank {loss.rank}"
    msg = f"mlx-kvq: error: rank {world().rank()}: {who} is gone ({loss.reason}); stopping"
    print(msg, flush=True)
    os._exit(3)


class Heartbeat:
    """One rank's end of the side channel; see the module docstring."""

    def __init__(self, on_lost: LostCallback = abort_on_loss, interval: float = INTERVAL_S,
                 timeout: float = TIMEOUT_S):  # fmt: skip
        g = world()
        self.rank, self.size = g.rank(), g.size()
        self.interval, self.timeout = interval, timeout
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._peers: dict[int, socket.socket] = {}  # rank -> socket (rank 0 holds all)
        self._send_locks: dict[int, threading.Lock] = {}
        self._last_seen: dict[int, float] = {}
        self._lost: dict[int, str] = {}
        self._dead: set[int] = set()  # peers whose connection is gone
        self._connected = threading.Condition(self._lock)
        self._closing = False
        self.on_group_failed: Callable[[str], None] = lambda reason: log.error(
            "rank 0 reports the group failed: %s", reason
        )
        self.progress: Callable[[], float | None] | None = None  # seconds in current step
        self.step_timeout: float | None = None
        self._listener: socket.socket | None = None

    # ------------------------------------------------------------ setup
    @classmethod
    def start(cls, on_lost: LostCallback = abort_on_loss, **kw) -> Heartbeat:
        """Open the channel on every rank (a collective: all ranks call it)."""
        hb = cls(on_lost, **kw)
        host = env_leader_host()
        if hb.rank == 0:
            hb._listen(host)
            port = hb._listener.getsockname()[1]
        else:
            port = None
        where = broadcast_json({"host": host, "port": port})
        if hb.rank == 0:
            threading.Thread(target=hb._accept_loop, name="kvq-hb-accept", daemon=True).start()
            hb._wait_connected(CONNECT_TIMEOUT_S)
        else:
            hb._connect(where["host"], int(where["port"]))
        threading.Thread(target=hb._beat_loop, name="kvq-hb-send", daemon=True).start()
        return hb

    def set_on_lost(self, callback: LostCallback) -> None:
        self._on_lost = callback

    def _listen(self, host: str) -> None:
        port = int(os.environ.get("MLX_KVQ_HEARTBEAT_PORT", "0"))
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:  # rank 0's address in the hostfile is not local (NAT): all interfaces
            s.bind(("0.0.0.0", port))
        s.listen(self.size)
        self._listener = s

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(conn,), daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        conn.settimeout(self.timeout)
        try:
            hello = json.loads(_readline(conn))
            peer = int(hello["rank"])
        except (OSError, ValueError, KeyError, TypeError):
            conn.close()
            return
        self._register(peer, conn)
        self._read_loop(peer, conn)

    def _connect(self, host: str, port: int) -> None:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                conn = socket.create_connection((host, port), timeout=self.timeout)
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"rank {self.rank}: cannot reach rank 0's heartbeat channel at "
                        f"{host}:{port}: {e} (set MLX_KVQ_HEARTBEAT_HOST to rank 0's address)"
                    ) from e
                time.sleep(0.2)
        conn.settimeout(self.timeout)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._register(0, conn)
        self._send(0, {"t": "hello", "rank": self.rank})
        threading.Thread(
            target=self._read_loop, args=(0, conn), name="kvq-hb-read", daemon=True
        ).start()

    def _register(self, peer: int, conn: socket.socket) -> None:
        with self._lock:
            self._peers[peer] = conn
            self._send_locks[peer] = threading.Lock()
            self._last_seen[peer] = time.monotonic()
            self._connected.notify_all()

    def _wait_connected(self, timeout: float) -> None:
        expected = set(range(1, self.size))
        with self._lock:
            ok = self._connected.wait_for(lambda: expected <= set(self._peers), timeout)
            missing = sorted(expected - set(self._peers))
        if not ok:
            self._on_lost(
                RankLoss(missing[0], f"never connected to the heartbeat channel (ranks {missing})")
            )

    # ------------------------------------------------------------ running
    def _read_loop(self, peer: int, conn: socket.socket) -> None:
        buf = b""
        while True:
            try:
                chunk = conn.recv(4096)
            except TimeoutError:
                self._dead.add(peer)
                self._lose(peer, f"no heartbeat for {self.timeout:g} s")
                return
            except OSError as e:
                self._dead.add(peer)
                self._lose(peer, f"heartbeat connection failed: {e}")
                return
            if not chunk:
                self._dead.add(peer)
                self._lose(peer, "its process exited or was killed (heartbeat connection closed)")
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self._last_seen[peer] = time.monotonic()
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if msg.get("t") == "fatal":
                    self._lose(peer, str(msg.get("reason")), reported=True)
                elif msg.get("t") == "group_failed":
                    self.on_group_failed(str(msg.get("reason")))

    def _beat_loop(self) -> None:
        while not self._closing:
            time.sleep(self.interval)
            for peer in list(self._peers):
                if peer not in self._dead:  # a rank that reported a failure still hears beats
                    self._send(peer, {"t": "beat"})
            if self.progress is not None and self.step_timeout:
                busy = self.progress()
                if busy is not None and busy > self.step_timeout:
                    self._lose(None, f"no progress for {busy:.0f} s inside one engine step "
                                     "(a rank may be stuck)")  # fmt: skip

    def _send(self, peer: int, msg: dict) -> bool:
        conn = self._peers.get(peer)
        lock = self._send_locks.get(peer)
        if conn is None or lock is None:
            return False
        try:
            with lock:
                conn.sendall(json.dumps(msg).encode() + b"\n")
            return True
        except OSError as e:
            self._dead.add(peer)
            self._lose(peer, f"heartbeat connection failed: {e}")
            return False

    def _lose(self, peer: int | None, reason: str, reported: bool = False) -> None:
        if self._closing:
            return
        key = -1 if peer is None else peer
        with self._lock:
            if key in self._lost:
                return
            self._lost[key] = reason
        log.error("%s lost: %s", "group" if peer is None else f"rank {peer}", reason)
        self._on_lost(RankLoss(peer, reason, reported))

    # ------------------------------------------------------------ queries
    def up(self, peer: int) -> bool:
        if peer == self.rank:
            return True
        with self._lock:
            return peer in self._peers and peer not in self._lost and peer not in self._dead

    def report_fatal(self, reason: str) -> None:
        """Tell the other end(s) this rank cannot go on, and why."""
        if self.rank == 0:
            for peer in list(self._peers):
                self._send(peer, {"t": "group_failed", "reason": reason})
        else:
            self._send(0, {"t": "fatal", "reason": reason})

    def stopping(self) -> None:
        """From now on a closed connection is a normal exit, not a lost rank.

        Call on every rank before a final barrier, then `close()` after it."""
        self._closing = True

    def close(self) -> None:
        self._closing = True
        for conn in list(self._peers.values()):
            try:
                conn.close()
            except OSError:
                pass
        if self._listener is not None:
            self._listener.close()


def _readline(conn: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            raise OSError("closed before a full line")
        buf += chunk
    return buf

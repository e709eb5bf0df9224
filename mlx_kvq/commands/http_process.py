"""The server process around the HTTP app: start, serve, drain on a signal, exit.

The default model's engine warms up while the port opens. The first SIGTERM or
SIGINT drains: new requests get 503 with Retry-After, requests in flight run
to their end for up to `--shutdown-timeout` seconds, whatever is left is
answered with an error, then uvicorn closes its connections and the process
exits 0 (uvicorn's own handler would re-raise the signal and die of it). A
second SIGINT stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import uvicorn

from ..engine import SHUTTING_DOWN
from ..residency import ModelPool
from ..server.app import create_app
from ..server.guards.connections import ConnectionLimits, guarded_protocol
from ..server.guards.draining import Lifecycle
from ..server.settings import ServerSettings
from .flags import DEFAULT_SHUTDOWN_TIMEOUT_S

log = logging.getLogger("mlx_kvq.server")


def serve_http(pool: ModelPool, settings: ServerSettings, host: str, port: int, log_level: str,
               shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
               limits: ConnectionLimits = ConnectionLimits()) -> int:  # fmt: skip
    """Serve the models of `pool` (the default one resident, started: it may
    still be warming up; `settings` are its) until a signal; 0 after a clean
    shutdown, 1 if the port never opened."""
    default = pool.view(pool.default).loaded
    assert default is not None, "the default model is resident when the server starts"
    app = create_app(default.engine, settings, pool)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level.lower(), access_log=False,
        timeout_graceful_shutdown=5, http=guarded_protocol(limits),
        timeout_keep_alive=limits.keep_alive_timeout,
    )  # fmt: skip
    server = DrainingServer(config, pool, app.state.lifecycle, shutdown_timeout)
    server.run()
    return 0 if server.started else 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the signal handling of the module docstring."""

    def __init__(self, config: uvicorn.Config, pool: ModelPool, lifecycle: Lifecycle,
                 shutdown_timeout: float):  # fmt: skip
        super().__init__(config)
        self.pool = pool
        self.lifecycle = lifecycle
        self.shutdown_timeout = shutdown_timeout
        self.drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.drainer is None:
            log.info("signal %d: draining (up to %gs)", sig, self.shutdown_timeout)
            self.drainer = threading.Thread(target=self.drain, name="mlx-kvq-drain", daemon=True)
            self.drainer.start()
        elif sig == signal.SIGINT:
            self.force_exit = True

    def drain(self) -> None:
        self.lifecycle.draining = True
        self.pool.close(SHUTTING_DOWN)  # no model loads from now on
        self.pool.drain(SHUTTING_DOWN)
        deadline = time.monotonic() + self.shutdown_timeout
        while self.lifecycle.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        self.pool.stop()  # whatever is left is answered with an error
        self.should_exit = True

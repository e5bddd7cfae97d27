"""Running the app with uvicorn: in the foreground (``lockstep serve``) or on a background thread.

:class:`BackgroundServer` binds its socket before uvicorn starts (``port=0``: a free port chosen by
the OS, no race), so tests and scripts can start a server in-process and talk to ``base_url``.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _uvicorn(app: Any, host: str, port: int, log_level: str) -> uvicorn.Server:
    # no access log per request; one event loop thread, no reload/workers (the engine is in-process)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def run_server(app: Any, host: str, port: int, log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM: in-flight requests end, the engine loop stops)."""
    sock = _bind(host, port)
    _uvicorn(app, host, port, log_level).run(sockets=[sock])


class BackgroundServer:
    """``with BackgroundServer(app) as server: server.base_url`` -- uvicorn on a daemon thread."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 start_timeout: float = 60.0) -> None:
        self.app, self.host, self.start_timeout = app, host, start_timeout
        self._sock = _bind(host, port)
        self.port = self._sock.getsockname()[1]
        self._server = _uvicorn(app, host, self.port, log_level)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="lockstep-serve-http", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"serve: the HTTP server on {self.base_url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

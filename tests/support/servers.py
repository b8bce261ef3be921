"""Real services for tests: a redis-server process and uvicorn servers in background threads."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
import uvicorn

from service.runtime.host_serve import operator_socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def redis_server(workdir: Path, port: int | None = None) -> Iterator[str]:
    """Start Debian's ``redis-server`` on ``port`` (default: a free one), no automatic persistence (an
    explicit ``SAVE`` writes ``workdir/dump.rdb``, which a later start in the same folder loads); yields
    its URL.

    Raises:
        RuntimeError: redis-server is not installed (run scripts/setup_gateway.sh) or did not start.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: run scripts/setup_gateway.sh (make test does)")
    port = port or free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    client = redis.Redis(port=port)
    try:
        for _ in range(100):
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            raise RuntimeError("redis-server did not answer")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


#: the HTTP protocol ``python -m service serve`` runs by default (service/runtime/http_protocol.py)
SERVE_PROTOCOL = "service.runtime.http_protocol:CoalescingHttpToolsProtocol"


class ThreadedServer:
    """Runs an ASGI app under uvicorn in a daemon thread (real HTTP on ``host``, default 127.0.0.1; any
    127.0.0.0/8 address works on Linux), with the HTTP protocol the gateway serves with (``http``: another
    uvicorn protocol, e.g. ``"httptools"``); ``extra_ports``: more ports the same server listens on."""

    def __init__(
        self,
        app: Any,
        port: int | None = None,
        startup_timeout_s: float = 120.0,
        http: str = SERVE_PROTOCOL,
        host: str = "127.0.0.1",
        extra_ports: tuple[int, ...] = (),
    ) -> None:
        self.port = port or free_port()
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning", lifespan="on", http=http)
        self.server = uvicorn.Server(config)
        # more ports served by the same server (the gateway's security.operator_port), as `serve` binds them
        self.sockets = None
        if extra_ports:
            self.sockets = [config.bind_socket(), *(operator_socket(host, p) for p in extra_ports)]
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": self.sockets}, daemon=True)

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("server thread died during startup")
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        for sock in self.sockets or ():
            sock.close()

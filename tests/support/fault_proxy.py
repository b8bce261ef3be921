"""A fault-injecting TCP proxy on 127.0.0.1, between the gateway and a worker or Redis (issue 31).

What the server sends back is delayed (``latency_s``, plus up to ``jitter_s`` more, order kept), throttled
(``bandwidth_bps``), cut (``reset_after_bytes``: the connection is reset, RST, once a response has passed
that many bytes) or swallowed (``black_hole``: connections are accepted and read, and nothing comes back,
as from a peer whose host went away behind a firewall that keeps the handshake). Every attribute can change
while the proxy runs and applies from the next chunk. Runs its own event loop in a daemon thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
from typing import Any

import httpx


class FaultProxy:
    """Forwards 127.0.0.1:``port`` to ``target`` (``host:port``, an ``http://`` or a ``redis://`` URL).

    Attributes:
        latency_s: added delay of each chunk the server sends, s.
        jitter_s: a further delay drawn uniformly from [0, jitter_s) per chunk, s (order is kept).
        bandwidth_bps: most bytes per second towards the client per connection (None: no limit).
        reset_after_bytes: reset a connection once this many bytes of a response went through
            (None: never); smaller answers (health probes) pass.
        black_hole: accept, read and never answer (new and open connections).
        resets: connections reset so far.
        connections: connections accepted so far.
    """

    def __init__(self, target: str, seed: int = 0) -> None:
        url = httpx.URL(target if "://" in target else f"tcp://{target}")
        self.target_host, self.target_port = url.host, int(url.port or 0)
        self._scheme, self._path = url.scheme, url.path
        self.latency_s = 0.0
        self.jitter_s = 0.0
        self.bandwidth_bps: float | None = None
        self.reset_after_bytes: int | None = None
        self.black_hole = False
        self.resets = 0
        self.connections = 0
        self.port = 0
        self._random = random.Random(seed)
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        """The proxy's address in the target's form (``http://127.0.0.1:P``, ``redis://127.0.0.1:P/0``)."""
        if self._scheme == "tcp":
            return f"127.0.0.1:{self.port}"
        return f"{self._scheme}://127.0.0.1:{self.port}{self._path.rstrip('/')}"

    def clear(self) -> None:
        """No fault from now on (counters kept)."""
        self.latency_s = self.jitter_s = 0.0
        self.bandwidth_bps = self.reset_after_bytes = None
        self.black_hole = False

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        assert self._started.wait(10), "the proxy did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _shutdown(self) -> None:
        """Stop accepting and end every connection's tasks (none is left pending on a closed loop)."""
        if self._server is not None:
            self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            self._loop.close()

    @staticmethod
    def _reset(writer: asyncio.StreamWriter) -> None:
        """Close with RST (SO_LINGER 0), not FIN: what a peer that crashed or a middlebox sends."""
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.black_hole:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while await client_r.read(65536):
                    pass
            client_w.close()
            return
        try:
            server_r, server_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            client_w.close()
            return
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def upstream() -> None:
            while data := await client_r.read(65536):
                while self.black_hole:  # noqa: ASYNC110 (set from the test's thread): swallowed
                    await asyncio.sleep(0.05)
                server_w.write(data)
                await server_w.drain()
            server_w.close()

        async def downstream() -> None:
            last_due = 0.0
            while data := await server_r.read(65536):
                jitter = self._random.uniform(0, self.jitter_s) if self.jitter_s else 0.0
                last_due = max(last_due, self._loop.time() + self.latency_s + jitter)
                line.put_nowait((last_due, data))
            line.put_nowait((max(last_due, self._loop.time() + self.latency_s), b""))

        async def deliver() -> None:
            sent = 0
            while True:
                due, data = await line.get()
                await asyncio.sleep(max(0.0, due - self._loop.time()))
                if not data:
                    break
                while self.black_hole:  # noqa: ASYNC110 (set from the test's thread): open ones stall
                    await asyncio.sleep(0.05)
                limit = self.reset_after_bytes
                if limit is not None and sent + len(data) > limit:
                    client_w.write(data[: max(0, limit - sent)])
                    with contextlib.suppress(OSError):
                        await client_w.drain()
                    self.resets += 1
                    self._reset(client_w)
                    self._reset(server_w)
                    return
                sent += len(data)
                if self.bandwidth_bps:
                    await asyncio.sleep(len(data) / self.bandwidth_bps)
                client_w.write(data)
                await client_w.drain()
            client_w.close()

        tasks: list[asyncio.Task[Any]] = [asyncio.create_task(c()) for c in (upstream, downstream, deliver)]
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            task.cancel()
        server_w.close()
        client_w.close()

"""A TCP proxy on 127.0.0.1 that delays what the server answers (a slow link or a slow Redis, for tests):
each chunk of the server's bytes reaches the client ``delay_s`` after the proxy read it, in order.
``delay_s`` can change while it runs (0: no delay). Runs its own event loop in a daemon thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import httpx


class DelayProxy:
    """Forwards 127.0.0.1:``port`` to ``target`` (``host:port`` or a ``redis://`` URL).

    Attributes:
        delay_s: the added delay of the server's answers, s.
    """

    def __init__(self, target: str) -> None:
        url = httpx.URL(target if "://" in target else f"tcp://{target}")
        self.target_host, self.target_port = url.host, int(url.port or 0)
        self._scheme, self._path = url.scheme, url.path
        self.delay_s = 0.0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        """The proxy's address in the target's form (``redis://127.0.0.1:P/0`` for a Redis URL)."""
        if self._scheme == "tcp":
            return f"127.0.0.1:{self.port}"
        return f"{self._scheme}://127.0.0.1:{self.port}{self._path}"

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        assert self._started.wait(10), "the proxy did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

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

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            client_w.close()
            return
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def upstream() -> None:
            while data := await client_r.read(65536):
                server_w.write(data)
                await server_w.drain()
            server_w.close()

        async def downstream() -> None:
            while data := await server_r.read(65536):
                line.put_nowait((self._loop.time() + self.delay_s, data))
            line.put_nowait((self._loop.time() + self.delay_s, b""))

        async def deliver() -> None:
            while True:
                due, data = await line.get()
                await asyncio.sleep(max(0.0, due - self._loop.time()))
                if not data:
                    break
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

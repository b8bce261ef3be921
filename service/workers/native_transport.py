"""Pooled keep-alive HTTP/1.1 to the workers on asyncio protocols and httptools' response parser.

The same pool as :class:`service.workers.transport.WorkerHTTP` (same settings, slots, ``Connection: close``
rule, errors and reading to the end), without aiohttp's client: one ``POST /generate`` to the bench's
instant upstream costs about 12 µs of client CPU against about 61 µs through ``aiohttp.ClientSession``
(micro-benchmark under uvloop on the 2-core development machine, 16 calls in flight); the gateway's CPU per
request fell 15-20% (bench A/B in the README). The default; ``RADIXGATE_UPSTREAM__HTTP_CLIENT=aiohttp``
switches back to :class:`WorkerHTTP`.

It speaks only what the gateway needs of a worker: ``GET`` and ``POST`` with a JSON body; answers framed
by ``Content-Length``, chunked transfer coding (SGLang's uvicorn always frames them) or the connection's
close (RFC 9112 6.3: neither of them; a reset is a failure), informational
``1xx`` ones before them skipped (as aiohttp does); ``https`` with the
system's CA certificates; one redirect of a ``GET`` on the same worker (Starlette's ``/metrics`` ->
``/metrics/``) and no other; no cookies, no compression (``Accept-Encoding: identity``), no proxies. The
parser is httptools (llhttp, Node.js's HTTP parser), the one uvicorn uses for requests.

Idle connections are reused most recent first (its server-side idle timer is the furthest off); the
oldest are closed once idle ``keepalive_s``, checked whenever a call takes a connection. A connection is
idle from the end of its answer, when the worker's own idle timer starts, however long its caller then
took to finish with it (a stream held by a slow client).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import cast

import httptools
from yarl import URL

from service.config.settings import UpstreamSettings
from service.workers.transport import TransportFailure, WorkerHTTP, split_read

_PAUSE_BYTES = 1 << 20
"""A response buffers at most about this much before the socket stops being read (flow control)."""

_MAX_HEAD_BYTES = 64 << 10
"""The longest status line and headers an answer may have (httptools keeps a header whole in memory; aiohttp
refuses a line over 8 KiB)."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection: the response being read, its body pieces and its end."""

    def __init__(self, key: tuple[str, int, bool], forget: Callable[[_Conn], None]) -> None:
        self.key = key
        self.forget = forget
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.pieces: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.complete = False
        self.keep_alive = False
        self.failed: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.headers_done = False
        self.informational = False
        self.framed = False
        self.head_bytes = 0
        self.location = b""
        self.idle_since = 0.0
        self.lost = False
        # the request said ``Connection: close``: no further request on it (RFC 9112 9.6)
        self.closing = False
        self.idle = False

    # -- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's TCPTransport is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.idle:  # nothing was asked: a stray answer (a late one, a 408) would be the next call's
            if self.transport is not None:
                self.transport.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(TransportFailure(f"malformed HTTP answer from a worker: {exc}"))
            if self.transport is not None:
                self.transport.close()
            return
        if not self.headers_done:
            self.head_bytes += len(data)
            if self.head_bytes > _MAX_HEAD_BYTES:
                self._fail(TransportFailure(f"a worker's answer head is over {_MAX_HEAD_BYTES} bytes"))
                if self.transport is not None:
                    self.transport.close()
                return
        if self.buffered > _PAUSE_BYTES and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.forget(self)
        if exc is None and self.headers_done and not self.framed and not self.complete:
            self.complete = True  # an answer with neither length nor chunks ends where the connection does
            self._wake()
        if not self.complete:
            reason = f"{type(exc).__name__}: {exc}" if exc else "the worker closed the connection"
            self._fail(TransportFailure(f"connection lost mid-answer ({reason})"))

    # -- httptools callbacks ------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 8 and name.lower() == b"location":
            self.location = value
        elif len(name) in (14, 17) and name.lower() in (b"content-length", b"transfer-encoding"):
            self.framed = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # informational (100 Continue, 103 Early Hints): the answer follows
            self.informational = True
            self.location = b""
            return
        self.status = status
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True
        self.idle_since = time.monotonic()  # the worker's idle timer starts now, not when the caller is done

    # -- reading ------------------------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if self.failed is None:
            self.failed = exc
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> bytes:
        """What the body holds now (b"" if nothing yet), resuming a paused socket."""
        pieces = self.pieces
        if not pieces:
            return b""
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        self.pieces = []
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    async def wait(self, timeout_s: float) -> None:
        """Until more arrives, the answer ends or the connection fails (at most ``timeout_s``).

        Raises:
            TransportFailure: the connection failed or stayed silent ``timeout_s``.
        """
        if self.failed is not None:
            raise self.failed
        loop = asyncio.get_running_loop()
        waiter = self.waiter = loop.create_future()
        timer = loop.call_later(timeout_s, self._silent, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None
        if self.failed is not None:
            raise self.failed

    async def read_to_end(self, timeout_s: float) -> bytes:
        """The rest of the body, waiting at most ``timeout_s`` of silence at a time. Raises
        :class:`TransportFailure`."""
        parts = [self.take()]
        while not self.complete:
            await self.wait(timeout_s)
            parts.append(self.take())
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _silent(self, waiter: asyncio.Future[None]) -> None:
        if waiter is self.waiter:
            self._fail(TransportFailure("TimeoutError: a worker stayed silent past read_timeout_s"))

    def reset(self) -> None:
        """Ready for the next request on this connection (one already lost fails its first wait)."""
        self.status = 0
        self.complete = self.headers_done = self.framed = False
        self.head_bytes = 0
        self.keep_alive = False
        self.failed = TransportFailure("connection lost before the request was sent") if self.lost else None
        self.location = b""


def _same_worker_redirect(method: str, conn: _Conn, worker: str, path: str) -> str | None:
    """The path on the same worker that a ``GET`` was redirected to (Starlette's ``/metrics`` ->
    ``/metrics/``, which aiohttp follows), else None; followed once."""
    if method != "GET" or conn.status not in (301, 302, 307, 308) or not conn.location:
        return None
    location = URL(conn.location.decode("latin-1"))
    if location.is_absolute():
        if location.origin() != URL(worker).origin():
            return None
    elif not location.raw_path.startswith("/"):
        return None
    target = location.raw_path_qs
    return None if target == path else target


class NativeOpenStream:
    """A response being read (see :meth:`NativeWorkerHTTP.stream`); its connection is handed back on exit.

    Attributes:
        status: the HTTP status.
    """

    def __init__(self, http: NativeWorkerHTTP, worker: str, path: str, body: bytes, close: bool) -> None:
        self._http = http
        self._request = (worker, path, body, close)
        self._conn: _Conn | None = None
        self.status = 0

    async def __aenter__(self) -> NativeOpenStream:
        worker, path, body, close = self._request
        try:
            self._conn = await self._http._send("POST", worker, path, body, close)
            self.status = self._conn.status
        except BaseException:
            self._http._done()
            raise
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._http._release(conn)
        self._http._done()

    async def body(self) -> bytes:
        """The rest of the body. Raises :class:`TransportFailure`."""
        conn = self._conn
        assert conn is not None
        return await conn.read_to_end(self._http._read_s)

    async def line_batches(self) -> AsyncIterator[list[bytes]]:
        """As :meth:`service.workers.transport.OpenStream.line_batches`: the body's lines (without
        ``\\n``), to its end, in batches of what arrived together (never empty). Raises
        :class:`TransportFailure`."""
        conn = self._conn
        assert conn is not None
        read_s = self._http._read_s
        pending = bytearray()
        while True:
            data = conn.take()
            if not data:
                if conn.complete:
                    break
                await conn.wait(read_s)
                continue
            parts = split_read(pending, data)
            if parts:
                yield parts
        if pending:
            yield [bytes(pending)]


class NativeWorkerHTTP(WorkerHTTP):
    """:class:`WorkerHTTP` on asyncio protocols and httptools (see the module); same calls and errors.

    Args:
        settings: the upstream section of the settings.
    """

    def __init__(self, settings: UpstreamSettings) -> None:
        super().__init__(settings)
        self._idle: dict[tuple[str, int, bool], collections.deque[_Conn]] = {}
        self._heads: dict[tuple[str, str, str, bool], bytes] = {}
        self._read_s = settings.read_timeout_s
        self._open_conns: set[_Conn] = set()
        self._ssl: ssl.SSLContext | None = None

    def _head(self, method: str, worker: str, path: str, close: bool) -> bytes:
        key = (method, worker, path, close)
        head = self._heads.get(key)
        if head is None:
            url = self.url(worker, path)
            target = url.raw_path_qs or "/"
            lines = [
                f"{method} {target} HTTP/1.1",
                f"Host: {url.raw_authority}",
                "Accept-Encoding: identity",
            ]
            if method == "POST":
                lines.append("Content-Type: application/json")
            if close:
                lines.append("Connection: close")
            if len(self._heads) >= 4096:
                self._heads.clear()
            head = self._heads[key] = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        return head

    def _tls(self) -> ssl.SSLContext:
        """One TLS context for every ``https`` worker (loading the system's CAs takes milliseconds)."""
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _usable(self, conn: _Conn, now: float) -> bool:
        """An idle connection that is still open and was idle less than ``keepalive_s``; one that is not is
        closed and forgotten."""
        transport = conn.transport
        if transport is not None and not transport.is_closing() and not conn.lost:
            if now - conn.idle_since < self._settings.keepalive_s:
                return True
            transport.close()
        self._open_conns.discard(conn)
        return False

    async def _connect(self, key: tuple[str, int, bool]) -> _Conn:
        idle = self._idle.get(key)
        if idle:
            now = time.monotonic()
            while idle and not self._usable(idle[0], now):  # the oldest first: closed or idle too long
                idle.popleft()
            while idle:  # then the most recent, whose server-side idle timer is the furthest off
                conn = idle.pop()
                if self._usable(conn, now):
                    conn.idle = False
                    return conn
        loop = asyncio.get_running_loop()
        host, port, tls = key
        try:
            async with asyncio.timeout(self._settings.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(key, self._forget),
                    host,
                    port,
                    ssl=self._tls() if tls else None,
                    server_hostname=host if tls else None,
                )
        except TimeoutError:
            raise TransportFailure(f"TimeoutError: connecting to {key[0]}:{key[1]}") from None
        except OSError as exc:
            raise TransportFailure(f"{type(exc).__name__}: {exc}", refused=True) from exc
        self._open_conns.add(conn)
        return conn

    async def _send(self, method: str, worker: str, path: str, body: bytes | None, close: bool) -> _Conn:
        """Send one request and wait for its status line and headers; returns the connection."""
        url = self.url(worker, path)
        key = (url.raw_host or "", url.port or 80, url.scheme == "https")
        conn = await self._connect(key)
        head = self._head(method, worker, path, close)
        payload = body or b""
        framing = b"Content-Length: %d\r\n\r\n" % len(payload) if method == "POST" else b"\r\n"
        conn.reset()
        conn.closing = close
        transport = conn.transport
        assert transport is not None
        if transport.is_closing():  # it failed or was closed before anything was asked (stray bytes)
            self._discard(conn)
            raise TransportFailure(f"the connection to {worker} closed before the request was sent")
        transport.write(head + framing + payload)
        try:
            while not conn.headers_done:
                await conn.wait(self._read_s)
        except BaseException:
            self._discard(conn)
            raise
        return conn

    def _release(self, conn: _Conn) -> None:
        """Back to the pool when its answer was read to the end and may be kept; otherwise closed."""
        if conn.complete and conn.keep_alive and not conn.closing and conn.failed is None and not conn.pieces:
            conn.idle = True
            self._idle.setdefault(conn.key, collections.deque()).append(conn)
        else:
            self._discard(conn)

    def _forget(self, conn: _Conn) -> None:
        """A connection closed (by either side): out of the pool's books, so a worker closing the idle
        connections of a worker no longer called (removed, drained) leaves nothing behind."""
        self._open_conns.discard(conn)
        if conn.idle:
            idle = self._idle.get(conn.key)
            if idle is not None:
                with contextlib.suppress(ValueError):
                    idle.remove(conn)
                if not idle:
                    del self._idle[conn.key]

    def _discard(self, conn: _Conn) -> None:
        self._open_conns.discard(conn)
        if conn.transport is not None:
            conn.transport.close()

    async def call(
        self, method: str, worker: str, path: str, body: bytes | None = None, timeout_s: float | None = None
    ) -> tuple[int, bytes]:
        """As :meth:`WorkerHTTP.call`. Raises :class:`TransportFailure`."""
        headers = await self._acquire(self._settings.pool_timeout_s if timeout_s is None else timeout_s)
        close = "Connection" in headers
        conn: _Conn | None = None
        try:
            bound = contextlib.nullcontext() if timeout_s is None else asyncio.timeout(timeout_s)
            async with bound:
                for hop in range(2):
                    conn = await self._send(method, worker, path, body, close)
                    data = await conn.read_to_end(self._read_s)
                    target = _same_worker_redirect(method, conn, worker, path) if hop == 0 else None
                    if target is None:
                        break
                    self._release(conn)
                    conn, path = None, target
            assert conn is not None
            return conn.status, data
        except TimeoutError:
            raise TransportFailure(f"TimeoutError: {method} {path} took over {timeout_s:g} s") from None
        finally:
            if conn is not None:
                self._release(conn)
            self._done()

    async def stream(self, worker: str, path: str, body: bytes) -> NativeOpenStream:  # type: ignore[override]
        """As :meth:`WorkerHTTP.stream`: ``async with await http.stream(...) as resp``.

        Raises:
            TransportFailure: no pool slot became free in time (when entered: the call failed).
        """
        headers = await self._acquire(self._settings.pool_timeout_s)
        return NativeOpenStream(self, worker, path, body, "Connection" in headers)

    async def aclose(self) -> None:
        """Close every connection (the pool may be used again by a later call)."""
        conns, self._open_conns = self._open_conns, set()
        self._idle.clear()
        for conn in conns:
            if conn.transport is not None:
                conn.transport.close()


__all__ = ["NativeOpenStream", "NativeWorkerHTTP"]

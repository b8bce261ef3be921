"""Pooled keep-alive HTTP/1.1 to the workers: one :class:`aiohttp.ClientSession` per replica (with
``upstream.http_client=aiohttp``; the default is the same pool without aiohttp, :mod:`native_transport`).

Why aiohttp: on the benchmark's instant upstream one ``POST /generate`` costs about 0.12 CPU ms through
aiohttp against 1.7 ms through httpx/httpcore (issue 10), and a 32-chunk stream 0.27 ms against 1.8 ms.

The pool follows the upstream settings (:class:`service.config.settings.UpstreamSettings`):

- ``max_connections``: calls in flight at once (all workers together; each holds one connection). A call
  waits at most ``pool_timeout_s`` for a free one (health calls: their own timeout), then fails with
  :class:`TransportFailure` ``local=True`` (the worker was never called; 503 ``upstream_pool_exhausted``).
- ``max_keepalive_connections``: idle connections kept open. A call that starts while that many or more
  calls are in flight asks the worker to close its connection afterwards (``Connection: close``, RFC 9112
  9.6), so idle connections never outnumber it: each idle connection was kept by a call that started
  with at most that many in flight, and such calls reuse idle connections before opening new ones.
- ``keepalive_s``: an idle connection is closed after this long, shorter than SGLang's own idle timeout
  (uvicorn ``timeout_keep_alive``, 5 s), so a request is never sent on a connection the worker is closing.
- ``connect_timeout_s`` (TCP connect) and ``read_timeout_s`` (longest silence while reading).

Every response is read to its end (a stream past ``data: [DONE]`` too), so its connection goes back to
the pool; one abandoned half-way (client gone, error) is closed. URLs are parsed once per worker and path.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from types import TracebackType

import aiohttp
from yarl import URL

from service.config.settings import UpstreamSettings

_JSON = "application/json"
_KEEP = {"Content-Type": _JSON, "Accept-Encoding": "identity"}
"""Headers of every call. ``identity``: the session does not decompress (``auto_decompress=False``, cheaper
on streams), and aiohttp otherwise asks for gzip, which SGLang's /metrics (prometheus_client) then sends:
every load poll failed to parse and no worker's window ever left its initial size."""
_CLOSE = {**_KEEP, "Connection": "close"}
_MAX_URLS = 4096


class TransportFailure(Exception):
    """A worker call failed below HTTP (no status to show).

    Attributes:
        refused: the TCP connection could not be opened (refused, unreachable, name unknown).
        local: no connection of the gateway's own pool became free in time; the worker was not called.
    """

    def __init__(self, message: str, refused: bool = False, local: bool = False) -> None:
        super().__init__(message)
        self.refused = refused
        self.local = local


def _failure(exc: BaseException) -> TransportFailure:
    refused = isinstance(exc, aiohttp.ClientConnectorError)
    return TransportFailure(f"{type(exc).__name__}: {exc}", refused=refused)


class OpenStream:
    """A response being read (see :meth:`WorkerHTTP.stream`); its connection is handed back on exit.

    Attributes:
        status: the HTTP status.
    """

    def __init__(self, http: WorkerHTTP, request: Awaitable[aiohttp.ClientResponse]) -> None:
        self._http = http
        self._request = request
        self._resp: aiohttp.ClientResponse | None = None
        self.status = 0

    async def __aenter__(self) -> OpenStream:
        try:
            self._resp = await self._request
        except (aiohttp.ClientError, OSError) as exc:
            self._http._done()
            raise _failure(exc) from exc
        except BaseException:
            self._http._done()
            raise
        self.status = self._resp.status
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        resp = self._resp
        if resp is not None:
            if resp.content.at_eof():
                resp.release()  # read to the end: the connection stays in the pool
            else:
                resp.close()  # abandoned half-way: the connection cannot be reused
        self._http._done()

    async def body(self) -> bytes:
        """The rest of the body. Raises :class:`TransportFailure`."""
        assert self._resp is not None
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, OSError) as exc:
            raise _failure(exc) from exc

    async def line_batches(self) -> AsyncIterator[list[bytes]]:
        """The body's lines (without ``\\n``; a ``\\r`` before it is kept), to its end, in batches: the
        lines completed by one read of the socket (never empty). A batch holds what the worker sent
        while the gateway was busy elsewhere, which the caller may forward in one write. Lines are not
        bounded in length (a cumulative SGLang chunk grows with the answer). Raises
        :class:`TransportFailure`."""
        assert self._resp is not None
        content = self._resp.content
        pending = bytearray()
        try:
            async for data in content.iter_any():
                parts = split_read(pending, data)
                if parts:
                    yield parts
        except (aiohttp.ClientError, OSError) as exc:
            raise _failure(exc) from exc
        if pending:
            yield [bytes(pending)]


def split_read(pending: bytearray, data: bytes) -> list[bytes]:
    """One read of a line-oriented body: the lines it completed (without ``\n``); ``pending`` holds the
    unfinished line of the reads before, and is left holding this read's (it is appended to, so a long line
    that comes in many reads is copied once, not once per read). Shared by both worker clients'
    ``line_batches``."""
    if b"\n" not in data:
        pending += data
        return []
    if pending:
        pending += data
        parts = bytes(pending).split(b"\n")
        pending.clear()
    else:
        parts = data.split(b"\n")
    pending += parts.pop()
    return parts


class WorkerHTTP:
    """The replica's connection pool to every worker (see the module). Open it inside the event loop
    that uses it; :meth:`aclose` closes every connection.

    Args:
        settings: the upstream section of the settings.
    """

    def __init__(self, settings: UpstreamSettings) -> None:
        self._settings = settings
        self._session: aiohttp.ClientSession | None = None
        self._slots = asyncio.Semaphore(settings.max_connections)
        self._in_flight = 0
        self._urls: dict[tuple[str, str], URL] = {}
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    @property
    def in_flight(self) -> int:
        """Calls holding a connection (or opening one) now."""
        return self._in_flight

    def _open(self) -> aiohttp.ClientSession:
        up = self._settings
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0,  # the semaphore bounds connections (one per call in flight)
                keepalive_timeout=up.keepalive_s,
                ttl_dns_cache=10,
            ),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=up.connect_timeout_s, sock_read=up.read_timeout_s
            ),
            auto_decompress=False,
            trust_env=False,
        )
        return self._session

    def url(self, worker: str, path: str) -> URL:
        """``worker + path`` as a parsed URL, cached."""
        key = (worker, path)
        url = self._urls.get(key)
        if url is None:
            if len(self._urls) >= _MAX_URLS:
                self._urls.clear()
            url = self._urls[key] = URL(worker + path)
        return url

    def _timeout(self, total_s: float) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get(total_s)
        if timeout is None:
            timeout = self._timeouts[total_s] = aiohttp.ClientTimeout(
                total=total_s, sock_connect=min(total_s, self._settings.connect_timeout_s)
            )
        return timeout

    async def _acquire(self, wait_s: float) -> dict[str, str]:
        """Take a pool slot (waiting at most ``wait_s``); returns the request headers to send."""
        if self._slots.locked():
            try:
                async with asyncio.timeout(wait_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise TransportFailure(
                    f"no free connection to the workers within {wait_s:g} s "
                    f"(upstream.max_connections={self._settings.max_connections})",
                    local=True,
                ) from None
        else:
            await self._slots.acquire()
        self._in_flight += 1
        return _KEEP if self._in_flight <= self._settings.max_keepalive_connections else _CLOSE

    def _done(self) -> None:
        self._in_flight -= 1
        self._slots.release()

    async def call(
        self, method: str, worker: str, path: str, body: bytes | None = None, timeout_s: float | None = None
    ) -> tuple[int, bytes]:
        """One request, its whole answer read: ``(status, body)``.

        Args:
            method: ``"GET"`` or ``"POST"``.
            worker: base URL of the worker.
            path: e.g. ``"/generate"``.
            body: JSON bytes to send, if any.
            timeout_s: a bound on the whole call, pool wait included (health and control calls); None
                for the settings' pool wait, connect and read timeouts (generation).

        Raises:
            TransportFailure: the call failed below HTTP, or no pool slot became free in time.
        """
        headers = await self._acquire(self._settings.pool_timeout_s if timeout_s is None else timeout_s)
        resp: aiohttp.ClientResponse | None = None
        try:
            session = self._session or self._open()
            url = self.url(worker, path)
            if timeout_s is None:  # the session's connect and read timeouts (timeout=None would be none)
                resp = await session.request(method, url, data=body, headers=headers)
            else:
                resp = await session.request(
                    method, url, data=body, headers=headers, timeout=self._timeout(timeout_s)
                )
            return resp.status, await resp.read()
        except (aiohttp.ClientError, OSError) as exc:
            raise _failure(exc) from exc
        finally:
            if resp is not None:
                resp.release()  # read to the end: kept; otherwise aiohttp closes the connection
            self._done()

    async def stream(self, worker: str, path: str, body: bytes) -> OpenStream:
        """``POST`` whose answer is read as it comes: ``async with await http.stream(...) as resp``.

        Raises:
            TransportFailure: no pool slot became free in time (when entered: the call failed).
        """
        headers = await self._acquire(self._settings.pool_timeout_s)
        try:
            session = self._session or self._open()
            request = session.post(self.url(worker, path), data=body, headers=headers)
        except BaseException:
            self._done()
            raise
        return OpenStream(self, request)

    async def aclose(self) -> None:
        """Close every connection (the pool may be opened again by a later call)."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


__all__ = ["OpenStream", "TransportFailure", "WorkerHTTP"]

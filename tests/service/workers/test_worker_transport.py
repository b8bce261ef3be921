"""The pooled keep-alive connections to workers (service/workers/transport.py, and native_transport.py
with ``upstream.http_client=httptools``: each test runs on both) through SGLangClient:
connections reused (streams read to their end), idle connections capped by max_keepalive_connections,
an exhausted pool reported as local (never the worker's fault), unbounded SSE lines."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from typing import cast

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loadgen.bench.upstream import FakeSGLang, serve
from service.config.settings import UpstreamSettings
from service.workers.client import SGLangClient, UpstreamError
from service.workers.native_transport import NativeWorkerHTTP
from service.workers.transport import split_read
from service.workers.worker_info import WorkerInfo
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer, free_port

Up = Callable[..., UpstreamSettings]


@pytest.fixture(params=["aiohttp", "httptools"])
def up(request: pytest.FixtureRequest) -> Up:
    """Upstream settings with each HTTP client of the pool (``upstream.http_client``)."""
    return functools.partial(UpstreamSettings, http_client=request.param)


BODY = {"text": "hello there", "sampling_params": {"max_new_tokens": 8}, "rid": "t-1"}


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeSGLang, str]]:
    app = FakeSGLang()
    server = await serve(app, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def test_generate_and_streams_reuse_one_connection(up: Up, fake: tuple[FakeSGLang, str]) -> None:
    app, url = fake
    async with SGLangClient(up()) as client:
        assert await client.probe(url) == "ok"
        for _ in range(10):
            whole = await client.generate(url, BODY)
            chunks = [c async for c in client.stream(url, BODY)]
            assert "".join(c.text for c in chunks) == whole.text
            assert chunks[-1].finish_reason == "length" and whole.completion_tokens == 8
    # probe + server_info + 10 x (generate + stream): every call on the first connection
    assert app.requests["/generate"] == 20 and app.connections == 1


async def _burst(client: SGLangClient, url: str, n: int) -> None:
    await asyncio.gather(*(client.generate(url, BODY) for _ in range(n)))


@pytest.mark.parametrize(("keepalive", "reopened"), [(2, 6), (64, 0)])
async def test_idle_connections_are_capped_by_max_keepalive(
    up: Up, fake: tuple[FakeSGLang, str], keepalive: int, reopened: int
) -> None:
    app, url = fake
    async with SGLangClient(up(max_keepalive_connections=keepalive)) as client:
        await _burst(client, url, 8)
        assert app.connections == 8  # 8 calls in flight at once: 8 connections
        await _burst(client, url, 8)
        # kept idle after the first burst: min(8, keepalive); the second burst opens the rest anew
        assert app.connections - 8 == reopened


async def test_a_connection_idle_past_keepalive_is_not_reused(up: Up, fake: tuple[FakeSGLang, str]) -> None:
    """``keepalive_s`` is below the worker's own idle timeout, so a call never goes out on a connection
    the worker is closing: one idle longer is closed, the next call opens another."""
    app, url = fake
    async with SGLangClient(up(keepalive_s=0.2)) as client:
        await client.generate(url, BODY)
        await client.generate(url, BODY)
        assert app.connections == 1
        await asyncio.sleep(0.4)
        await client.generate(url, BODY)
        assert app.connections == 2


async def test_a_worker_restarted_on_its_port_is_called_on_a_new_connection(up: Up) -> None:
    """The pooled connection to a worker that stopped is closed by it; after a restart on the same port the
    next call opens a new connection instead of failing on the stale one."""
    port = free_port()
    async with SGLangClient(up()) as client:
        for _ in range(2):
            worker = FakeWorker()
            with ThreadedServer(worker.app, port=port) as server:
                assert (await client.generate(server.url, BODY)).completion_tokens > 0
                assert (await client.generate(server.url, BODY)).completion_tokens > 0
            await asyncio.sleep(0.1)  # the closed connection's end reaches the client


async def test_an_exhausted_pool_is_local_and_probes_say_unknown(
    up: Up, fake: tuple[FakeSGLang, str]
) -> None:
    _, url = fake
    settings = UpstreamSettings(max_connections=1, pool_timeout_s=0.1)
    async with SGLangClient(settings) as client:
        held = client.stream(url, BODY)
        await held.__anext__()  # one stream open: the only connection is taken
        with pytest.raises(UpstreamError) as caught:
            await client.generate(url, BODY)
        assert caught.value.local and not caught.value.retryable and caught.value.status is None
        assert await client.probe(url, timeout_s=0.1) == "unknown"
        await held.aclose()  # abandoned half-way: its connection is closed, the slot freed
        assert (await client.generate(url, BODY)).completion_tokens == 8


async def test_a_refused_connection_is_refused(up: Up) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with SGLangClient(up()) as client:
        with pytest.raises(UpstreamError) as caught:
            await client.generate(dead, BODY)
        assert caught.value.refused and caught.value.retryable
        assert await client.probe(dead) == "refused"


async def test_sse_lines_longer_than_the_read_buffer_are_parsed(up: Up) -> None:
    worker = FakeWorker()
    worker.tokens = ["a" * 300_000, " b"]  # one SSE line of about 300 KB
    with ThreadedServer(worker.app) as server:
        async with SGLangClient(up()) as client:
            text = "".join([c.text async for c in client.stream(server.url, BODY)])
    assert text == "a" * 300_000 + " b"


async def test_chunks_of_one_read_say_that_more_follow_at_once(up: Up, fake: tuple[FakeSGLang, str]) -> None:
    """A worker that sent several chunks in one write: each but the last of them says ``more_ready``, so
    the gateway may forward them in one write; chunks that come apart never do."""
    _, url = fake  # writes a whole streamed answer at once
    async with SGLangClient(up()) as client:
        together = [c async for c in client.stream(url, BODY)]
        worker = FakeWorker()
        worker.delay_s = 0.05  # one chunk per 50 ms
        with ThreadedServer(worker.app) as server:
            apart = [c async for c in client.stream(server.url, BODY)]
    assert len(together) >= 4 and len(apart) >= 2
    assert [c.more_ready for c in together] == [True] * (len(together) - 1) + [False]
    assert not any(c.more_ready for c in apart)


@pytest.mark.parametrize(
    "bad",
    [
        b'data: {"error": {"message": "engine failed"}}\n\n',  # an error event
        b'data: {"text": "hi there", "meta_info": {"finish_reason": {"type": "abort"}}}\n\n',  # aborted
        b"data: {not json\n\n",  # malformed
    ],
)
async def test_an_error_after_good_chunks_of_one_read_comes_after_them(up: Up, bad: bytes) -> None:
    """An error in the same read as good chunks is raised once those chunks are out (the client keeps
    what was generated; the stream resumes after it), and the last good chunk does not say that more
    follow at once: the resume elsewhere is a wait its events must not be held over."""
    good = b'data: {"text": "hi", "meta_info": {"completion_tokens": 1}}\n\n'

    async def answer(request: Request) -> Response:
        return Response(good + bad, media_type="text/event-stream")

    app = Starlette(routes=[Route("/generate", answer, methods=["POST"])])
    seen: list[tuple[str, bool]] = []
    with ThreadedServer(app) as server:
        async with SGLangClient(up()) as client:
            with pytest.raises(UpstreamError):
                async for chunk in client.stream(server.url, BODY):
                    seen.append((chunk.text, chunk.more_ready))
    assert seen == [("hi", False)]


async def test_load_is_read_from_a_metrics_endpoint_that_gzips_when_asked(up: Up) -> None:
    """SGLang serves /metrics with prometheus_client's ASGI app, which gzips the text for a client that
    accepts gzip; aiohttp sends ``Accept-Encoding: gzip`` by default and the pool does not decompress, so
    every load poll read gzip bytes as text and failed (windows never left window_initial)."""
    from prometheus_client import CollectorRegistry, Gauge, make_asgi_app
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from service.workers.worker_info import WorkerLoad

    registry = CollectorRegistry()
    for name, value in [
        ("sglang:num_running_reqs", 3),
        ("sglang:num_queue_reqs", 2),
        ("sglang:token_usage", 0.5),
    ]:
        Gauge(name, name, registry=registry).set(value)
    app = Starlette(routes=[Mount("/metrics", make_asgi_app(registry=registry))])
    with ThreadedServer(app) as server:
        async with SGLangClient(up()) as client:
            assert await client.load(server.url) == WorkerLoad(running=3, queued=2, kv_usage=0.5)


GARBAGE = [
    b"not json!!!",  # a proxy's or another server's text
    b"[1, 2, 3]",  # JSON, but not an object
    b'{"text": "hi", "meta_info": [1]}',  # meta_info of the wrong type
    b'{"text": "hi", "meta_info": {"prompt_tokens": "many", "finish_reason": {"type": "length"}}}',
]


@pytest.mark.parametrize("body", GARBAGE)
async def test_a_worker_answering_garbage_raises_upstream_error(up: Up, body: bytes) -> None:
    """A 200 whose body is not SGLang's answer (whole or as SSE) is the worker's failure
    (:class:`UpstreamError`, retried elsewhere and held against its breaker), never an unhandled
    parse error (a 500 to the tenant)."""

    async def answer(request: Request) -> Response:
        payload = await request.json()
        if payload.get("stream"):
            return Response(b"data: " + body + b"\n\ndata: [DONE]\n\n", media_type="text/event-stream")
        return Response(body, media_type="application/json")

    app = Starlette(routes=[Route("/generate", answer, methods=["POST"])])
    with ThreadedServer(app) as server:
        async with SGLangClient(up()) as client:
            with pytest.raises(UpstreamError) as whole:
                await client.generate(server.url, BODY)
            with pytest.raises(UpstreamError) as streamed:
                async for _ in client.stream(server.url, BODY):
                    pass
    for caught in (whole.value, streamed.value):
        assert caught.retryable and caught.status is None and not caught.rejected
        assert "malformed" in str(caught)


def test_the_native_client_runs_on_uvloop() -> None:
    """The gateway serves on uvloop, whose transports are not ``asyncio.Transport`` subclasses; the other
    tests here run on the default loop."""
    import uvloop

    worker = FakeWorker()

    async def calls(url: str) -> tuple[str, str]:
        async with SGLangClient(UpstreamSettings(http_client="httptools")) as client:
            whole = await client.generate(url, BODY)
            streamed = "".join([c.text async for c in client.stream(url, BODY)])
            return whole.text, streamed

    with ThreadedServer(worker.app) as server:
        whole, streamed = uvloop.run(calls(server.url))
    assert whole and whole == streamed


@contextlib.asynccontextmanager
async def raw_worker(answer: Callable[[int], list[bytes]]) -> AsyncIterator[str]:
    """A worker on bare asyncio streams that writes ``answer(n)`` for its n-th request (each piece, then a
    short pause), closing the connection after a piece ``b"CLOSE"``; yields its URL."""
    count = 0
    tasks: set[asyncio.Task[object]] = set()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                count += 1
                for piece in answer(count):
                    if piece == b"CLOSE":
                        writer.close()
                        return
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.05)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()  # a cancelled handler ends quietly (asyncio's callback would log it)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _answer(text: str, stream: bool, head: bytes = b"") -> bytes:
    payload = {
        "text": text,
        "output_ids": [1],
        "meta_info": {"completion_tokens": 1, "finish_reason": "length"},
    }
    body = orjson.dumps(payload)
    if stream:
        body = b"data: " + body + b"\n\ndata: [DONE]\n\n"
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (len(body), head) + body


async def _text(client: SGLangClient, url: str, stream: bool) -> str:
    if stream:
        return "".join([c.text async for c in client.stream(url, BODY)])
    return (await client.generate(url, BODY)).text


@pytest.mark.parametrize("stream", [False, True])
async def test_an_informational_answer_is_skipped(up: Up, stream: bool) -> None:
    """A ``100 Continue`` (or ``103 Early Hints``) read apart from the answer after it is not the answer:
    the native client took its status for the answer's and left the real one on the pooled connection,
    where the next request read it as its own (another tenant's text)."""
    first = [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"]

    def answer(n: int) -> list[bytes]:
        return [*first, _answer("first", stream)] if n == 1 else [_answer("second", stream)]

    async with raw_worker(answer) as url, SGLangClient(up()) as client:
        client._info[url] = WorkerInfo()
        texts = [await _text(client, url, stream), await _text(client, url, stream)]
    assert texts == ["first", "second"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_connection_that_spoke_while_idle_is_not_reused(stream: bool) -> None:
    """Bytes a worker sends on an idle pooled connection (a late duplicate answer, a ``408`` before it
    closes) answer nothing the gateway asked: the native client closes that connection, where it read them
    as the next call's answer (a stale answer, or a 408 that would reach a tenant as its input's fault).
    (aiohttp's client has the same fault, here left alone: it reads them as the next answer.)"""
    late = [b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 4\r\n\r\nlate", _answer("stale", stream)]

    def answer(n: int) -> list[bytes]:
        return [_answer("first", stream), *late] if n == 1 else [_answer("second", stream)]

    settings = UpstreamSettings(http_client="httptools")
    async with raw_worker(answer) as url, SGLangClient(settings) as client:
        client._info[url] = WorkerInfo()
        first = await _text(client, url, stream)
        await asyncio.sleep(0.3)  # the late bytes came while the connection was idle
        texts = [first, await _text(client, url, stream), await _text(client, url, stream)]
    assert texts == ["first", "second", "second"]


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_that_ends_with_its_connection_is_whole(up: Up, stream: bool) -> None:
    """An answer with neither ``Content-Length`` nor chunks ends where the worker closes the connection
    (RFC 9112 6.3; an HTTP/1.0 server, some proxies): the native client failed every such answer as cut
    short ("connection lost mid-answer"), retried and held against the worker, where aiohttp reads it."""

    def answer(n: int) -> list[bytes]:
        whole = _answer(f"answer {n}", stream)
        body = whole.split(b"\r\n\r\n", 1)[1]
        return [b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n", body, b"CLOSE"]

    async with raw_worker(answer) as url, SGLangClient(up()) as client:
        client._info[url] = WorkerInfo()
        texts = [await _text(client, url, stream), await _text(client, url, stream)]
    assert texts == ["answer 1", "answer 2"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_worker_that_never_answers_times_out_after_read_timeout(up: Up, stream: bool) -> None:
    """A worker that takes the request and stays silent (a hung engine, a stopped process) fails the
    call after ``read_timeout_s``: aiohttp's client waited forever on a non-streamed one (its per-call
    ``timeout=None`` is no timeout at all, not the session's)."""
    async with raw_worker(lambda n: []) as url, SGLangClient(up(read_timeout_s=0.3)) as client:
        client._info[url] = WorkerInfo()
        started = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamError) as caught:
            await asyncio.wait_for(_text(client, url, stream), 5)
        waited = asyncio.get_running_loop().time() - started
    assert caught.value.retryable and waited < 2


async def test_an_endless_answer_head_fails_the_call(up: Up) -> None:
    """Headers that never end (a broken worker or proxy) fail the call once past a bound, as aiohttp's
    8 KiB line limit does, instead of growing in memory for as long as the worker sends them."""
    endless = [b"HTTP/1.1 200 OK\r\nX-Padding: "] + [b"a" * 65536] * 40  # 2.6 MB over 2 s
    async with raw_worker(lambda n: endless) as url, SGLangClient(up(read_timeout_s=5)) as client:
        started = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamError) as caught:
            await client.generate(url, BODY)
        waited = asyncio.get_running_loop().time() - started
    assert caught.value.retryable and caught.value.status is None and waited < 1


async def test_connections_the_worker_closed_leave_nothing_in_the_pool() -> None:
    """Idle connections a worker closes (its keep-alive timeout, a restart) leave the native pool's books
    at once, not when a later call to that worker looks at them: a worker no longer called (removed,
    drained) left every closed connection of its in the pool for the life of the process."""
    answers = [_answer("hi", False, b"Connection: keep-alive\r\n"), b"CLOSE"]
    settings = UpstreamSettings(http_client="httptools")
    async with raw_worker(lambda n: answers) as url, SGLangClient(settings) as client:
        await asyncio.gather(*(client.generate(url, BODY) for _ in range(4)))
        await asyncio.sleep(0.2)  # the worker closed each idle connection
        http = cast(NativeWorkerHTTP, client._http)
        assert not http._open_conns and not http._idle


async def test_a_connection_whose_request_said_close_is_not_reused() -> None:
    """A call sent with ``Connection: close`` (over ``max_keepalive_connections`` in flight) never has its
    connection reused, even when the worker ignores the option and keeps it open (RFC 9112 9.6: the
    client sends no further request on it); the native pool kept it idle, past its cap."""
    settings = UpstreamSettings(http_client="httptools", max_keepalive_connections=0)
    async with raw_worker(lambda n: [_answer("hi", False)]) as url, SGLangClient(settings) as client:
        await asyncio.gather(*(client.generate(url, BODY) for _ in range(3)))
        http = cast(NativeWorkerHTTP, client._http)
        assert not http._idle and not http._open_conns


async def test_keepalive_counts_from_the_end_of_the_answer(fake: tuple[FakeSGLang, str]) -> None:
    """A connection's idle time runs from the end of its answer, when the worker's own idle timer starts,
    not from when its caller was done with it: a stream held by a slow client after its last chunk was
    pooled as fresh and could be reused past the worker's keep-alive timeout, as it closed it. (aiohttp's
    client counts from the release: reported.)"""
    app, url = fake  # writes a whole streamed answer at once
    async with SGLangClient(UpstreamSettings(http_client="httptools", keepalive_s=0.2)) as client:
        await client.probe(url)
        async for chunk in client.stream(url, BODY):
            if chunk.finish_reason is not None:
                await asyncio.sleep(0.3)  # a slow client: the answer has long ended at the worker
        before = app.connections
        await client.generate(url, BODY)
    assert app.connections == before + 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\x00", b"\n")), max_size=20))
def test_lines_split_over_reads_are_the_lines_of_the_whole(reads: list[bytes]) -> None:
    """``split_read`` over any cut of a body into reads gives the body's lines, in order, the unfinished
    last one left in ``pending`` (which grows in place: a long line in many reads is copied once)."""
    pending = bytearray()
    lines: list[bytes] = []
    for data in reads:
        lines += split_read(pending, data)
    whole = b"".join(reads).split(b"\n")
    assert lines == whole[:-1] and bytes(pending) == whole[-1]

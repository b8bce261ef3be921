"""service/runtime/http_protocol.py: writes of one event-loop step go out as one, in order, and nothing is
lost or
written after a close; end to end under uvicorn (keep-alive, pipelining, 100-continue, streams, close)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from service.runtime.http_protocol import CoalescingTransport
from tests.support.servers import ThreadedServer


class RecordingTransport(asyncio.Transport):
    """Records what reaches the socket."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = self.aborted = False

    def write(self, data: Any) -> None:
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed or self.aborted

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_write_buffer_size(self) -> int:
        return 7

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5)}.get(name, default)


async def test_the_writes_of_one_step_go_out_as_one_write_in_order() -> None:
    raw = RecordingTransport()
    t = CoalescingTransport(raw, asyncio.get_running_loop())
    t.write(b"HTTP/1.1 200 OK\r\n\r\n")
    t.write(b"")
    t.write(b"body")
    assert raw.writes == [] and t.get_write_buffer_size() == len(b"HTTP/1.1 200 OK\r\n\r\nbody") + 7
    await asyncio.sleep(0)
    assert raw.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    t.writelines([b"a", b"b"])
    await asyncio.sleep(0)
    t.write(b"c")  # a later step: a write of its own
    await asyncio.sleep(0)
    assert raw.writes[1:] == [b"ab", b"c"]
    assert t.get_extra_info("peername") == ("127.0.0.1", 5)  # the rest is the wrapped transport's


async def test_close_writes_what_is_held_first_and_nothing_is_written_after_it() -> None:
    raw = RecordingTransport()
    t = CoalescingTransport(raw, asyncio.get_running_loop())
    t.write(b"last answer")
    t.close()
    assert raw.writes == [b"last answer"] and raw.closed
    t.write(b"late")
    await asyncio.sleep(0)  # the flush finds the transport closing: nothing written, nothing raised
    assert raw.writes == [b"last answer"] and t.is_closing()


async def test_abort_drops_what_is_held() -> None:
    raw = RecordingTransport()
    t = CoalescingTransport(raw, asyncio.get_running_loop())
    t.write(b"never sent")
    t.abort()
    await asyncio.sleep(0)
    assert raw.writes == [] and raw.aborted


# -- end to end under uvicorn -------------------------------------------------------------------------


async def _json(request: Request) -> Response:
    body = await request.body()
    return JSONResponse({"len": len(body)})


async def _stream(request: Request) -> Response:
    async def events() -> AsyncGenerator[bytes, None]:
        for i in range(5):
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0.001)

    return StreamingResponse(events(), media_type="text/event-stream")


APP = Starlette(routes=[Route("/json", _json, methods=["POST"]), Route("/stream", _stream)])


def _read_until_closed(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


@pytest.fixture(scope="module")
def server() -> Any:
    with ThreadedServer(APP) as srv:  # the protocol the gateway serves with
        yield srv


def test_pipelined_keep_alive_requests_then_close(server: ThreadedServer) -> None:
    post = b"POST /json HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
    last = b"POST /json HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nConnection: close\r\n\r\nz"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(post + post + last)  # three requests in one segment
        raw = _read_until_closed(sock)
    answers = raw.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert len(answers) == 3
    assert [a.rsplit(b"\r\n\r\n", 1)[1] for a in answers] == [b'{"len":3}', b'{"len":3}', b'{"len":1}']
    assert b"connection: close" in answers[2].lower()


def test_expect_100_continue_then_the_answer(server: ThreadedServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /json HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(b"wxyz")
        data = b""
        while not data.endswith(b'{"len":4}'):
            data += sock.recv(65536)
    assert data.startswith(b"HTTP/1.1 200 OK")


def test_a_stream_arrives_whole_and_in_order(server: ThreadedServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        raw = _read_until_closed(sock)
    head, body = raw.split(b"\r\n\r\n", 1)
    assert b"transfer-encoding: chunked" in head.lower()
    chunks, rest = [], body
    while True:  # decode the chunked body
        size_line, rest = rest.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            break
        chunks.append(rest[:size])
        rest = rest[size + 2 :]
    assert b"".join(chunks) == b"".join(f"data: {i}\n\n".encode() for i in range(5))


def test_a_non_streamed_answer_leaves_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers and body of one answer reach the socket together (uvicorn writes them apart)."""
    flushed: list[int] = []
    original = CoalescingTransport.flush

    def counting(self: CoalescingTransport) -> None:
        flushed.append(len(self._held))
        original(self)

    monkeypatch.setattr(CoalescingTransport, "flush", counting)
    with ThreadedServer(APP) as srv, socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(b"POST /json HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi")
        raw = _read_until_closed(sock)
    assert raw.endswith(b'{"len":2}')
    assert 2 in flushed  # the status line and headers, and the body: one write

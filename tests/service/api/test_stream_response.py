"""The streaming response on its own ASGI channels: body sent, disconnect races the body, and nothing it
does leaves cyclic garbage behind (the collector's cost grows with every object it has to find)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncGenerator

import pytest
from starlette.types import Message

from service.api.cancellation import SendBoundedStreamingResponse
from service.runtime.task_stop import finish_despite_cancel

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "path": "/"}


def test_a_stream_is_sent_whole_and_leaves_no_cyclic_garbage() -> None:
    """On a fresh event loop: the suite's session loop holds what earlier tests left (a transport closed on
    it becomes garbage when the loop next runs), which is not this response's garbage."""
    asyncio.run(_send_one_stream_and_count_garbage())


async def _send_one_stream_and_count_garbage() -> None:
    sent: list[Message] = []
    closed = asyncio.Event()  # the client stays connected until the test ends

    async def body() -> AsyncGenerator[bytes, None]:
        for i in range(3):
            await asyncio.sleep(0)
            yield f"data: {i}\n\n".encode()

    async def receive() -> Message:
        await closed.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    async def one() -> None:
        response = SendBoundedStreamingResponse(body(), 30.0, "rid", media_type="text/event-stream")
        await response(SCOPE, receive, send)

    await one()  # warm: first-use caches are not garbage
    gc.collect()
    sent.clear()
    gc.disable()
    try:
        await asyncio.create_task(one())  # the task ends with the stream, as a server's request task does
        await asyncio.sleep(0)  # the watcher task's cancellation runs
        assert gc.collect() == 0
    finally:
        gc.enable()
        closed.set()
    bodies = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert bodies == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_a_client_that_disconnects_ends_the_body_and_the_response() -> None:
    started, body_closed = asyncio.Event(), asyncio.Event()

    async def body() -> AsyncGenerator[bytes, None]:
        try:
            yield b"data: first\n\n"
            started.set()
            await asyncio.sleep(3600)  # waits for a worker that never answers
            yield b"never"
        finally:
            body_closed.set()

    async def receive() -> Message:
        await started.wait()
        return {"type": "http.disconnect"}

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    response = SendBoundedStreamingResponse(body(), 30.0, "rid", media_type="text/event-stream")
    await asyncio.wait_for(response(SCOPE, receive, send), 5.0)  # returns, no error
    assert body_closed.is_set()
    assert [m.get("body") for m in sent if m["type"] == "http.response.body"] == [b"data: first\n\n"]


async def test_a_client_that_leaves_while_a_stalled_stream_closes_does_not_cut_its_close_short() -> None:
    # nu21: a stalled stream (no write taken for send_timeout_s) closed its body while the disconnect
    # watcher still ran; a client that left then (its socket closed as the gateway gave up on it) cancelled
    # that close part-way, and the body's own ending (abort at the worker, settle: awaited, shielded only
    # from anyio's scopes) never ran: tokens stayed reserved, nothing was charged, the worker kept going
    closing, closed = asyncio.Event(), asyncio.Event()

    async def body() -> AsyncGenerator[bytes, None]:
        try:
            yield b"data: first\n\n"
            yield b"data: second\n\n"
        finally:
            closing.set()
            await asyncio.sleep(0.2)  # the abort at the worker and the settle
            closed.set()

    async def receive() -> Message:
        await closing.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message.get("body"):
            await asyncio.sleep(3600)  # a client that stopped reading

    response = SendBoundedStreamingResponse(body(), 0.1, "rid", media_type="text/event-stream")
    await asyncio.wait_for(response(SCOPE, receive, send), 5.0)
    assert closed.is_set()


async def test_finish_despite_cancel_runs_the_work_to_its_end_through_repeated_cancels() -> None:
    """A clean-up (abort at the worker, settle, closing an upstream stream) is not cut short by a second
    cancel (a client that leaves, then a revocation): anyio's shield let a plain task.cancel() through."""
    steps: list[str] = []

    async def cleanup() -> str:
        for i in range(3):
            await asyncio.sleep(0.01)
            steps.append(f"step {i}")
        return "done"

    async def caller() -> str:
        return await finish_despite_cancel(cleanup())

    task = asyncio.create_task(caller())
    await asyncio.sleep(0.005)
    task.cancel()
    await asyncio.sleep(0.01)
    task.cancel()  # again, while the clean-up still runs
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["step 0", "step 1", "step 2"]  # every step ran before the cancellation came out
    assert await finish_despite_cancel(cleanup()) == "done"  # not cancelled: its result


async def test_finish_despite_cancel_raises_the_work_s_own_error() -> None:
    async def failing() -> None:
        await asyncio.sleep(0)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await finish_despite_cancel(failing())

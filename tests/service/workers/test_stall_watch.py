"""The worker-stream watchdog (service/workers/stall_watch.py): a read is cut after idle_s of silence once
armed, never before; time outside reads is not counted; another cancellation passes through."""

from __future__ import annotations

import asyncio
import time

import pytest

from service.workers.stall_watch import CallMoved, StallWatch, StreamStalled


async def test_an_armed_read_silent_for_idle_s_is_cut() -> None:
    with StallWatch(0.2) as watch:
        watch.arm()
        started = time.monotonic()
        with pytest.raises(StreamStalled):
            await watch.read(asyncio.sleep(10))
    assert 0.2 <= time.monotonic() - started < 0.6  # 1 to 1.25 x idle_s, plus scheduling


async def test_before_arm_reads_may_take_as_long_as_they_need() -> None:
    """Before the first token (a long prefill) only upstream.read_timeout_s bounds a read."""
    with StallWatch(0.1) as watch:
        assert await watch.read(asyncio.sleep(0.4, "first")) == "first"
        watch.arm()
        assert await watch.read(asyncio.sleep(0.05, "next")) == "next"


async def test_time_between_reads_is_not_counted() -> None:
    """A consumer that takes its time (a slow client) between reads is not the worker's silence."""
    with StallWatch(0.2) as watch:
        watch.arm()
        for _ in range(3):
            await asyncio.sleep(0.3)  # outside a read
            assert await watch.read(asyncio.sleep(0.01, "ok")) == "ok"


async def test_another_cancellation_is_not_taken_for_a_stall() -> None:
    async def reader(watch: StallWatch) -> None:
        await watch.read(asyncio.sleep(10))

    with StallWatch(5.0) as watch:
        watch.arm()
        task = asyncio.ensure_future(reader(watch))
        await asyncio.sleep(0.05)
        task.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_cut_read_raises_call_moved_at_once() -> None:
    """The drain deadline (service/workers/drain_deadline.py) cuts a call wherever it waits."""

    async def reader(watch: StallWatch) -> None:
        await watch.read(asyncio.sleep(10))

    with StallWatch(60.0) as watch:
        task = asyncio.ensure_future(reader(watch))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        assert watch.cut()
        with pytest.raises(CallMoved):
            await task
        assert time.monotonic() - started < 0.5
        assert not watch.cut()  # a call is cut once


async def test_a_call_cut_between_reads_stops_at_its_next_read() -> None:
    with StallWatch(60.0) as watch:
        assert await watch.read(asyncio.sleep(0.01, "first")) == "first"
        watch.cut()  # the consumer was busy: no read in progress
        step = asyncio.sleep(10)
        with pytest.raises(CallMoved):
            await watch.read(step)
        assert step.cr_frame is None  # closed, never left pending ("coroutine was never awaited")


async def test_a_client_that_leaves_during_a_cut_is_not_taken_for_a_move() -> None:
    async def reader(watch: StallWatch) -> None:
        await watch.read(asyncio.sleep(10))

    with StallWatch(60.0) as watch:
        task = asyncio.ensure_future(reader(watch))
        await asyncio.sleep(0.05)
        watch.cut()
        task.cancel()  # the client left in the same instant
        with pytest.raises(asyncio.CancelledError):
            await task

"""stop_tasks: a task whose code swallows a cancellation (as redis-py's client can) is still ended;
log_failure: a background task that fails is logged when it fails."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import structlog

from service.runtime.task_stop import log_failure, stop_tasks


async def _swallows_cancels(times: int, ended: list[str]) -> None:
    """A loop that, like a Redis call finishing despite the cancel, goes on after ``times`` cancels."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if times == 0:
                ended.append("cancelled")
                raise
            times -= 1


async def test_a_task_that_swallows_cancels_is_cancelled_until_it_ends() -> None:
    ended: list[str] = []
    tasks = [asyncio.create_task(_swallows_cancels(n, ended)) for n in (0, 1, 3)]
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_tasks(tasks, recancel_s=0.01), timeout=5)
    assert ended == ["cancelled"] * 3 and all(t.cancelled() for t in tasks)


async def test_a_task_that_failed_raises_its_error_after_all_ended() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    failing = asyncio.create_task(fails())
    ended: list[str] = []
    other = asyncio.create_task(_swallows_cancels(1, ended))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="boom"):
        await stop_tasks([failing, other], recancel_s=0.01)
    assert other.cancelled() and ended == ["cancelled"]


async def test_a_background_task_that_fails_is_logged_at_once() -> None:
    async def fails() -> None:
        raise RuntimeError("subscription parser refused a payload")

    async def returns() -> None:
        return None

    async def runs() -> None:
        await asyncio.sleep(10)

    with structlog.testing.capture_logs() as logs:
        tasks = [asyncio.create_task(f(), name=f.__name__) for f in (fails, returns, runs)]
        for task in tasks:
            task.add_done_callback(log_failure)
        await asyncio.sleep(0.05)  # the first two have ended; their callbacks ran
        tasks[2].cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    failed = [e for e in logs if e["event"] == "background_task_failed"]
    assert failed == [
        {
            "event": "background_task_failed",
            "log_level": "error",
            "task": "fails",
            "error": "RuntimeError: subscription parser refused a payload",
        }
    ]
    with contextlib.suppress(RuntimeError, asyncio.CancelledError):
        await asyncio.gather(*tasks)

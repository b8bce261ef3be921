"""Automatic pipelining of Lua script calls: the calls made while the event loop runs one round go to
Redis together, in one pipeline (one connection checkout, one write, one read of every reply).

Each call is still its own EVALSHA, atomic on its own and answered on its own, in the order made; only
the client's per-call cost (connection checkout and release, retry wrapper, one socket write and read
each) is shared. The idea is ioredis's ``enableAutoPipelining``; redis-py has no such mode. A batch of one
is sent as a plain call, so an unloaded gateway pays nothing for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

_Call = tuple[AsyncScript, Sequence[str], Sequence[str | int | float], "asyncio.Future[Any]"]


class ScriptBatcher:
    """Runs :class:`AsyncScript` calls, pipelining those made in the same event-loop round.

    Args:
        redis: the client whose pool the pipelines use.

    A transport failure of a pipeline (``ConnectionError``, ``TimeoutError``) is raised by every call in
    it, as each would have raised it alone; a script error (``ResponseError``) only by its own call.
    """

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._pending: list[_Call] | None = None  # the calls of this loop round, while collected
        self._flushes: set[asyncio.Task[None]] = set()

    async def run(self, script: AsyncScript, keys: Sequence[str], args: Sequence[str | int | float]) -> Any:
        """``await script(keys=keys, args=args)``, sent with the other calls of this loop round."""
        loop = asyncio.get_running_loop()
        if self._pending is not None:  # another call collects this round: join it
            future: asyncio.Future[Any] = loop.create_future()
            self._pending.append((script, keys, args, future))
            return await future
        batch: list[_Call] = [(script, keys, args, loop.create_future())]
        self._pending = batch
        try:
            await asyncio.sleep(0)  # one loop round: the callbacks ready now may add calls
        except asyncio.CancelledError:
            self._pending = None
            if len(batch) > 1:
                self._spawn(batch[1:])
            raise
        self._pending = None
        if len(batch) == 1:  # alone: a plain call
            return await script(keys=keys, args=args)
        self._spawn(batch)  # in a task of its own, so that no caller's cancellation cuts the others off
        return await batch[0][3]

    def _spawn(self, batch: list[_Call]) -> None:
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _send(self, batch: list[_Call]) -> None:
        if len(batch) == 1:
            await self._one(batch[0])
            return
        pipe = self._redis.pipeline(transaction=False)
        for script, keys, args, _ in batch:
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        try:
            replies = await pipe.execute(raise_on_error=False)
        except asyncio.CancelledError:  # the gateway is shutting down
            for *_, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # the whole pipeline failed (transport): every call fails with it
            for *_, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for call, reply in zip(batch, replies, strict=True):
            if isinstance(reply, NoScriptError):  # Redis restarted or flushed its scripts: load, call alone
                await self._one(call)
            elif not call[3].done():
                if isinstance(reply, Exception):
                    call[3].set_exception(reply)
                else:
                    call[3].set_result(reply)

    @staticmethod
    async def _one(call: _Call) -> None:
        script, keys, args, future = call
        try:
            reply = await script(keys=keys, args=args)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(reply)


__all__ = ["ScriptBatcher"]

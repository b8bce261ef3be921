"""Domain errors of the tenancy layer; only ``service/api/errors.py`` and the routes turn them into HTTP."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeAlias, TypeVar

import redis.exceptions

P = ParamSpec("P")
R = TypeVar("R")


class TenantExistsError(Exception):
    """Raised when creating a tenant whose id is taken."""


class TenantNotFoundError(Exception):
    """Raised when a tenant id is unknown (or was deleted while a request was using it)."""


class KeyNotFoundError(Exception):
    """Raised when a key id is unknown (or belongs to another tenant)."""


class StoreUnavailable(Exception):
    """Redis did not answer in time: its connection pool stayed exhausted past the wait bound, a call
    timed out (Redis slow or paused), it could not be reached, or it refused writes (full at its
    ``maxmemory``). Nothing is known to have been written.

    Attributes:
        operation: the store call that failed, e.g. ``"TenantStore.authenticate"``.
    """

    def __init__(self, operation: str, cause: BaseException) -> None:
        super().__init__(f"{operation}: {type(cause).__name__}: {cause}")
        self.operation = operation


# What makes Redis unavailable, as opposed to a bug in a command or script (ResponseError): transport
# errors and timeouts, a pool that stayed exhausted (BlockingConnectionPool: ConnectionError "No connection
# available."; the plain pool's MaxConnectionsError), a replica that is loading or read-only after failover,
# a server at its maxmemory that refuses writes ("OOM"; a script is refused at its first write, so nothing
# of it is written), a replica cut from its master ("MASTERDOWN").
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.MasterDownError,
    asyncio.TimeoutError,
    # on a Redis Cluster: no node reachable or the slots not covered (RedisClusterException; the setting
    # that names a non-cluster node is refused at startup: service.state.check_cluster_setting), the
    # cluster down (ClusterDownError, a ClusterError) or its redirections past their bound, a slot
    # migrating (TRYAGAIN)
    redis.exceptions.RedisClusterException,
    redis.exceptions.ClusterError,
    redis.exceptions.TryAgainError,
)


CallObserver: TypeAlias = Callable[[str, float], None]
"""Told ``(operation, seconds)`` after each timed store call (``radixgate_store_call_seconds``)."""


def store_operation(fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Decorate an async store method so that an unavailable Redis raises :class:`StoreUnavailable`.

    When the store (the method's ``self``) has an ``observe_call`` hook (:data:`CallObserver`, None:
    off), each call is timed (``time.perf_counter``, s) from its start to its answer or failure and
    reported under the method's qualified name, the ``operation`` of :class:`StoreUnavailable`."""
    return _guarded(fn, timed=True)


def untimed_store_operation(fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """:func:`store_operation` for a method that may answer with no Redis call (from a local cache, or
    with nothing to write): not timed here (its answers in microseconds would bury the Redis calls'
    latency); it times its own Redis calls (:func:`timed_call`)."""
    return _guarded(fn, timed=False)


async def timed_call(observe: CallObserver | None, operation: str, call: Awaitable[R]) -> R:
    """``await call``, told to ``observe`` (when set) as one call of ``operation`` that took the time
    from here to its answer or failure (``time.perf_counter``, s)."""
    if observe is None:
        return await call
    start = time.perf_counter()
    try:
        return await call
    finally:
        observe(operation, time.perf_counter() - start)


def _guarded(fn: Callable[P, Awaitable[R]], timed: bool) -> Callable[P, Coroutine[Any, Any, R]]:
    operation = fn.__qualname__

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        observe: CallObserver | None = getattr(args[0], "observe_call", None) if timed and args else None
        start = time.perf_counter() if observe is not None else 0.0
        try:
            return await fn(*args, **kwargs)
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(operation, exc) from exc
        finally:
            if observe is not None:
                observe(operation, time.perf_counter() - start)

    return wrapper

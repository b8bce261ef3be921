"""Domain errors of the tenancy layer; only ``service/api/errors.py`` and the routes turn them into HTTP."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

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
)


def store_operation(fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Decorate an async store method so that an unavailable Redis raises :class:`StoreUnavailable`."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(fn.__qualname__, exc) from exc

    return wrapper

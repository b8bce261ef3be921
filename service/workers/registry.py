"""Workers added through the admin API, shared by every gateway replica through Redis.

Layout: hash ``<prefix>workers`` mapping worker URL -> ``"active"`` or ``"draining"``; set
``<prefix>workers:discovered`` of the URLs that DNS discovery registered (:mod:`service.workers.discovery`
manages only those). Each replica
copies it into its own :class:`~service.workers.pool.WorkerPool` every sync period (routing state stays
per replica, as in SGLang's router, and converges through feedback). Workers from settings are local
to each replica and not in Redis. A starting replica syncs once before its first health probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from typing import Literal

import structlog
from redis.asyncio import Redis

from service.workers.pool import WorkerPool
from tenancy.errors import StoreUnavailable, store_operation

log = structlog.get_logger("radixgate.registry")

WorkerMode = Literal["active", "draining"]


def worker_id(url: str) -> str:
    """Stable short id of a worker URL (12 hex chars of its SHA-256), for admin routes."""
    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:12]


class WorkerRegistry:
    """The shared set of admin-managed workers.

    Args:
        redis: async client (``decode_responses=True``).
        prefix: Redis key prefix.
    """

    def __init__(self, redis: Redis, prefix: str) -> None:
        self._redis = redis
        self._key = f"{prefix}workers"
        self._discovered = f"{prefix}workers:discovered"

    @store_operation
    async def entries(self) -> dict[str, WorkerMode]:
        """URL -> mode of every registered worker."""
        raw = await self._redis.hgetall(self._key)
        return {str(k): "draining" if v == "draining" else "active" for k, v in raw.items()}

    @store_operation
    async def add(self, url: str) -> bool:
        """Register a worker as active; False if it was already registered (then it becomes active)."""
        url = url.rstrip("/")
        existed = await self._redis.hexists(self._key, url)
        await self._redis.hset(self._key, url, "active")
        return not existed

    @store_operation
    async def set_mode(self, url: str, mode: WorkerMode) -> bool:
        """Mark a registered worker active or draining; False if unknown."""
        if not await self._redis.hexists(self._key, url):
            return False
        await self._redis.hset(self._key, url, mode)
        return True

    @store_operation
    async def remove(self, url: str) -> bool:
        """Unregister a worker; False if unknown."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self._key, url)
            pipe.srem(self._discovered, url)
            removed, _ = await pipe.execute()
        return bool(removed)

    @store_operation
    async def discovered(self) -> dict[str, bool]:
        """The URLs registered by DNS discovery (and not removed since) -> whether each is draining."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.smembers(self._discovered)
            pipe.hgetall(self._key)
            members, entries = await pipe.execute()
        modes = {str(url): str(mode) for url, mode in entries.items()}
        return {str(url): modes.get(str(url)) == "draining" for url in members}

    @store_operation
    async def add_discovered(self, url: str) -> bool:
        """Register a worker found by discovery as active; False when the URL is registered otherwise
        (over the admin API: it stays the admin's, in the mode the admin set, never taken over).

        A URL that discovery registered before (draining since its record went) is made active again.
        """
        url = url.rstrip("/")
        if await self._redis.sismember(self._discovered, url):
            await self._redis.hset(self._key, url, "active")
            return True
        if not await self._redis.hsetnx(self._key, url, "active"):
            return False
        await self._redis.sadd(self._discovered, url)
        return True


def apply_registry(pool: WorkerPool, entries: dict[str, WorkerMode], managed: set[str]) -> set[str]:
    """Make ``pool`` follow the registry; returns the URLs now managed through it.

    ``managed`` is what the previous sync took from the registry: those no longer listed are removed
    (settings workers are never touched).
    """
    for url, mode in entries.items():
        state = pool.get(url)
        if state is None and mode == "active":
            pool.add(url)
            log.info("worker_added", worker=url)
        elif state is not None and mode == "draining" and not state.draining:
            pool.drain(url)
        elif state is not None and mode == "active":
            state.draining = False
    for url in managed - set(entries):
        if pool.remove(url):
            log.info("worker_removed", worker=url)
    return set(entries)


async def sync_once(pool: WorkerPool, registry: WorkerRegistry, managed: set[str]) -> set[str]:
    """One sync of ``pool`` with the registry (:func:`apply_registry`); an unavailable Redis changes
    nothing. Returns the URLs now managed through it."""
    with contextlib.suppress(StoreUnavailable):
        managed = apply_registry(pool, await registry.entries(), managed)
    return managed


async def sync_loop(
    pool: WorkerPool, registry: WorkerRegistry, interval_s: float, managed: set[str] | None = None
) -> None:
    """Follow the registry every ``interval_s`` seconds until cancelled (an unavailable Redis is skipped).

    Args:
        managed: what an earlier :func:`sync_once` took from the registry (the start-up sync, made before
            the pool's first probe so that a new process serves the registered workers from its first
            request on: a rolling restart's replacement would answer 503 ``no_worker_available`` until
            its first sync and probe otherwise).
    """
    managed = set() if managed is None else managed
    while True:
        await asyncio.sleep(interval_s)
        managed = await sync_once(pool, registry, managed)

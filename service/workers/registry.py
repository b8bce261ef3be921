"""The workers every gateway replica shares through Redis: added over the admin API, found by DNS discovery,
or listed in settings.

Layout: hash ``<prefix>workers`` mapping worker URL -> ``"active"`` or ``"draining"``; set
``<prefix>workers:discovered`` of the URLs that DNS discovery registered (:mod:`service.workers.discovery`
manages only those); set ``<prefix>workers:settings`` of the URLs some replica's settings list
(``upstream.workers``, the models' ``workers``). Each replica copies the hash into its own
:class:`~service.workers.pool.WorkerPool` every sync period (routing state stays per replica, as in
SGLang's router, and converges through feedback), so a worker drained on one replica (``POST
/admin/workers/{id}/drain``, its DNS record gone) is drained on every replica within one sync period,
whatever its source. A starting replica syncs once before its first health probe.

Workers listed in settings: each replica registers its own at every sync (active, unless registered
already: a worker drained stays drained across restarts until ``POST /admin/workers`` makes it active
again), serves only those its own settings list (a URL another replica lists is not added: dropping it from
the settings in a rolling deploy must not leave it served by the new replicas), follows their shared mode,
and never removes them. Launched workers (``engine.launch``) are local to their replica and not in Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Collection
from typing import Literal

import structlog

from service.workers.pool import WorkerPool
from tenancy.errors import StoreUnavailable, store_operation
from tenancy.redis_client import RedisClient

log = structlog.get_logger("radixgate.registry")

WorkerMode = Literal["active", "draining"]


def worker_id(url: str) -> str:
    """Stable short id of a worker URL (12 hex chars of its SHA-256), for admin routes."""
    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:12]


class WorkerRegistry:
    """The shared set of workers (module text).

    Args:
        redis: async client (``decode_responses=True``).
        prefix: RedisClient key prefix.
        listed: the worker URLs this replica's settings list (registered by :meth:`sync_entries`).
    """

    def __init__(self, redis: RedisClient, prefix: str, listed: Collection[str] = ()) -> None:
        self._redis = redis
        # one hash tag for the three: the transactions below name several, on Redis Cluster in one slot
        self._key = f"{prefix}{{workers}}"
        self._discovered = f"{prefix}{{workers}}:discovered"
        self._listed_key = f"{prefix}{{workers}}:settings"
        self.listed_here = frozenset(url.rstrip("/") for url in listed)

    @store_operation
    async def sync_entries(self) -> tuple[dict[str, WorkerMode], set[str]]:
        """Register this replica's settings workers (active unless registered already), then read every
        entry (URL -> mode) and the URLs some replica's settings list, in one transaction."""
        async with self._redis.pipeline(transaction=True) as pipe:
            for url in sorted(self.listed_here):
                pipe.hsetnx(self._key, url, "active")
            if self.listed_here:
                pipe.sadd(self._listed_key, *sorted(self.listed_here))
            pipe.hgetall(self._key)
            pipe.smembers(self._listed_key)
            *_, raw, listed = await pipe.execute()
        entries: dict[str, WorkerMode] = {
            str(k): "draining" if v == "draining" else "active" for k, v in raw.items()
        }
        return entries, {str(url) for url in listed}

    @store_operation
    async def listed(self) -> set[str]:
        """The URLs some replica's settings list (and registered)."""
        return {str(url) for url in await self._redis.smembers(self._listed_key)}

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
        """Unregister a worker; False if unknown. A worker some replica's settings still list is registered
        again by that replica's next sync."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self._key, url)
            pipe.srem(self._discovered, url)
            pipe.srem(self._listed_key, url)
            removed, *_ = await pipe.execute()
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


def apply_registry(
    pool: WorkerPool,
    entries: dict[str, WorkerMode],
    managed: set[str],
    listed_here: Collection[str] = frozenset(),
    listed_anywhere: Collection[str] = frozenset(),
) -> set[str]:
    """Make ``pool`` follow the registry; returns the URLs now managed through it.

    Args:
        entries: the registry's URL -> mode.
        managed: what the previous sync took from the registry: those no longer listed are removed
            (this replica's settings workers never are).
        listed_here: the workers this replica's settings list: they follow their mode (drained, or added
            again when active after a drain took them out).
        listed_anywhere: the workers some replica's settings list: one this replica does not list is not
            added (module text).
    """
    for url, mode in entries.items():
        state = pool.get(url)
        foreign = url in listed_anywhere and url not in listed_here
        if state is None and mode == "active" and not foreign:
            pool.add(url)
            log.info("worker_added", worker=url)
        elif state is not None and mode == "draining":
            pool.drain(url)  # a worker draining already keeps its deadline
        elif state is not None and mode == "active":
            pool.activate(url)
    for url in managed - set(entries):
        if pool.remove(url):
            log.info("worker_removed", worker=url)
    return set(entries) - set(listed_here)


async def sync_once(pool: WorkerPool, registry: WorkerRegistry, managed: set[str]) -> set[str]:
    """One sync of ``pool`` with the registry (:meth:`WorkerRegistry.sync_entries`, then
    :func:`apply_registry`); an unavailable Redis changes nothing. Returns the URLs now managed through
    it."""
    with contextlib.suppress(StoreUnavailable):
        entries, listed = await registry.sync_entries()
        managed = apply_registry(pool, entries, managed, registry.listed_here, listed)
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

"""The Redis client radixgate's stores take: one Redis (:class:`redis.asyncio.Redis`) or a Redis Cluster
(:class:`BoundedRedisCluster`), as ``redis.cluster`` in the settings says
(:func:`service.state.connect_redis`).

Both run every call the stores make: single-key commands, Lua scripts whose keys share one hash slot (every
key a tenant owns carries its hash tag: :mod:`tenancy.layout`), ``WATCH``/``MULTI`` transactions on one
key's slot, and non-transactional pipelines (split by node on a cluster)."""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Any, TypeAlias

import redis
from redis.asyncio import Redis, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

RedisClient: TypeAlias = "Redis | RedisCluster"
"""A client of one Redis or of a Redis Cluster (``decode_responses=True``)."""

_HOLDING: ContextVar[bool] = ContextVar("radixgate_cluster_permit", default=False)


class BoundedRedisCluster(RedisCluster):
    """A Redis Cluster client whose commands wait for a free connection, as one Redis's blocking pool does.

    redis-py's cluster client opens at most ``max_connections`` connections per node and fails a command at
    once (``MaxConnectionsError``) when all are busy: a burst of calls past it would each be a 503. Here a
    command first takes one of ``limit`` permits (:meth:`bound`), waiting up to ``wait_s`` for one; each
    node allows more connections than that, so a permitted command always finds one. A command sent from
    inside another (a multi-key command split by slot) runs on its caller's permit.

    Raises (from :meth:`execute_command`):
        redis.exceptions.ConnectionError: no permit within ``wait_s`` (what
            :class:`tenancy.errors.StoreUnavailable` reports as a pool that stayed exhausted).
    """

    _permits: asyncio.Semaphore | None = None
    _wait_s: float = 1.0

    def bound(self, limit: int, wait_s: float) -> BoundedRedisCluster:
        """Allow ``limit`` commands at once, each waiting up to ``wait_s`` (s) for its turn; returns self."""
        self._permits, self._wait_s = asyncio.Semaphore(limit), wait_s
        return self

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        """Run a command once a permit is free (see the class)."""
        permits = self._permits
        if permits is None or _HOLDING.get():
            return await super().execute_command(*args, **kwargs)
        try:
            await asyncio.wait_for(permits.acquire(), self._wait_s)
        except TimeoutError:
            raise RedisConnectionError("no free Redis Cluster connection (pool_timeout_s)") from None
        token = _HOLDING.set(True)
        try:
            return await super().execute_command(*args, **kwargs)
        finally:
            _HOLDING.reset(token)
            permits.release()


def cluster_mismatch(url: str, cluster: bool, timeout_s: float = 2.0) -> str | None:
    """A sentence for the operator when the server at ``url`` and the ``redis.cluster`` setting disagree (a
    Redis Cluster node named as one Redis, or one Redis named as a cluster: the first would answer
    ``MOVED`` for most tenants, the second cannot start its client); None when they agree or the server
    cannot be reached now (the gateway then starts and answers 503 until it can). Asks ``INFO cluster``
    (``cluster_enabled``), with a synchronous client of its own."""
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s) as client:
            enabled = str(client.info("cluster").get("cluster_enabled", "0")) == "1"
    except (redis.RedisError, OSError):
        return None
    if cluster and not enabled:
        return (
            "RADIXGATE_REDIS__CLUSTER is true but RADIXGATE_REDIS__URL names a Redis that is not a cluster "
            "node (cluster_enabled:0): unset it for one Redis"
        )
    if enabled and not cluster:
        return (
            "RADIXGATE_REDIS__URL names a node of a Redis Cluster (cluster_enabled:1): set "
            "RADIXGATE_REDIS__CLUSTER=true (docs/redis-cluster.md)"
        )
    return None


def is_cluster(client: RedisClient) -> bool:
    """Whether ``client`` talks to a Redis Cluster."""
    return isinstance(client, RedisCluster)


__all__ = ["BoundedRedisCluster", "RedisClient", "cluster_mismatch", "is_cluster"]

"""The Redis client radixgate's stores take: one Redis (:class:`redis.asyncio.Redis`) or a Redis Cluster
(:class:`redis.asyncio.RedisCluster`), as ``redis.cluster`` in the settings says
(:func:`service.state.connect_redis`).

Both run every call the stores make: single-key commands, Lua scripts whose keys share one hash slot (every
key a tenant owns carries its hash tag: :mod:`tenancy.layout`), ``WATCH``/``MULTI`` transactions on one
key's slot, and non-transactional pipelines (split by node on a cluster)."""

from __future__ import annotations

from typing import TypeAlias

from redis.asyncio import Redis, RedisCluster

RedisClient: TypeAlias = Redis | RedisCluster
"""A client of one Redis or of a Redis Cluster (``decode_responses=True``)."""


def is_cluster(client: RedisClient) -> bool:
    """Whether ``client`` talks to a Redis Cluster."""
    return isinstance(client, RedisCluster)


__all__ = ["RedisClient", "is_cluster"]

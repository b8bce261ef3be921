"""The tenancy tests run twice: against one redis-server and against a real Redis Cluster of three nodes
(tests/support/redis_cluster.py), where every Lua call must name keys of one slot (the tenant's hash tag).
Tests of what only one Redis has (the script batcher's pipelines on its one pool, a paused server) take
``one_redis_client``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NamedTuple

import pytest
import redis.asyncio as aioredis

from tenancy.redis_client import BoundedRedisCluster, RedisClient


class RedisTarget(NamedTuple):
    """Which Redis a test runs against: ``kind`` "redis" (one server) or "cluster", and a URL of it (of
    one node, for a cluster)."""

    kind: str
    url: str


@pytest.fixture(params=["redis", "cluster"])
def redis_target(request: pytest.FixtureRequest, redis_url: str) -> RedisTarget:
    """One redis-server or the session's Redis Cluster."""
    if request.param == "cluster":
        return RedisTarget("cluster", request.getfixturevalue("redis_cluster_url"))
    return RedisTarget("redis", redis_url)


@pytest.fixture
async def redis_client(redis_target: RedisTarget) -> AsyncIterator[RedisClient]:
    """An async client on flushed data: of the session's redis-server, or of its Redis Cluster (bounded as
    the gateway bounds it: service/state.py connect_cluster)."""
    client: RedisClient
    if redis_target.kind == "cluster":
        cluster = BoundedRedisCluster.from_url(redis_target.url, decode_responses=True, max_connections=128)
        client = cluster.bound(64, 5.0)
    else:
        client = aioredis.Redis.from_url(redis_target.url, decode_responses=True)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture
async def one_redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """An async client of the session's one redis-server, on a flushed database."""
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    await client.flushdb()
    yield client
    await client.aclose()

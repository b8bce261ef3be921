"""Settles a stopping gateway could not land go to a local journal and are replayed, each at most once, by
the next process (service/pipeline/settle_journal.py, issue 31). Real Redis; Redis "down" is its only pooled
connection held."""

from __future__ import annotations

import asyncio
import os
import pickle
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.asyncio import BlockingConnectionPool

from service.config.settings import RedisSettings
from service.observability.metrics import GatewayMetrics
from service.pipeline.settle_journal import SettleJournal
from service.pipeline.settlement import Settlement, Settler
from tenancy.models import Quotas
from tenancy.quota import QuotaLimiter, Reservation
from tenancy.usage import UsageRecorder

QUOTAS = Quotas(tokens_per_min=0.001, token_burst=1000)
SERVED = {"requests": 1, "prompt_tokens": 7, "completion_tokens": 3}


@pytest.fixture
async def one_connection(redis_client: aioredis.Redis, redis_url: str) -> AsyncIterator[aioredis.Redis]:
    pool = BlockingConnectionPool.from_url(redis_url, max_connections=1, timeout=0.05, decode_responses=True)
    client = aioredis.Redis.from_pool(pool)
    yield client
    await client.aclose()


def settler_on(client: aioredis.Redis, journal: Path) -> tuple[Settler, GatewayMetrics]:
    metrics = GatewayMetrics(CollectorRegistry(), 10)
    cfg = RedisSettings.model_validate(
        {
            "settle_backoff_s": 0.02,
            "settle_backoff_max_s": 0.05,
            "settle_drain_s": 0.2,
            "settle_journal_dir": journal,
        }
    )
    return Settler(QuotaLimiter(client, "j:"), cfg, metrics), metrics


def files(folder: Path, pattern: str) -> list[Path]:
    return list(folder.glob(pattern))


def count(metrics: GatewayMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


async def test_what_a_stopping_gateway_could_not_settle_is_replayed_once_by_the_next(
    one_connection: aioredis.Redis, tmp_path: Path
) -> None:
    usage = UsageRecorder(one_connection, "j:")
    stopping, metrics = settler_on(one_connection, tmp_path)
    held = await one_connection.connection_pool.get_connection()  # Redis unavailable from here
    item = Settlement("rid-j1", Reservation("t", QUOTAS, 1, 20), 10, SERVED)
    assert await stopping.settle(item) == "deferred"
    await asyncio.wait_for(stopping.drain(), 5)  # Redis still down through the drain
    late = Settlement("rid-j2", Reservation("t", QUOTAS, 1, 20), 10, SERVED)
    assert await stopping.settle(late) == "deferred"  # failed after the drain: to the journal as well
    assert count(metrics, "radixgate_settle_failures_total") == 0
    assert count(metrics, "radixgate_settle_journaled_total") == 2
    assert len(files(tmp_path, "settles-*.journal")) == 2
    await one_connection.connection_pool.release(held)  # Redis back; the next process starts
    starting, _ = settler_on(one_connection, tmp_path)
    await starting.replay()
    got = await usage.get("t")
    assert (got.requests, got.prompt_tokens, got.completion_tokens) == (2, 14, 6)
    assert not files(tmp_path, "settles-*")  # claimed and deleted
    # a journal of a settle that did land (its marker lives) changes nothing when replayed again
    SettleJournal(tmp_path, 10).write([item])
    await settler_on(one_connection, tmp_path)[0].replay()
    assert (await usage.get("t")).requests == 2


def test_a_journal_is_claimed_by_one_process_bounded_and_a_foreign_one_set_aside(tmp_path: Path) -> None:
    item = Settlement("rid-c", Reservation("t", QUOTAS, 1, 20), 10, SERVED)
    assert SettleJournal(tmp_path, 3, pid=1).write([item] * 5) == 3  # bounded
    first, second = SettleJournal(tmp_path, 3, pid=2), SettleJournal(tmp_path, 3, pid=3)
    assert len(first.claim()) == 3 and second.claim() == []
    (tmp_path / "settles-9-x.journal").write_bytes(pickle.dumps((99, 0.0, [item])))  # another format
    (tmp_path / "settles-9-y.journal").write_bytes(b"torn")
    assert first.claim() == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["settles-9-x.unreadable", "settles-9-y.unreadable"]
    assert SettleJournal(tmp_path / "none", 3).claim() == []
    assert os.listdir(tmp_path)  # nothing deleted that was not replayed

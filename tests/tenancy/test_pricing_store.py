"""Model prices in Redis over the settings' (tenancy/pricing_store.py): a replica's book reads them at most
every ttl, at once after an invalidation, one read at a time, and keeps its last table when Redis fails."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from policies.pricing import FREE, ModelPrice
from tenancy.errors import StoreUnavailable
from tenancy.pricing_store import PriceBook, PriceStore

DEFAULT = ModelPrice(150_000, 75_000, 600_000)
ADMIN = ModelPrice(3_000_000, 300_000, 15_000_000)


class FailingStore(PriceStore):
    """A store whose reads fail while ``down`` (Redis unreachable), counting them."""

    down = False
    reads = 0

    async def overrides(self) -> dict[str, ModelPrice]:
        self.reads += 1
        await asyncio.sleep(0.01)  # a read in flight: concurrent callers wait for it
        if self.down:
            raise StoreUnavailable("PriceStore.overrides", ConnectionError("down"))
        return await super().overrides()


async def test_book_reads_admin_prices_over_defaults_once_per_ttl(redis_client: aioredis.Redis) -> None:
    store = FailingStore(redis_client, "price:")
    now = [0.0]
    book = PriceBook(store, {"a": DEFAULT}, ttl_s=1.0, clock=lambda: now[0])
    assert book.fresh("a") is None  # nothing read yet
    prices = await asyncio.gather(*(book.price("a") for _ in range(20)))
    assert prices == [DEFAULT] * 20 and store.reads == 1  # one read for twenty callers
    assert await book.price("unpriced") == FREE
    await store.set("a", ADMIN)  # an admin's price wins over the settings'
    assert book.fresh("a") == DEFAULT  # until the ttl ends, or the invalidation arrives
    book.on_invalidation("price:a")
    assert await book.price("a") == ADMIN and store.reads == 2
    table, overrides = await book.table()
    assert table == {"a": ADMIN} and overrides == {"a": ADMIN}
    assert await store.clear("a") and not await store.clear("a")
    now[0] += 1.5  # stale: read again
    assert await book.price("a") == DEFAULT


async def test_book_keeps_its_last_table_when_redis_fails(redis_client: aioredis.Redis) -> None:
    store = FailingStore(redis_client, "price2:")
    store.down = True
    now = [0.0]
    book = PriceBook(store, {"a": DEFAULT}, ttl_s=1.0, clock=lambda: now[0])
    with pytest.raises(StoreUnavailable):  # no table yet: the request fails (503), as its reservation would
        await book.price("a")
    store.down = False
    await store.set("a", ADMIN)
    assert await book.price("a") == ADMIN
    store.down = True
    now[0] += 5
    assert await book.price("a") == ADMIN  # stale, and logged, rather than failing every request
    assert book.fresh("a") == ADMIN  # for another ttl

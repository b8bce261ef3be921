"""Model prices set by an admin, in Redis (every replica sees them), over the settings' defaults, and a
replica's short-lived memory of them (:class:`PriceBook`).

The prices live in one hash (``P prices``: model id -> JSON of whole micro-dollars per million tokens,
:class:`policies.pricing.ModelPrice`). A write publishes ``price:<model>`` on the invalidation channel of
:mod:`tenancy.auth_cache`; every replica's :class:`PriceBook` then reads the table again on its next use. A
lost message costs at most ``ttl_s``: the book never answers from a table older than that.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from typing import cast

import structlog
from redis.exceptions import RedisClusterException, RedisError

from policies.pricing import FREE, ModelPrice
from tenancy.auth_cache import invalidation_channel
from tenancy.errors import CallObserver, StoreUnavailable, store_operation
from tenancy.layout import KeyLayout
from tenancy.redis_client import RedisClient

log = structlog.get_logger("radixgate.pricing")


def _encode(price: ModelPrice) -> str:
    return json.dumps({"input": price.input, "cached_input": price.cached_input, "output": price.output})


def _decode(raw: str) -> ModelPrice:
    data = json.loads(raw)
    return ModelPrice(int(data["input"]), int(data["cached_input"]), int(data["output"]))


def _retrieved(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


class PriceStore:
    """The admin's prices in Redis.

    Args:
        redis: async client (``decode_responses=True``).
        prefix: RedisClient key prefix.

    ``observe_call``: told each call's latency (:func:`tenancy.errors.store_operation`).
    """

    observe_call: CallObserver | None = None

    def __init__(self, redis: RedisClient, prefix: str) -> None:
        self._redis = redis
        self._layout = KeyLayout(prefix)
        self._channel = invalidation_channel(prefix)

    @store_operation
    async def overrides(self) -> dict[str, ModelPrice]:
        """Model id -> the price an admin set (models they did not price are absent)."""
        raw = cast(dict[str, str], await self._redis.hgetall(self._layout.prices))  # decode_responses
        return {model: _decode(value) for model, value in raw.items()}

    @store_operation
    async def set(self, model_id: str, price: ModelPrice) -> None:
        """Set ``model_id``'s price (the caller checks that the model is served) and tell every replica."""
        await self._redis.hset(self._layout.prices, model_id, _encode(price))
        await self._publish(model_id)

    @store_operation
    async def clear(self, model_id: str) -> bool:
        """Drop the admin's price of ``model_id`` (the settings' applies again); False when there was none."""
        removed = bool(await self._redis.hdel(self._layout.prices, model_id))
        await self._publish(model_id)
        return removed

    async def _publish(self, model_id: str) -> None:
        try:
            await self._redis.publish(self._channel, f"price:{model_id}")
        except (RedisError, RedisClusterException) as exc:  # the write is done; others read it within a ttl
            log.warning("price_invalidation_not_published", model=model_id, error=str(exc))


class PriceBook:
    """A replica's prices: the settings' defaults with the admin's (Redis) over them, read again at most
    every ``ttl_s`` and at once after a change (:meth:`on_invalidation`).

    Args:
        store: the admin's prices.
        defaults: model id -> price from the settings (``pricing.models``).
        ttl_s: longest the table is used without reading Redis again, s (0: read for every request).
        clock: monotonic clock, s.
    """

    def __init__(
        self,
        store: PriceStore,
        defaults: Mapping[str, ModelPrice],
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._defaults = dict(defaults)
        self._ttl_s = ttl_s
        self._clock = clock
        self._table: dict[str, ModelPrice] = dict(defaults)
        self._overrides: dict[str, ModelPrice] = {}
        self._expires = -1.0
        self._loaded = False
        self._loading: asyncio.Task[None] | None = None

    @property
    def defaults(self) -> Mapping[str, ModelPrice]:
        """The settings' prices."""
        return self._defaults

    def fresh(self, model_id: str) -> ModelPrice | None:
        """``model_id``'s price when the table is fresh (no Redis call; :data:`FREE` for an unpriced
        model), else None: call :meth:`price`."""
        if self._clock() < self._expires:
            return self._table.get(model_id, FREE)
        return None

    def last_known(self, model_id: str) -> ModelPrice:
        """``model_id``'s price in the table as last read, fresh or not (the settings' defaults before the
        first read), with no Redis call: the price of a request admitted while Redis is out of reach."""
        return self._table.get(model_id, FREE)

    async def price(self, model_id: str) -> ModelPrice:
        """``model_id``'s price (:data:`FREE` when nobody priced it), reading the table again when stale.

        Raises:
            StoreUnavailable: RedisClient failed and the book holds no table read before (a stale one is used,
                and logged, rather than failing the request).
        """
        found = self.fresh(model_id)
        if found is not None:
            return found
        await self.refresh()
        return self._table.get(model_id, FREE)

    async def table(self) -> tuple[dict[str, ModelPrice], dict[str, ModelPrice]]:
        """Every price now (read again from Redis) and, of those, the admin's."""
        self._expires = -1.0
        await self.refresh()
        return dict(self._table), dict(self._overrides)

    async def refresh(self) -> None:
        """Read the admin's prices: one read at a time, in a task the concurrent callers share (one that
        leaves does not cancel it for the others).

        Raises:
            StoreUnavailable: RedisClient failed and no table was read before.
        """
        if self._loading is None:
            self._loading = asyncio.ensure_future(self._load())
            self._loading.add_done_callback(_retrieved)
        await asyncio.shield(self._loading)

    async def _load(self) -> None:
        began = self._clock()
        try:
            overrides = await self._store.overrides()
        except StoreUnavailable as exc:
            if not self._loaded:
                raise
            log.warning("prices_stale", error=str(exc))  # the last table a little longer
            self._expires = began + self._ttl_s
            return
        finally:
            self._loading = None
        self._overrides = overrides
        self._table = {**self._defaults, **overrides}
        self._expires = began + self._ttl_s
        self._loaded = True

    def on_invalidation(self, message: str) -> None:
        """Read the table again on next use after ``price:<model>`` (a price changed somewhere)."""
        if message.startswith("price:"):
            self._expires = -1.0

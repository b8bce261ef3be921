"""The live gateway replicas, through Redis: heartbeats, and each replica's share of a worker's window.

Layout: hash ``<prefix>replicas`` mapping a replica id (a random id per gateway process, 16 hex chars) to
JSON ``{"t": <Redis server time, s>, "d": <payload>}``. Every ``replicas.heartbeat_s`` each replica writes
its field (the time is the Redis server's own ``TIME``, so the hosts' clocks do not matter) and reads the
hash back; the replicas whose time is within ``replicas.ttl_s`` are live. Fields older than ten TTLs are
deleted by whoever reads them; a replica that stops deletes its own at once (its share goes back to the
others at their next beat).

**Window shares.** Every replica runs its own admission core, and each core would fill a worker's whole
window (the engine's ``max_running_requests``): N replicas offered a worker N times what it runs, the
excess waiting in the engine's queue where no class, fairness or deadline applies. Each replica takes its
share of the window among the live replicas (:func:`policies.window_shares.window_share`: ``floor(W / N)``,
plus one for the first ``W mod N`` ids in order; the fleet simulation splits it with the same function).
When replicas come or go, the shares follow within one heartbeat (a newcomer takes its share at once; the
others shrink at their next beat and let what runs beyond it finish).

The payload carries what a replica's planner measured (:mod:`service.pipeline.planner_task`), so that
each replica can decide for the whole fleet of replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from dataclasses import dataclass
from typing import Any

import structlog

from policies.window_shares import window_share
from tenancy.errors import StoreUnavailable, store_operation
from tenancy.redis_client import RedisClient

log = structlog.get_logger("radixgate.replicas")

_FORGET_AFTER_TTLS = 10


@dataclass(frozen=True, slots=True)
class Replica:
    """One live replica as its last heartbeat said.

    Attributes:
        id: its id.
        age_s: how long ago it beat (Redis server time), s.
        payload: what it published with it (None: nothing).
    """

    id: str
    age_s: float
    payload: Any = None


class ReplicaRegistry:
    """This replica's heartbeat, and the live replicas it last read.

    Args:
        redis: async client (``decode_responses=True``).
        prefix: RedisClient key prefix.
        ttl_s: a replica heard from longer ago than this is gone, s.
        replica_id: this replica's id (default: random).
    """

    def __init__(self, redis: RedisClient, prefix: str, ttl_s: float, replica_id: str | None = None) -> None:
        self._redis = redis
        self._key = f"{prefix}replicas"
        self._ttl = ttl_s
        self.id = replica_id or secrets.token_hex(8)
        self.payload: Any = None  #: sent with every beat (the planner's measures)
        self.live: list[Replica] = [Replica(self.id, 0.0)]  #: as of the last beat, in id order

    @property
    def live_ids(self) -> list[str]:
        """The ids of :attr:`live`."""
        return [r.id for r in self.live]

    def share(self, window: int) -> int:
        """This replica's share of a worker's ``window`` among the live replicas (:func:`window_share`)."""
        return window_share(window, self.live_ids, self.id)

    @store_operation
    async def beat(self) -> list[Replica]:
        """Write this replica's heartbeat (with :attr:`payload`) and read the live replicas.

        Raises:
            StoreUnavailable: RedisClient did not answer (:attr:`live` is kept as it was).
        """
        seconds, micros = await self._redis.time()
        now = seconds + micros / 1e6
        value = json.dumps({"t": now, "d": self.payload}, separators=(",", ":"))
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key, self.id, value)
            pipe.hgetall(self._key)
            _, raw = await pipe.execute()
        live, stale = [], []
        for rid, text in raw.items():
            try:
                entry = json.loads(text)
                age = now - float(entry["t"])
            except (ValueError, KeyError, TypeError):
                stale.append(rid)
                continue
            if age <= self._ttl:
                live.append(Replica(str(rid), max(0.0, age), entry.get("d")))
            elif age > _FORGET_AFTER_TTLS * self._ttl:
                stale.append(rid)
        if stale:
            await self._redis.hdel(self._key, *stale)
        live.sort(key=lambda r: r.id)
        if [r.id for r in live] != self.live_ids:
            log.info("replicas_changed", replica=self.id, live=len(live), ids=[r.id for r in live])
        self.live = live
        return live

    async def leave(self) -> None:
        """Delete this replica's heartbeat (it stops); an unavailable Redis is ignored (it ages out)."""
        with contextlib.suppress(Exception):
            await self._redis.hdel(self._key, self.id)

    async def run(self, interval_s: float) -> None:
        """:meth:`beat` every ``interval_s`` until cancelled (an unavailable Redis is skipped)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.beat()
            except StoreUnavailable:
                pass
            except Exception:  # a bug in one beat must not end the heartbeat
                log.exception("replica_heartbeat_failed", replica=self.id)


__all__ = ["Replica", "ReplicaRegistry", "window_share"]

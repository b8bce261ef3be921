"""Router replica sync: every gateway replica's dispatches reach the other replicas' cache-aware routers.

Each replica routes with its own prefix tree (:class:`policies.cache_aware.CacheAwarePolicy`). Left alone,
a tree learns only its own replica's dispatches: a prefix another replica placed on a worker is a miss
here, and the miss policy (the smallest tree, SGLang's) becomes a round robin over this replica's own
requests, which several replicas interleave into bursts at each worker (docs/experiments.md §6: 4
replicas' TTFT P50 5% above one replica's at 80% load). NVIDIA Dynamo's KV router shares its replicas'
routing decisions for the same reason (``--router-replica-sync``, over NATS); here it is Redis pub/sub.

Wire format: channel ``<prefix>routes``; each message is JSON ``{"r": <replica id>, "routes": [[model
id, worker URL, prompt prefix], ...]}``. What a replica dispatches in one turn of its event loop goes in
one ``PUBLISH`` (at most ``max_batch`` routes; more wait for the next). A prompt is cut to
``max_prompt_chars`` characters: enough for the shared prefixes that matter (system prompts, documents
repeated across turns), and a bound on the message. Prompts pass through Redis but are not stored there
(pub/sub keeps nothing); an operator who cannot have that turns it off
(``RADIXGATE_REPLICAS__SHARE_ROUTES=false``).

Each replica publishes at most ``max_bytes_per_s`` of routes (a token bucket with one second's worth of
burst, :mod:`policies.token_bucket`); routes beyond it are dropped. Redis disconnects a subscriber whose
unread messages pass its ``client-output-buffer-limit pubsub`` (32 MB hard, 8 MB for 60 s by default), so
the replicas' rates together, times the longest a subscriber may fall behind, must stay under it.

Losses are harmless: a route not delivered (Redis away, a subscription being re-made, a full backlog) only
leaves a tree as it would be without the sync. Nothing here blocks a request: publishing happens in a
task of its own, at most one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Protocol

import orjson
import structlog
from redis.asyncio import Redis
from redis.exceptions import RedisError

from policies.token_bucket import BucketLimit, full_bucket, try_take
from service.config.fleet import ReplicaSettings
from tenancy.pubsub import follow_channel
from tenancy.redis_client import RedisClient

log = structlog.get_logger("radixgate.route_sync")

PeerRoute = Callable[[str, str, str], None]
"""``(model id, worker URL, prompt)``: a route another replica took, to be learned here."""


def routes_channel(prefix: str) -> str:
    """The pub/sub channel of the routes under Redis key prefix ``prefix``."""
    return f"{prefix}routes"


class RouteSync:
    """Publishes this replica's routes and follows the other replicas' (see the module docstring).

    Args:
        redis: the gateway's client (``PUBLISH``; on a cluster it reaches every node's subscribers).
        subscriber: a client without a read timeout, for the subscription (one connection of its own).
        prefix: Redis key prefix.
        replica_id: this replica's id (its own messages are skipped).
        max_prompt_chars: a published prompt is cut to this many characters (>= 1).
        max_batch: routes in one message; also the most kept waiting while a publish is under way (>= 1).
        max_bytes_per_s: routes published per second at most, bytes of their prompts (>= 1); beyond it
            they are dropped. None: no limit.
        clock: seconds, for the byte budget (injected for tests).
        on_routes: told ``(outcome, routes)`` as routes are ``published``, ``dropped`` or ``learned``
            (``radixgate_route_sync_routes_total``); None: nothing told.
        on_subscribed: told True when the subscription is made, False when it breaks
            (``radixgate_route_sync_subscribed``); None: nothing told.

    Attributes:
        published: routes published so far.
        dropped: routes not published (backlog full, or Redis failed the publish).
        learned: other replicas' routes handed to ``apply``.
    """

    def __init__(
        self,
        redis: RedisClient,
        subscriber: Redis,
        prefix: str,
        replica_id: str,
        max_prompt_chars: int,
        max_batch: int = 512,
        on_routes: Callable[[str, int], None] | None = None,
        on_subscribed: Callable[[bool], None] | None = None,
        max_bytes_per_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_prompt_chars < 1 or max_batch < 1:
            raise ValueError("max_prompt_chars and max_batch must be >= 1")
        if max_bytes_per_s is not None and not 0 < max_bytes_per_s < float("inf"):
            raise ValueError("max_bytes_per_s must be positive and finite")
        self._budget = None if max_bytes_per_s is None else BucketLimit(max_bytes_per_s * 60, max_bytes_per_s)
        self._clock = clock
        self._bytes = None if self._budget is None else full_bucket(self._budget, clock() * 1000)
        self._redis = redis
        self._subscriber = subscriber
        self.channel = routes_channel(prefix)
        self.replica_id = replica_id
        self._max_chars = max_prompt_chars
        self._max_batch = max_batch
        self._pending: list[list[str]] = []
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self._on_routes = on_routes
        self._on_subscribed = on_subscribed
        self.published = 0
        self.dropped = 0
        self.learned = 0

    def _count(self, outcome: str, n: int) -> None:
        if outcome == "published":
            self.published += n
        elif outcome == "dropped":
            self.dropped += n
        else:
            self.learned += n
        if self._on_routes is not None and n:
            self._on_routes(outcome, n)

    # -- publishing ------------------------------------------------------------------------------------
    def publish(self, model: str, worker: str, prompt: str) -> None:
        """Queue a route this replica took, for the next message (returns at once; needs a running loop).

        Beyond ``max_batch`` routes waiting, or past the byte budget, the route is dropped (counted in
        :attr:`dropped`).
        """
        if len(self._pending) >= self._max_batch:
            self._count("dropped", 1)
            return
        prompt = prompt[: self._max_chars]
        if self._budget is not None and self._bytes is not None:
            taken = try_take(self._bytes, self._budget, len(prompt.encode()), self._clock() * 1000)
            self._bytes = taken.state
            if not taken.allowed:
                self._count("dropped", 1)
                return
        self._pending.append([model, worker, prompt])
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._send(), name="route-sync-publish")

    async def _send(self) -> None:
        """Publish what waits, one message per turn, until nothing waits."""
        try:
            while self._pending:
                await asyncio.sleep(0)  # the rest of this turn's dispatches join the message
                batch, self._pending = self._pending, []
                message = orjson.dumps({"r": self.replica_id, "routes": batch})
                try:
                    await self._redis.publish(self.channel, message)
                except (RedisError, OSError) as exc:
                    self._count("dropped", len(batch))
                    if not self._failing:
                        log.warning("route_sync_publish_failed", error=f"{type(exc).__name__}: {exc}")
                        self._failing = True
                    continue
                self._count("published", len(batch))
                if self._failing:
                    log.info("route_sync_publish_resumed")
                    self._failing = False
        finally:
            self._task = None

    async def close(self) -> None:
        """Stop publishing (what waits is dropped)."""
        task, self._task = self._task, None
        self._pending = []
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- following -------------------------------------------------------------------------------------
    def receive(self, data: bytes | str, apply: PeerRoute) -> int:
        """Hand the routes of one message to ``apply``, unless this replica sent it; returns how many.

        A malformed message (not this format) is ignored: it is logged and nothing is applied.
        """
        try:
            message: Any = orjson.loads(data)
            sender, routes = message["r"], message["routes"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            log.warning("route_sync_malformed_message", size=len(data))
            return 0
        if sender == self.replica_id or not isinstance(routes, list):
            return 0
        n = 0
        for route in routes:
            if isinstance(route, list) and len(route) == 3 and all(isinstance(x, str) for x in route):
                apply(route[0], route[1], route[2])
                n += 1
        self._count("learned", n)
        return n

    async def follow(self, apply: PeerRoute, retry_s: float = 1.0) -> None:
        """Hand every other replica's routes to ``apply`` until cancelled; a broken subscription is made
        again every ``retry_s`` seconds (``route_sync_lost`` logged once, ``route_sync_resumed`` when it
        is back; what was published meanwhile is lost, which only leaves the trees as they were). Whatever
        breaks it (Redis away, a message the client cannot decode: the subscriber decodes UTF-8, and any
        Redis client may publish on the channel) only re-makes the subscription; nothing but a
        cancellation ends this (:func:`tenancy.pubsub.follow_channel`)."""

        def on_message(text: str) -> None:
            try:
                self.receive(text, apply)
            except Exception:  # a bug in applying one message must not end the subscription
                log.exception("route_sync_apply_failed")

        await follow_channel(
            self._subscriber,
            self.channel,
            on_message,
            name="route_sync",
            retry_s=retry_s,
            on_subscribed=self._on_subscribed,
        )


class RouteSyncObserver(Protocol):
    """What is told of the sync's outcomes (``service.observability.route_sync_metrics.RouteSyncMetrics``)."""

    def routes(self, outcome: str, n: int) -> None:
        """``n`` routes were ``published``, ``dropped`` or ``learned``."""

    def subscribed(self, up: bool) -> None:
        """The subscription was made (True) or broke (False)."""


def route_sync(
    settings: ReplicaSettings,
    redis: RedisClient,
    subscriber: Redis,
    prefix: str,
    replica_id: str,
    observer: RouteSyncObserver | None = None,
) -> RouteSync | None:
    """The replica's :class:`RouteSync` as ``settings`` (``replicas.*``) say, telling ``observer`` its
    outcomes; None when ``share_routes`` is off."""
    if not settings.share_routes:
        return None
    return RouteSync(
        redis,
        subscriber,
        prefix,
        replica_id,
        settings.route_sync_max_prompt_chars,
        on_routes=None if observer is None else observer.routes,
        on_subscribed=None if observer is None else observer.subscribed,
        max_bytes_per_s=settings.route_sync_max_bytes_per_s,
    )


__all__ = ["PeerRoute", "RouteSync", "RouteSyncObserver", "route_sync", "routes_channel"]

"""Following a Redis pub/sub channel for the life of a process: subscribe, hand on each message, and
subscribe again whenever the subscription breaks.

The auth-cache invalidations (:func:`tenancy.auth_cache.follow_invalidations`) and the router replica
sync (:class:`service.workers.route_sync.RouteSync`) both wait on a channel with no read timeout and must
outlive whatever breaks their connection: Redis away, a failover, or a message the client cannot decode
(the subscriber decodes UTF-8, and any Redis client may publish on the channel).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from tenancy.redis_client import RedisClient

log = structlog.get_logger("radixgate.pubsub")


async def follow_channel(
    subscriber: RedisClient,
    channel: str,
    on_message: Callable[[str], None],
    *,
    name: str,
    retry_s: float = 1.0,
    on_subscribed: Callable[[bool], None] | None = None,
) -> None:
    """Hand every message published on ``channel`` to ``on_message`` until cancelled.

    Args:
        subscriber: a client without a read timeout (the subscription waits for messages indefinitely);
            each subscription holds one of its connections.
        channel: the channel.
        on_message: called with each message's data as text.
        name: the log events' stem: ``<name>_lost`` (warning, once when the subscription breaks or cannot
            be made, not at every retry) and ``<name>_resumed`` (once it is back).
        retry_s: seconds between attempts to subscribe again.
        on_subscribed: told True at each (re)subscription and False each time one ends (broken or
            cancelled): what was published in between was missed.

    Whatever breaks a subscription, an exception from ``on_message`` included, only makes it again;
    nothing but a cancellation ends this.
    """
    lost = False
    while True:
        pubsub = subscriber.pubsub()
        try:
            await pubsub.subscribe(channel)
            async for message in pubsub.listen():
                if message["type"] == "subscribe":
                    if on_subscribed is not None:
                        on_subscribed(True)
                    if lost:
                        log.info(f"{name}_resumed", channel=channel)
                        lost = False
                elif message["type"] == "message":
                    data = message["data"]
                    on_message(data.decode() if isinstance(data, bytes) else str(data))
        except Exception as exc:  # Redis away, or a payload its parser refuses (not UTF-8): subscribe again
            if not lost:
                log.warning(
                    f"{name}_lost", channel=channel, error=f"{type(exc).__name__}: {exc}", retry_s=retry_s
                )
                lost = True
        finally:
            if on_subscribed is not None:
                on_subscribed(False)
            await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
        await asyncio.sleep(retry_s)


__all__ = ["follow_channel"]

"""Whether this gateway process reaches Redis, said in the log: ``redis_unreachable`` once, then at a bounded
rate, and ``redis_reachable`` when it answers again.

A Redis that is down at startup, or goes down later, otherwise showed only as a warning of the auth-cache
follower every second (``auth_invalidations_lost``), without the address, and as 503s. :func:`watch_redis`
pings it every :data:`WATCH_S` over a connection of its own (the request path's pool may be busy: a full
pool is no evidence of an unreachable Redis); :class:`RedisReachability` turns the outcomes into those lines,
with the URL's password masked (:func:`masked_url`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

import structlog
from redis.asyncio import Redis, RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException, RedisError

log = structlog.get_logger("radixgate.redis")

WATCH_S = 1.0
"""Time between two pings of the watcher, s."""

REPEAT_S = 60.0
"""While Redis stays unreachable, ``redis_unreachable`` is logged again at most this often, s."""


def masked_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``****``: ``redis://:s3cret@h:6379/0`` ->
    ``redis://:****@h:6379/0``, ``redis://user:pw@h`` -> ``redis://user:****@h``; the rest unchanged."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:****@{host}"))


class RedisReachability:
    """Logs changes of Redis's reachability, and an unreachable Redis again every ``repeat_s``.

    Args:
        url: the Redis URL (logged masked).
        repeat_s: least time between two ``redis_unreachable`` lines of one outage, s.
        clock: monotonic clock, s.

    Attributes:
        reachable: the last outcome (None before the first).
        on_outcome: told every outcome (True: reached), e.g.
            :meth:`service.pipeline.outage.OutageMode.reachability`; None: nobody.
    """

    def __init__(
        self, url: str, repeat_s: float = REPEAT_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._url = masked_url(url)
        self._repeat_s = repeat_s
        self._clock = clock
        self.reachable: bool | None = None
        self.on_outcome: Callable[[bool], None] | None = None
        self._down_since = 0.0
        self._logged_at = 0.0
        self._failures = 0

    def failed(self, error: str) -> None:
        """One attempt failed with ``error``: logged when it starts an outage, then every ``repeat_s``."""
        if self.on_outcome is not None:
            self.on_outcome(False)
        now = self._clock()
        self._failures += 1
        if self.reachable is not False:
            self.reachable, self._down_since, self._failures = False, now, 1
        elif now - self._logged_at < self._repeat_s:
            return
        self._logged_at = now
        log.warning(
            "redis_unreachable",
            url=self._url,
            error=error,
            down_s=round(now - self._down_since, 1),
            failures=self._failures,
        )

    def reached(self) -> None:
        """One attempt succeeded: ``redis_reachable`` when it ends an outage."""
        if self.on_outcome is not None:
            self.on_outcome(True)
        if self.reachable is False:
            log.info(
                "redis_reachable",
                url=self._url,
                down_s=round(self._clock() - self._down_since, 1),
                failures=self._failures,
            )
        self.reachable = True


async def probe_redis(client: Redis | RedisCluster, cluster: bool = False) -> None:
    """Ask whether Redis serves now: ``PING`` on one Redis; on a Redis Cluster (``cluster``), ``CLUSTER
    INFO`` of the node the client reaches must say ``cluster_state:ok``: a node that answers while the
    cluster has failed (a node down and ``cluster-require-full-coverage yes``, Redis's default) serves no
    slot, so the gateway must treat the cluster as unreachable.

    Raises:
        redis.exceptions.RedisError: no answer, or the cluster not ok (``ClusterDownError``).
        redis.exceptions.RedisClusterException: the cluster client reaches no node.
    """
    if not cluster:
        await client.ping()
        return
    info = await client.execute_command("CLUSTER INFO")
    if isinstance(info, dict):
        state = next((v for k, v in info.items() if _text(k) == "cluster_state"), None)
        ok = state is not None and _text(state) == "ok"
    else:
        ok = "cluster_state:ok" in _text(info)
    if not ok:
        raise ClusterDownError("cluster_state is not ok")


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def answers(client: Redis | RedisCluster, cluster: bool = False) -> bool:
    """:func:`probe_redis` as a yes or no."""
    try:
        await probe_redis(client, cluster)
    except (RedisError, RedisClusterException, OSError):
        return False
    return True


async def watch_redis(
    client: Redis | RedisCluster, reach: RedisReachability, interval_s: float = WATCH_S, cluster: bool = False
) -> None:
    """Probe ``client`` (:func:`probe_redis`) every ``interval_s`` seconds until cancelled, telling ``reach``
    each outcome (the first at once)."""
    while True:
        try:
            await probe_redis(client, cluster)
        except (RedisError, RedisClusterException, OSError) as exc:
            reach.failed(f"{type(exc).__name__}: {exc}")
        else:
            reach.reached()
        await asyncio.sleep(interval_s)


__all__ = ["REPEAT_S", "WATCH_S", "RedisReachability", "answers", "masked_url", "probe_redis", "watch_redis"]

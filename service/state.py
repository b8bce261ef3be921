"""Long-lived objects of one gateway replica, built in the app's lifespan and reached through deps, and the
Redis client and the lease counter the lifespan builds them with, and the launched SGLang workers' start."""

from __future__ import annotations

import asyncio
import signal
import socket
from dataclasses import dataclass

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from service.config.settings import RedisSettings, Settings
from service.observability.metrics import GatewayMetrics
from service.pipeline.billing import Billing
from service.pipeline.dispatch import Dispatcher
from service.pipeline.outage import OutageMode
from service.pipeline.planner_task import PlannerTask
from service.pipeline.scheduler import Scheduler
from service.pipeline.served_models import ServedModels
from service.runtime.drain import Drain
from service.runtime.startup_signals import StartupInterrupted, interruptible_startup
from service.workers.launcher import WorkerProcess
from service.workers.pool import WorkerPool
from service.workers.registry import WorkerRegistry
from tenancy.quota import QuotaLimiter
from tenancy.redis_client import BoundedRedisCluster, RedisClient, cluster_mismatch
from tenancy.store import TenantStore
from tenancy.usage import UsageRecorder


@dataclass(frozen=True, slots=True)
class GatewayState:
    """Everything a request handler may need."""

    settings: Settings
    redis: RedisClient
    tenants: TenantStore
    quota: QuotaLimiter
    usage: UsageRecorder
    pool: WorkerPool
    dispatcher: Dispatcher
    metrics: GatewayMetrics
    scheduler: Scheduler  # the default (first) model's; ``models`` has every model's
    registry: WorkerRegistry
    drain: Drain  # the process's stopping state: readiness and admission read ``drain.draining``
    models: ServedModels  # every served model: its tokenizer, scheduler, workers' reports
    billing: Billing  # prices and budgets (service/pipeline/billing.py)
    planner: PlannerTask | None = None  # radixgate_desired_workers' decisions (None: planner.enabled off)
    outage: OutageMode | None = None  # redis.on_outage = open (service/pipeline/outage.py); None: closed


def connect_redis(settings: RedisSettings) -> RedisClient:
    """A Redis client over a bounded, blocking connection pool; with ``settings.cluster``, a Redis Cluster
    client (:func:`connect_cluster`).

    At most ``max_connections`` connections; a caller waits up to ``pool_timeout_s`` for a free one
    (redis-py's default pool fails at once with ``MaxConnectionsError`` instead). A reply slower than
    ``socket_timeout_s`` fails the call. A broken connection is retried once at once (Redis restarted:
    the pooled connection is stale); a timeout is not retried, so a call's latency stays bounded. Each
    of these failures surfaces as :class:`tenancy.errors.StoreUnavailable` (503 with Retry-After).
    """
    if settings.cluster:
        return connect_cluster(settings)
    pool = BlockingConnectionPool.from_url(
        settings.url,
        max_connections=settings.max_connections,
        timeout=settings.pool_timeout_s,
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=settings.connect_timeout_s,
        decode_responses=True,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    return Redis.from_pool(pool)  # closing the client closes the pool


def connect_cluster(settings: RedisSettings) -> BoundedRedisCluster:
    """A Redis Cluster client that starts from the node ``settings.url`` names and learns the others
    (``CLUSTER SLOTS``); each call goes to the node of its keys' slot, following ``MOVED``/``ASK`` while
    slots migrate. At most ``max_connections`` commands at once, each waiting up to ``pool_timeout_s`` for
    its turn (:class:`tenancy.redis_client.BoundedRedisCluster`); each node allows twice as many
    connections, for pipelines and transactions beside them. The timeouts as :func:`connect_redis`. A
    call fails with :class:`tenancy.errors.StoreUnavailable` as on one Redis.
    """
    client = BoundedRedisCluster.from_url(
        settings.url,
        max_connections=2 * settings.max_connections,
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=settings.connect_timeout_s,
        decode_responses=True,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
    )
    assert isinstance(client, BoundedRedisCluster)  # from_url builds the class it is called on
    return client.bound(settings.max_connections, settings.pool_timeout_s)


SUBSCRIBER_KEEPALIVE: dict[int, int] = {
    option: value
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3))
    if (option := getattr(socket, name, None)) is not None
}
"""TCP keepalive of the subscriber's connections (Linux's option names; where one is missing, the system's
default): probed after 30 s idle, every 10 s, dropped after 3 unanswered probes. The subscriptions (auth
invalidations, route sync) wait for messages with no read timeout; without it a Redis that vanished without
closing the connection (a host lost, a network partition) would leave them waiting for ever, unnoticed, where
now the read fails after about a minute and they subscribe again."""


def connect_side_clients(settings: RedisSettings) -> tuple[Redis, Redis]:
    """The two connections beside the pool, to the node ``settings.url`` names (on a Redis Cluster too:
    a ``PUBLISH`` reaches every node's subscribers, and the watch asks whether that node answers):

    - the subscriber of the auth-cache invalidations: no read timeout, it waits for messages indefinitely;
    - the pinger of :func:`service.observability.redis_watch.watch_redis`: a connection of its own, since a
      busy request pool is no evidence of an unreachable Redis.
    """
    subscriber = Redis.from_url(
        settings.url,
        decode_responses=True,
        socket_connect_timeout=settings.connect_timeout_s,
        socket_keepalive=True,  # a connection that died without a FIN ends its subscriptions within a minute
        socket_keepalive_options=SUBSCRIBER_KEEPALIVE,
    )
    pinger = Redis.from_url(
        settings.url,
        socket_connect_timeout=settings.connect_timeout_s,
        socket_timeout=settings.socket_timeout_s,
        single_connection_client=True,
    )
    return subscriber, pinger


async def check_cluster_setting(settings: RedisSettings) -> None:
    """Refuse to start when ``settings.cluster`` and the server at ``settings.url`` disagree
    (:func:`tenancy.redis_client.cluster_mismatch`; ``python -m service serve`` says so first, in one line).

    Raises:
        RuntimeError: they disagree (its message says which setting to change).
    """
    mismatch = await asyncio.to_thread(
        cluster_mismatch, settings.url, settings.cluster, settings.connect_timeout_s
    )
    if mismatch is not None:
        raise RuntimeError(mismatch)


async def launch_workers(settings: Settings, launched: list[WorkerProcess]) -> None:
    """Start ``engine.num_workers`` SGLang workers one after another (SGLang sizes its KV cache from the
    memory left after loading the weights, which a second worker loading at the same time would distort),
    appending each to ``launched`` (the caller stops them), and wait until each is ready.

    Raises:
        StartupInterrupted: SIGINT/SIGTERM arrived meanwhile (loading a model can take minutes).
        WorkerStartError: a worker exited or did not become healthy in time.
    """
    with interruptible_startup() as received:
        try:
            for i in range(settings.engine.num_workers):
                worker = WorkerProcess(settings.engine, settings.engine.base_port + i)
                worker.start()
                launched.append(worker)
                await worker.wait_ready()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not received or task is None:
                raise
            task.uncancel()
            name = signal.Signals(received[0]).name
            raise StartupInterrupted(f"{name} while waiting for launched workers: stopping them") from None

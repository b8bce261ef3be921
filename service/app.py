"""App factory: builds every long-lived object from one :class:`Settings` in the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import structlog
from fastapi import FastAPI, Request, Response
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from policies.circuit_breaker import BreakerConfig
from service.api import (
    admin_billing,
    admin_keys,
    admin_planner,
    admin_routes,
    admin_workers,
    health_routes,
    openai_routes,
)
from service.api.admin_audit import AdminAuditLog
from service.api.deps import new_request_id
from service.api.errors import http_status, install_error_handlers, response_for
from service.api.key_guessing import BadKeyThrottle
from service.api.openai_routes import COMPLETION_ROUTES
from service.api.openapi_bodies import ADMIN_SUFFIX, install_body_schemas
from service.api.operator_access import OperatorPorts, operator_ports
from service.api.request_ids import client_request_id, id_headers
from service.config.settings import Settings
from service.observability.logs import configure_logging
from service.observability.metrics import GatewayMetrics, refresh_pool_gauges
from service.observability.pool_gauges import scrape_engines
from service.observability.redis_watch import RedisReachability, watch_redis
from service.observability.route_sync_metrics import RouteSyncMetrics
from service.observability.runtime_metrics import watch_loop_lag
from service.pipeline.billing import Billing
from service.pipeline.dispatch import Dispatcher
from service.pipeline.outage import outage_policy
from service.pipeline.planner_task import PlannerTask
from service.pipeline.quota_admission import lease_counter
from service.pipeline.revocation import RevocationRegistry, store_checks
from service.pipeline.served_models import ServedModels
from service.pipeline.settlement import Settler
from service.pipeline.tenant_classes import report_at_startup
from service.runtime.drain import (
    SERVED_WHILE_DRAINING,
    Drain,
    closing_connection,
    drain_on_signals,
    shutting_down,
)
from service.runtime.http_protocol import CONNECTIONS_EXTENSION
from service.runtime.task_stop import log_failure, stop_tasks
from service.state import (
    GatewayState,
    check_cluster_setting,
    connect_redis,
    connect_side_clients,
    launch_workers,
)
from service.workers.client import SGLangClient
from service.workers.discovery import DnsDiscovery, no_workers_hint
from service.workers.launcher import WorkerProcess
from service.workers.pool import WorkerPool
from service.workers.registry import WorkerRegistry, sync_loop, sync_once
from service.workers.replicas import ReplicaRegistry
from service.workers.route_sync import route_sync
from service.workers.supervisor import WorkerSupervisor
from tenancy.auth_cache import AuthCache, follow_invalidations, invalidation_channel
from tenancy.concurrency import ConcurrencyLimiter
from tenancy.errors import StoreUnavailable
from tenancy.quota import QuotaLimiter
from tenancy.quota_lease import LeasedQuota
from tenancy.store import TenantStore, eviction_policy
from tenancy.usage import UsageRecorder

log = structlog.get_logger("radixgate.app")


class RequestIdMiddleware:
    """Gives every HTTP request an id (``request.state.request_id``) and returns it as ``x-request-id``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = new_request_id()
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        state["client_request_id"] = client = client_request_id(scope["headers"])
        ids = id_headers(rid, client)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).extend(ids)
            await send(message)

        await self.app(scope, receive, send_with_id)


class GatewayApp(FastAPI):
    """The FastAPI app with a direct entry for the completion routes.

    ``POST /v1/chat/completions`` and ``POST /v1/completions``
    (:data:`service.api.openai_routes.COMPLETION_ROUTES`) are served straight from the ASGI entry: no
    middleware stack, routing table or dependency solving, only what they need (a request id returned
    as ``x-request-id``, the body limit in :func:`service.api.deps.read_json`, and the app's error
    handlers, :func:`service.api.errors.response_for`). Every other request, and these paths with another
    method, take FastAPI's usual path.

    While the lifespan runs, ``drain`` is the process's :class:`service.runtime.drain.Drain`: every HTTP
    request is counted in it while in the app; during a drain each is served with ``Connection: close`` on
    its answer, and from the drain deadline on each one but the probes and ``/metrics``
    (:data:`service.runtime.drain.SERVED_WHILE_DRAINING`) is refused here with 503 ``shutting_down``,
    ``Retry-After`` and ``Connection: close``. With ``security.operator_port`` set, a path asked on the
    wrong port (``/metrics`` or ``/admin`` on the API port, a completion on the operator port) is a 404
    here (:class:`service.api.operator_access.OperatorPorts`).
    """

    drain: Drain | None = None
    operator: OperatorPorts | None = None  # security.operator_port (service/api/operator_access.py)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.operator is not None and scope["type"] == "http" and not self.operator.allowed(scope):
            await self.operator.refuse(scope, receive, send)
            return
        drain = self.drain
        if drain is None or scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        if drain.connections is None:  # once: the server's open connections, which a drain waits for
            drain.connections = scope.get("extensions", {}).get(CONNECTIONS_EXTENSION, {}).get("connections")
        if drain.draining:
            if drain.refusing and scope["path"] not in SERVED_WHILE_DRAINING:
                await self._refuse_draining(scope, receive, send)
                return
            send = closing_connection(send)
        drain.enter()
        try:
            if scope["method"] == "POST":
                handler = COMPLETION_ROUTES.get(scope["path"])
                if handler is not None:
                    await self._serve_completion(handler, scope, receive, send)
                    return
            await super().__call__(scope, receive, send)
        finally:
            drain.leave()

    async def _refuse_draining(self, scope: Scope, receive: Receive, send: Send) -> None:
        """503 ``shutting_down`` in OpenAI's shape (logged and counted as every refusal), with
        ``Retry-After``, an ``x-request-id`` and ``Connection: close`` (the client reconnects, to another
        replica when a balancer is in front)."""
        rid = new_request_id()
        scope["app"] = self
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        state["client_request_id"] = client = client_request_id(scope["headers"])
        response = await response_for(Request(scope, receive, send), shutting_down())
        response.raw_headers += [*id_headers(rid, client), (b"connection", b"close")]
        await response(scope, receive, send)

    async def _serve_completion(
        self,
        handler: Callable[[Request], Awaitable[Response]],
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        rid = new_request_id()
        scope["app"] = self
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        state["client_request_id"] = client = client_request_id(scope["headers"])
        request = Request(scope, receive, send)
        try:
            response = await handler(request)
        except Exception as exc:
            response = await response_for(request, exc)
        response.raw_headers.extend(id_headers(rid, client))
        await response(scope, receive, send)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    metrics: GatewayMetrics = app.state.metrics
    await check_cluster_setting(settings.redis)
    redis = connect_redis(settings.redis)
    subscriber, pinger = connect_side_clients(settings.redis)
    reach = RedisReachability(settings.redis.url)  # its outcomes also drive redis.on_outage = open
    watch = watch_redis(pinger, reach, cluster=settings.redis.cluster)
    background = [asyncio.create_task(watch, name="redis-watch")]
    revocations: RevocationRegistry | None = None
    up = settings.upstream
    client = SGLangClient(up)
    launched: list[WorkerProcess] = []
    supervisors: list[WorkerSupervisor] = []
    registry = settings.model_registry()
    replicas = ReplicaRegistry(redis, settings.redis.key_prefix, settings.replicas.ttl_s)
    try:
        if settings.engine.launch:
            await launch_workers(settings, launched)
        # launched workers serve engine.served_model_name's model (when it is one of the registry's)
        launched_model = registry.resolve(settings.engine.served_model_name)
        listed = [url for m in registry.models for url in m.workers]
        pool = WorkerPool(
            list(dict.fromkeys([w.url for w in launched] + list(up.workers) + listed)),
            client,
            up.health_interval_s,
            up.health_timeout_s,
            BreakerConfig(
                up.breaker_failures,
                up.breaker_successes,
                up.breaker_cooldown_s,
                trust_window_s=up.probe_trust_window_s,
            ),
            on_transition=lambda url, state: metrics.breaker_transitions.labels(url, state).inc(),
            deep_probe_every=up.deep_probe_every,
            on_confirmation=lambda url, verdict: metrics.upstream_5xx_confirmations.labels(
                url, verdict
            ).inc(),
            models=registry,
            assigned={w.url: launched_model.id for w in launched} if launched_model else None,
            drain_deadline_s=up.worker_drain_deadline_s,
        )
        # the workers the settings list are shared too: a drain on one replica reaches every replica
        worker_registry = WorkerRegistry(redis, settings.redis.key_prefix, [*up.workers, *listed])
        if settings.discovery.dns_name is not None:  # found workers registered for every replica
            discovery = DnsDiscovery(settings.discovery, worker_registry)
            await discovery.sync()
            background.append(asyncio.create_task(discovery.run(), name="worker-discovery"))
        managed = await sync_once(pool, worker_registry, set())  # registered workers in the first probe
        await pool.start()
        if settings.engine.supervise:
            for worker in launched:
                supervisor = WorkerSupervisor(
                    worker,
                    pool,
                    client,
                    settings.engine,
                    on_restart=lambda url, reason: metrics.worker_restarts.labels(url, reason).inc(),
                )
                supervisor.start()
                supervisors.append(supervisor)
        if not pool.workers:
            log.warning("no_workers_configured", hint=no_workers_hint(settings.discovery))
        policy = await eviction_policy(redis)
        if policy not in (None, "noeviction"):
            log.warning(
                "redis_evicts_keys",
                maxmemory_policy=policy,
                hint="a full Redis may drop tenants, API keys, quota buckets and settle markers; "
                "set maxmemory-policy noeviction (a full Redis then answers 503 and loses nothing)",
            )
        obs = settings.observability
        if obs.loop_lag_interval_s:
            background.append(
                asyncio.create_task(
                    watch_loop_lag(
                        metrics.runtime.loop_lag, obs.loop_lag_interval_s, tasks=metrics.runtime.tasks
                    ),
                    name="loop-lag",
                )
            )
        if obs.engine_scrape_s:
            background.append(
                asyncio.create_task(
                    scrape_engines(metrics.pool, client, lambda: pool.workers, obs.engine_scrape_s),
                    name="engine-gauges",
                )
            )
        prefix = settings.redis.key_prefix
        auth_cache = AuthCache(settings.redis.auth_cache_ttl_s, settings.redis.auth_cache_entries)
        tenants = TenantStore(redis, prefix, settings.key_pepper.get_secret_value().encode(), auth_cache)
        # tenants stored with a class that is no longer configured: reported once, off the startup path
        background.append(asyncio.create_task(report_at_startup(tenants, settings), name="tenant-classes"))
        revocations = RevocationRegistry(*store_checks(tenants), enabled=settings.api.end_revoked_requests)
        billing = Billing.build(redis, settings, metrics)  # prices, budgets (service/pipeline/billing.py)
        retention, rows = settings.pricing.usage_retention_days, settings.pricing.max_usage_rows_per_day
        quota = QuotaLimiter(redis, prefix, settings.redis.settle_linger_s, retention, rows)
        quota.on_soft_limit = billing.soft_limit_reached
        settler = Settler(quota, settings.redis, metrics)
        background.append(asyncio.create_task(settler.replay(), name="settle-journal"))  # off startup
        leased = LeasedQuota(
            quota,
            settings.redis.quota_lease_s,
            settings.redis.quota_lease_max_fraction,
            2 * settings.redis.quota_lease_s,
            on_reserve=lease_counter(metrics),
            before_remote=settler.ahead_of_reservation,  # summed refunds land before the reservation
            report_levels=settings.api.rate_limit_headers,
        )

        # redis.on_outage = open (service/pipeline/outage.py); None: closed
        outage = outage_policy(settings, metrics, lambda: len(replicas.live), billing, settler, reach)

        def on_invalidation(message: str) -> None:
            revocations.on_invalidation(message)
            leased.on_invalidation(message)
            billing.on_invalidation(message)
            if outage is not None:
                outage.keys.apply(message)

        follow = follow_invalidations(  # always: every replica caches prices and budgets
            subscriber, invalidation_channel(prefix), auth_cache, also=on_invalidation
        )
        background.append(asyncio.create_task(follow, name="auth-invalidations"))
        usage = UsageRecorder(redis, prefix)
        concurrency = ConcurrencyLimiter(
            redis, prefix, settings.redis.concurrency_lease_s, on_lost=metrics.concurrency_slots_lost.inc
        )
        tenants.observe_call = quota.observe_call = usage.observe_call = metrics.runtime.observe_store_call
        concurrency.observe_call = metrics.runtime.observe_store_call
        # one tokenizer and one admission core per model: a request is placed among its model's workers
        # every replica's heartbeat: the live ones split each worker's window (service/workers/replicas.py)
        with contextlib.suppress(StoreUnavailable):
            await replicas.beat()
        background.append(asyncio.create_task(replicas.run(settings.replicas.heartbeat_s), name="replicas"))
        share = replicas.share if settings.replicas.share_windows else None
        observer = app.state.route_sync_metrics  # None with the sync off
        routes = route_sync(settings.replicas, redis, subscriber, prefix, replicas.id, observer)
        models = ServedModels(
            settings,
            pool,
            client,
            metrics,
            revocations.end_request,
            registry,
            window_share=share,
            on_route=None if routes is None else routes.publish,
        )
        if routes is not None:  # the other replicas' dispatches, into this one's routers
            background.append(asyncio.create_task(routes.follow(models.observe_peer_route), name="routes"))
        scheduler = models.default.scheduler
        metrics.pool.queued_of = lambda: {snap.url: snap.queued for snap in models.snapshot()}
        await models.start()
        dispatcher = Dispatcher(
            settings,
            models,
            leased,
            usage,
            pool,
            client,
            metrics,
            settler,
            revocations,
            concurrency,
            billing,
            status_of=http_status,
            outage=outage,
        )
        if metrics.multiprocess:
            background.append(
                asyncio.create_task(
                    refresh_pool_gauges(
                        metrics, lambda: pool.workers, settings.observability.metrics_refresh_s
                    ),
                    name="pool-gauges",
                )
            )
        background.append(
            asyncio.create_task(
                sync_loop(pool, worker_registry, up.health_interval_s, managed), name="worker-registry"
            )
        )
        planner = None
        if settings.planner.enabled:  # radixgate_desired_workers{model} (service/pipeline/planner_task.py)
            planner = PlannerTask(settings.planner, models, pool, metrics.planner, replicas)
            background.append(asyncio.create_task(planner.run(), name="planner"))
        for task in background:  # a background task that fails says so at once, not at shutdown
            task.add_done_callback(log_failure)
        drain = Drain(settings.shutdown, revocations.end_all)
        app.state.radixgate = GatewayState(
            settings,
            redis,
            tenants,
            quota,
            usage,
            pool,
            dispatcher,
            metrics,
            scheduler,
            worker_registry,
            drain,
            models,
            billing,
            planner,
            outage,
        )
        if isinstance(app, GatewayApp):
            app.drain = drain
        log.info("gateway_ready", workers=[w.url for w in pool.workers], models=registry.names)
        # the objects built so far (settings, tokenizer, routes, schemas) live as long as the process: move
        # them out of the cyclic collector's generations, so collections scan only per-request garbage
        # (CPython's gc.freeze; bench c64: 0.57-0.61 -> 0.54 CPU ms/request, same machine state)
        gc.collect()
        gc.freeze()
        # a young generation smaller than what the requests in flight hold made the collector run ~430
        # times a second at 64 concurrent requests, each time scanning and promoting their live objects
        # (~22 us of CPU per request; ~1 us at 5000: see Settings.gc_young_threshold)
        threshold = gc.get_threshold()
        gc.set_threshold(settings.gc_young_threshold, *threshold[1:])
        try:
            with drain_on_signals(drain):  # SIGTERM/SIGINT drain first (service/runtime/drain.py), then stop
                yield
            await drain.wait()  # uvicorn shuts down once the connections are closed: the drain is ending
        finally:
            if isinstance(app, GatewayApp):
                app.drain = None
            # what was frozen is the gateway's own: once it stops, the collector may free it again (a
            # process that runs it more than once kept every stopped gateway otherwise)
            gc.unfreeze()
            gc.set_threshold(*threshold)
            try:
                await models.stop()
                if routes is not None:
                    await routes.close()
                await pool.stop()
            finally:  # the requests have ended: land the settles still being retried, while Redis is open
                if outage is not None:  # what was served while Redis was away: settled, or journaled
                    outage.flush()
                await settler.drain()
                await leased.close()
                await concurrency.close()
    finally:
        await stop_tasks(background)  # each may be in a Redis call, which can swallow one cancel
        await replicas.leave()  # its window share goes back to the other replicas at once
        if revocations is not None:
            await revocations.stop()
        for supervisor in supervisors:  # before stopping the workers, so none is restarted
            await supervisor.stop()
        await client.aclose()
        if app.state.tracing is not None:  # the spans still batched go out (off the event loop)
            await asyncio.to_thread(app.state.tracing.shutdown)
        await redis.aclose()
        await subscriber.aclose()
        await pinger.aclose()
        for worker in launched:
            worker.stop()


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the gateway app.

    Args:
        settings: the configuration; read from the environment (``RADIXGATE_*``) when None.

    Returns:
        A FastAPI app whose lifespan connects Redis, launches or probes workers and loads the tokenizer.
    """
    settings = settings or Settings()
    configure_logging(settings.observability.log_level)
    # no redirect_slashes: "/admin/tenants/" (an empty id) is a 404, not a 307 to the list of every tenant
    app = GatewayApp(title="radixgate", version="0.1.0", lifespan=_lifespan, redirect_slashes=False)
    app.state.settings = settings
    app.operator = operator_ports(settings)
    app.state.bad_keys = BadKeyThrottle(settings.security)  # service/api/key_guessing.py
    obs = settings.observability
    app.state.metrics = GatewayMetrics(
        CollectorRegistry(), obs.max_tenant_labels, obs.metrics_multiproc_dir, obs.engine_scrape_s
    )
    # the route sync's series exist only where it runs (a subscribed gauge at 0 would read as broken)
    on = settings.replicas.share_routes
    app.state.route_sync_metrics = RouteSyncMetrics(app.state.metrics.registry) if on else None
    traces = settings.tracing  # off: no provider at all (service/observability/tracing.py)
    app.state.tracing = None
    if traces.enabled:  # the SDK is the optional extra "otel"
        from service.observability.tracing import Tracing

        app.state.tracing = Tracing.otlp(traces.otlp_endpoint, traces.service_name, traces.sample_ratio)
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(admin_routes.router)
    app.include_router(admin_keys.router)
    app.include_router(admin_billing.router)
    app.include_router(admin_workers.router)
    app.include_router(admin_planner.router)
    app.include_router(health_routes.router)
    install_body_schemas(app, list(openai_routes.BODY_MODELS))
    install_body_schemas(
        app,
        [*admin_routes.ADMIN_BODY_MODELS, *admin_keys.ADMIN_BODY_MODELS, *admin_billing.ADMIN_BODY_MODELS],
        suffix=ADMIN_SUFFIX,
    )
    app.add_middleware(AdminAuditLog, admin_token=settings.admin_token.get_secret_value())  # inside the ids
    app.add_middleware(RequestIdMiddleware)
    return app

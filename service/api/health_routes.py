"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE

from service.api.deps import StateDep
from service.api.operator_access import operator_request, require_metrics_access
from service.observability.redis_watch import answers
from service.runtime.drain import RETRY_AFTER_S

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request, state: StateDep) -> JSONResponse:
    """Ready when Redis answers (under ``redis.on_outage = open``: also when it does not) and at least one
    worker is healthy (503 otherwise); 503 with
    ``"draining": true`` from the stop signal on (:mod:`service.runtime.drain`): a balancer stops sending
    here. Anyone gets ``ready`` and ``draining``; the detail (Redis, each worker's URL and health) only an
    operator (:func:`service.api.operator_access.operator_request`: the operator port, the admin token or
    the metrics token): worker URLs are internal addresses."""
    if state.drain.draining:
        return JSONResponse(
            {"ready": False, "draining": True},
            status_code=503,
            headers={"Retry-After": str(int(RETRY_AFTER_S)), "Connection": "close"},
        )
    redis_ok = await answers(state.redis, state.settings.redis.cluster)  # a cluster: its state ok too
    workers = {w.url: w.healthy for w in state.pool.workers}
    # under redis.on_outage = open a replica serves without Redis (service/pipeline/outage.py): it stays
    # ready, or a balancer would take every replica out at once
    ready = (redis_ok or state.outage is not None) and any(workers.values())
    body: dict[str, object] = {"ready": ready, "draining": False}
    if operator_request(request, state.settings):
        body |= {"redis": redis_ok, "workers": workers}
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request, state: StateDep) -> Response:
    """Prometheus exposition of this replica's metrics: the OpenMetrics text format (with the latency
    histograms' exemplars, when tracing is on) to a scraper whose ``Accept`` names
    ``application/openmetrics-text`` (Prometheus does, and keeps exemplars with
    ``--enable-feature=exemplar-storage``), else the classic text format. With ``security.metrics_token``
    set, only to its bearer (or the admin token's): 401/403 otherwise.

    Raises:
        APIError: 401/403 (:func:`service.api.operator_access.require_metrics_access`).
    """
    require_metrics_access(request, state.settings)
    if "application/openmetrics-text" in request.headers.get("accept", ""):
        body = state.metrics.scrape(state.pool.workers, openmetrics=True)
        return Response(body, media_type=OPENMETRICS_TYPE)
    return Response(state.metrics.scrape(state.pool.workers), media_type=CONTENT_TYPE_LATEST)

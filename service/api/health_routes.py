"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_TYPE
from redis.exceptions import RedisError

from service.api.deps import StateDep
from service.runtime.drain import RETRY_AFTER_S

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(state: StateDep) -> JSONResponse:
    """Ready when Redis answers and at least one worker is healthy (503 otherwise); 503 with
    ``"draining": true`` from the stop signal on (:mod:`service.runtime.drain`): a balancer stops sending
    here."""
    if state.drain.draining:
        return JSONResponse(
            {"ready": False, "draining": True},
            status_code=503,
            headers={"Retry-After": str(int(RETRY_AFTER_S)), "Connection": "close"},
        )
    try:
        redis_ok = bool(await state.redis.ping())
    except RedisError:
        redis_ok = False
    workers = {w.url: w.healthy for w in state.pool.workers}
    ready = redis_ok and any(workers.values())
    return JSONResponse(
        {"ready": ready, "draining": False, "redis": redis_ok, "workers": workers},
        status_code=200 if ready else 503,
    )


@router.get("/metrics")
async def metrics(request: Request, state: StateDep) -> Response:
    """Prometheus exposition of this replica's metrics: the OpenMetrics text format (with the latency
    histograms' exemplars, when tracing is on) to a scraper whose ``Accept`` names
    ``application/openmetrics-text`` (Prometheus does, and keeps exemplars with
    ``--enable-feature=exemplar-storage``), else the classic text format."""
    if "application/openmetrics-text" in request.headers.get("accept", ""):
        body = state.metrics.scrape(state.pool.workers, openmetrics=True)
        return Response(body, media_type=OPENMETRICS_TYPE)
    return Response(state.metrics.scrape(state.pool.workers), media_type=CONTENT_TYPE_LATEST)

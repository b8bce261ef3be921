"""Admin API for workers: add, drain, remove, list with health and load (admin token required)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, field_validator

from service.api.deps import AdminDep, JsonBody, StateDep
from service.api.errors import APIError
from service.api.openai_routes import parse
from service.api.paging import DEFAULT_PAGE, After, Limit, list_object, page_after
from service.config.checks import worker_url
from service.state import GatewayState
from service.workers.registry import WorkerMode, worker_id

router = APIRouter(prefix="/admin/workers", tags=["admin"], dependencies=[AdminDep])


class WorkerAdd(BaseModel):
    """Body of ``POST /admin/workers``: strict, and an unknown field is refused (400), as in every admin
    body (``tenancy.models``); ignoring one answered ``"mode": "draining"`` with an active worker."""

    model_config = ConfigDict(extra="forbid", strict=True)

    url: HttpUrl = Field(..., description="Base URL of an SGLang worker, e.g. http://10.0.0.5:30000")

    @field_validator("url")
    @classmethod
    def _plain_url(cls, value: HttpUrl) -> HttpUrl:
        worker_url(str(value))
        return value


async def _find(state: GatewayState, wid: str) -> tuple[str, WorkerMode | None]:
    """The URL behind a worker id and its registry mode (None for a worker this replica launched: not in
    the registry)."""
    entries = await state.registry.entries()
    for url, mode in entries.items():
        if worker_id(url) == wid:
            return url, mode
    for worker in state.pool.workers:
        if worker_id(worker.url) == wid:
            return worker.url, None
    raise APIError(404, f"Worker '{wid}' does not exist.", code="worker_not_found")


def _launched_here(url: str) -> APIError:
    """409 for a worker this replica launched (``engine.launch``): local to it and not in the registry,
    the admin API neither registers, drains nor removes it (that would reach this replica only)."""
    return APIError(
        409,
        f"Worker '{url}' was launched by this gateway process (RADIXGATE_ENGINE__LAUNCH); it is managed "
        "there.",
        code="worker_exists",
        param="url",
    )


def _listed_in_settings(url: str) -> APIError:
    """409 for removing a worker this replica's settings list: its next sync would register it again
    (drain it instead: that reaches every replica and lasts until it is made active again)."""
    return APIError(
        409,
        f"Worker '{url}' is listed in the gateway's settings (RADIXGATE_UPSTREAM__WORKERS or the models' "
        "workers); drain it (POST /admin/workers/{id}/drain), or remove it from the settings.",
        code="worker_exists",
        param="url",
    )


def _iso(unix_s: float | None) -> str | None:
    """A Unix time (s) as ISO 8601 UTC, e.g. ``2026-01-31T12:00:00.123Z``; None stays None."""
    if unix_s is None:
        return None
    return datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _source(url: str, entries: dict[str, WorkerMode], discovered: dict[str, bool], listed: set[str]) -> str:
    """Where a worker comes from: ``settings`` (some replica's settings list it), ``discovery``, ``admin``
    (registered over this API), or ``launched`` (by this replica, not in the registry)."""
    if url in listed:
        return "settings"
    if url in discovered:
        return "discovery"
    return "admin" if url in entries else "launched"


@router.get("")
async def list_workers(state: StateDep, limit: Limit = DEFAULT_PAGE, after: After = None) -> dict[str, Any]:
    """The workers this replica knows, in id order, a page at a time (:mod:`service.api.paging`: at most
    ``limit``, 1-1000, default 100, after id ``after``), each with its source (``settings``, ``admin``,
    ``discovery`` or ``launched``), mode, breaker, in-flight
    and window, and what admission measured of it: capacity (req/s), engine TTFT of short prefills (ms)
    (its model's parts and prediction, below) and, per class, the calibration scale of its TTFT predictions
    (``scheduler.prediction_calibration_target``); and why it is healthy or not (``health_reason``: what
    was seen at the last change, e.g. ``"connection refused"``) since when (``health_since``, ISO 8601 UTC;
    both None until its first probe); the model it serves (``model``, the canonical id; None when it
    serves none of the gateway's) and, for a worker kept out because it reports another model, why
    (``model_mismatch``).

    The engine TTFT model admission predicts with (:class:`policies.estimates.WorkerEstimates`), each None
    while unknown: ``ttft_base_ms``, its fixed part (dispatch to first token not explained by prefill
    tokens; not a TTFT: a few ms where prefills take hundreds), ``prefill_ms_per_1k_tokens``, its per-token
    part, and ``idle_ttft_ms``, the engine TTFT it predicts for a request of 1,000 uncached prompt tokens
    with nothing ahead of it (:data:`policies.admission_types.IDLE_TTFT_PROMPT_TOKENS`): what the worker can
    do at best, to compare with a class's TTFT goal. (``engine_ttft_ms`` was ``ttft_base_ms`` under a name
    that read as a TTFT.)"""
    entries = await state.registry.entries()
    discovered = await state.registry.discovered()
    listed = await state.registry.listed()
    known = dict.fromkeys([w.url for w in state.pool.workers] + list(entries))
    ordered = sorted((worker_id(url), url) for url in known)
    page, more = page_after(ordered, lambda entry: entry[0], after or None, limit)
    snaps = {snap.url: snap for snap in state.models.snapshot()}
    data = []
    for _, url in page:
        worker = state.pool.get(url)
        data.append(
            {
                "id": worker_id(url),
                "url": url,
                "source": _source(url, entries, discovered, listed),
                "mode": entries.get(url, "draining" if worker and worker.draining else "active"),
                "in_pool": worker is not None,
                "healthy": bool(worker and worker.healthy),
                "breaker": worker.breaker.state if worker else None,
                "health_reason": worker.health_reason if worker else None,
                "health_since": _iso(worker.health_since) if worker else None,
                "in_flight": worker.in_flight if worker else 0,
                "in_flight_tokens": worker.in_flight_tokens if worker else 0,
                "model": worker.model if worker else None,
                "model_mismatch": worker.model_mismatch if worker else None,
                "window": window.size if worker and (window := state.models.window(url)) else None,
                "queued": snap.queued if (snap := snaps.get(url)) else 0,
                "capacity_rps": snap.capacity_rps if snap else None,
                "ttft_base_ms": _ms(snap.ttft_base_s if snap else None),
                "prefill_ms_per_1k_tokens": _ms(
                    snap.prefill_s_per_token * 1000 if snap and snap.prefill_s_per_token is not None else None
                ),
                "idle_ttft_ms": _ms(snap.idle_ttft_s if snap else None),
                "prediction_scale": dict(snap.prediction_scales) if snap else {},
            }
        )
    return list_object(data, "id", more)


def _ms(seconds: float | None) -> float | None:
    """Seconds as milliseconds, to the microsecond; None stays None."""
    return None if seconds is None else round(seconds * 1e3, 3)


@router.post("", status_code=201)
async def add_worker(body: JsonBody, state: StateDep) -> dict[str, Any]:
    """Register a worker for every replica (it takes traffic after its first good health probe), or make
    a registered one active again (a drained worker, whatever its source: settings, discovery, admin).

    Raises:
        APIError: 409 ``worker_exists`` when the URL is a worker this replica launched (local to it).
    """
    url = str(parse(WorkerAdd, body).url).rstrip("/")
    if state.pool.get(url) is not None and url not in await state.registry.entries():
        raise _launched_here(url)
    await state.registry.add(url)
    if url not in await state.registry.listed() or url in state.registry.listed_here:
        state.pool.add(url)  # this replica at once; the others at their next sync
    state.pool.activate(url)
    return {"id": worker_id(url), "url": url, "mode": "active"}


@router.post("/{wid}/drain")
async def drain_worker(wid: str, state: StateDep) -> dict[str, Any]:
    """Stop new traffic to a worker, on every replica within one registry sync: what it runs finishes
    there, or moves to another worker of its model at ``upstream.worker_drain_deadline_s``; it leaves the
    pool once nothing runs on it. ``POST /admin/workers`` with its URL makes it active again.

    Raises:
        APIError: 409 ``worker_exists`` for a worker this replica launched.
    """
    url, mode = await _find(state, wid)
    if mode is None:
        raise _launched_here(url)
    await state.registry.set_mode(url, "draining")
    state.pool.drain(url)
    return {"id": wid, "url": url, "mode": "draining"}


@router.delete("/{wid}", status_code=204)
async def remove_worker(wid: str, state: StateDep) -> Response:
    """Remove a worker now (requests already running on it finish).

    Raises:
        APIError: 409 ``worker_exists`` for a worker this replica launched or its settings list.
    """
    url, mode = await _find(state, wid)
    if mode is None:
        raise _launched_here(url)
    if url in state.registry.listed_here:
        raise _listed_in_settings(url)
    await state.registry.remove(url)
    state.pool.remove(url)
    state.models.remove_worker(url)
    return Response(status_code=204)

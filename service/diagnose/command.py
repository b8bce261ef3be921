"""What ``python -m service diagnose`` does, apart from its options: read the window from its source, build
the snapshots (:mod:`.snapshot`), judge them (:func:`policies.diagnosis.diagnose`).

Two sources (:mod:`.sources`):

- ``--prometheus URL --window 5m [--baseline 1h] [--at T]``: PromQL over Prometheus's HTTP API; the
  gateway's series summed over its replicas, the workers' keyed by ``instance``.
- ``--gateway URL [--worker URL ...] --window-s 10 [--interval-s 1]``: the gateway's and the workers'
  ``/metrics`` read directly every ``interval_s``; without ``--worker``, the workers the gateway lists on
  ``GET /admin/workers`` (an admin token needed). The baseline is everything the processes counted before
  the window.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import httpx

from policies.diagnosis import diagnose
from policies.diagnosis_types import Diagnosis, FleetView, Thresholds
from service.diagnose.snapshot import fleet_view
from service.diagnose.sources import (
    PrometheusWindow,
    host_port,
    list_workers,
    prometheus_query,
    scrape_window,
)

DEFAULT_THRESHOLDS = Thresholds()
"""The thresholds a run uses unless told otherwise (:class:`policies.diagnosis_types.Thresholds`)."""

MAX_WORKERS = 1000
"""Most workers one direct-scrape run reads."""

MAX_WINDOW_S = 3600.0
"""Longest direct-scrape window, s."""

MAX_PROMETHEUS_S = 90 * 86400.0
"""Longest Prometheus window or baseline, s (90 days)."""

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def thresholds(min_share: float, min_excess_s: float, min_slowdown: float) -> Thresholds:
    """The default thresholds with these three set (the command line's options)."""
    return replace(
        DEFAULT_THRESHOLDS, min_share=min_share, min_excess_s=min_excess_s, min_slowdown=min_slowdown
    )


class DiagnoseInputError(ValueError):
    """An option out of its bounds or not parseable; the message says which and why."""


def parse_duration(text: str, what: str, low_s: float = 1.0, high_s: float = MAX_PROMETHEUS_S) -> float:
    """A Prometheus duration (``5m``, ``1h30m``, ``90s``, ``500ms``) in seconds, in ``[low_s, high_s]``.

    Raises:
        DiagnoseInputError: not a duration, or out of bounds.
    """
    text = text.strip()
    parts = _DURATION.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise DiagnoseInputError(f"{what}: {text!r} is not a duration such as 5m, 1h, 30s or 500ms")
    total = sum(float(n) * _UNIT_S[u] for n, u in parts)
    if not low_s <= total <= high_s:
        raise DiagnoseInputError(f"{what}: {text} is out of bounds ({low_s:g} s to {high_s:g} s)")
    return total


def base_url(text: str, what: str) -> str:
    """``text`` as an http(s) base URL without a trailing slash.

    Raises:
        DiagnoseInputError: not an http(s) URL with a host.
    """
    try:
        url = httpx.URL(text.strip())
    except (httpx.InvalidURL, TypeError) as exc:
        raise DiagnoseInputError(f"{what}: {text!r} is not a URL ({exc})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise DiagnoseInputError(f"{what}: {text!r} is not an http(s) URL with a host")
    return str(url).rstrip("/")


@dataclass(frozen=True, slots=True)
class Result:
    """A run's diagnosis, the snapshots it judged, and its source in words."""

    diagnosis: Diagnosis
    window: FleetView
    baseline: FleetView
    source: str


def from_prometheus(
    url: str,
    window_s: float,
    baseline_s: float,
    at: float | None = None,
    thresholds: Thresholds | None = None,
    timeout_s: float = 30.0,
) -> Result:
    """Diagnose the window of ``window_s`` ending at ``at`` (Unix s, default now) on the Prometheus at
    ``url``, against the ``baseline_s`` before it.

    Raises:
        service.diagnose.sources.SourceError: Prometheus did not answer or refused a query.
    """
    end = time.time() if at is None else at
    with httpx.Client(timeout=timeout_s) as client:
        src = PrometheusWindow(prometheus_query(url, end, client), window_s, baseline_s)
        window = fleet_view(src, [])
        baseline = fleet_view(src, [w.name for w in window.workers], baseline=True)
    source = f"Prometheus {url} ({window_s:g} s to {end:.0f}, baseline {baseline_s:g} s before)"
    return Result(diagnose(window, baseline, thresholds), window, baseline, source)


async def from_scrapes(
    gateway: str,
    workers: Sequence[str],
    window_s: float,
    interval_s: float,
    admin_token: str | None = None,
    thresholds: Thresholds | None = None,
    timeout_s: float = 10.0,
) -> Result:
    """Diagnose ``window_s`` of direct scrapes of ``gateway`` and ``workers`` (without workers: the ones
    ``GET /admin/workers`` lists, with ``admin_token``, which the gateway's ``/metrics`` is sent too).

    Raises:
        DiagnoseInputError: no workers and no admin token, or more than :data:`MAX_WORKERS`.
        service.diagnose.sources.SourceError: a target did not answer.
    """
    async with httpx.AsyncClient(timeout=timeout_s) as http:
        urls = list(workers)
        if not urls:
            if not admin_token:
                raise DiagnoseInputError(
                    "give the workers (--worker URL, repeated) or an admin token (--admin-token, or "
                    "RADIXGATE_ADMIN_TOKEN in the gateway's settings) to list them on /admin/workers"
                )
            urls = await list_workers(gateway, admin_token, http)
        if len(urls) > MAX_WORKERS:
            raise DiagnoseInputError(f"{len(urls)} workers: at most {MAX_WORKERS} per run")
        scraped = await scrape_window(gateway, urls, window_s, interval_s, http, token=admin_token)
    names = [host_port(u) for u in urls]
    window, baseline = fleet_view(scraped, names), fleet_view(scraped, names, baseline=True)
    source = f"scrapes of {gateway} and {len(urls)} workers every {interval_s:g} s"
    return Result(diagnose(window, baseline, thresholds), window, baseline, source)

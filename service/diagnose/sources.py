"""Where ``python -m service diagnose`` reads a window of metrics: two ways to answer the same three
questions (:class:`MetricSource`), how much a counter (or a histogram bucket) grew over the window or
before it, and what a gauge averaged over the window.

- :class:`ScrapedWindow`: the gateway's and the workers' ``/metrics`` read directly, every
  ``interval_s`` over ``window_s`` seconds (:func:`scrape_window`), parsed with prometheus_client's text
  parser. A counter's increase over the window is its last value minus its first (a reset: its last
  value, as Prometheus's ``increase`` counts it); the baseline is each counter's value at the first
  scrape, everything the processes counted since they started. Each worker's samples get the label
  ``instance="host:port"``, as Prometheus gives its targets'.
- :class:`PrometheusWindow`: PromQL over a Prometheus server's HTTP API (``/api/v1/query`` at one
  evaluation time): ``sum by (...) (increase(x[W]))``, the baseline ``increase(x[B] offset W)``, and
  ``avg by (...) (avg_over_time(x[W]))``; the same expressions as ``deploy/prometheus/rules/recording.yml``
  builds its quantiles and ratios on, over the window asked for.

A label matcher value ``""`` matches a missing or empty label (Prometheus's rule): SGLang's gauges with
``--enable-priority-scheduling`` carry their total under ``priority=""`` beside a per-priority breakdown.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, ...]
Match = Mapping[str, str]
OverTime = Literal["avg", "max", "min"]
Across = Literal["sum", "avg", "max", "min"]


class SourceError(Exception):
    """A source could not be read (a target did not answer, Prometheus refused a query): the message
    says which and why."""


class MetricSource(Protocol):
    """A window of metrics (module docstring)."""

    @property
    def span_s(self) -> float:
        """The window, s."""
        ...

    def increase(
        self, name: str, by: Sequence[str], match: Match | None = None, baseline: bool = False
    ) -> dict[Key, float]:
        """How much the counter samples ``name`` (a full sample name: ``x_total``, ``x_bucket``) grew over
        the window (or before it, ``baseline``), summed by the labels ``by`` (values in that order)."""
        ...

    def gauge(
        self,
        name: str,
        by: Sequence[str],
        match: Match | None = None,
        over_time: OverTime = "avg",
        across: Across = "sum",
    ) -> dict[Key, float]:
        """Gauge ``name`` aggregated ``across`` the series of each ``by`` group, then ``over_time`` over the
        window's samples."""
        ...


def _matches(labels: Mapping[str, str], match: Match | None) -> bool:
    return match is None or all(labels.get(k, "") == v for k, v in match.items())


def _reduce(values: Sequence[float], how: str) -> float:
    if how == "sum":
        return math.fsum(values)
    if how == "avg":
        return math.fsum(values) / len(values)
    return max(values) if how == "max" else min(values)


Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_exposition(text: str, extra: Mapping[str, str]) -> Samples:
    """Sample name -> [(labels with ``extra``, value)] of a Prometheus text exposition.

    Raises:
        ValueError: the text is not an exposition.
    """
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(({**sample.labels, **extra}, float(sample.value)))
    return out


@dataclass(frozen=True, slots=True)
class Scrape:
    """Every target's samples at one time (``at``: monotonic s)."""

    at: float
    samples: Samples


@dataclass
class ScrapedWindow:
    """A window from direct scrapes (module docstring): ``scrapes`` in time order, at least two."""

    scrapes: list[Scrape]

    @property
    def span_s(self) -> float:
        """The first scrape to the last, s."""
        return self.scrapes[-1].at - self.scrapes[0].at

    @staticmethod
    def _series(scrape: Scrape, name: str, match: Match | None) -> dict[tuple[tuple[str, str], ...], float]:
        return {
            tuple(sorted(labels.items())): value
            for labels, value in scrape.samples.get(name, [])
            if _matches(labels, match)
        }

    def increase(
        self, name: str, by: Sequence[str], match: Match | None = None, baseline: bool = False
    ) -> dict[Key, float]:
        """See :meth:`MetricSource.increase`."""
        first = self._series(self.scrapes[0], name, match)
        grown = first if baseline else {}
        if not baseline:
            for series, last in self._series(self.scrapes[-1], name, match).items():
                before = first.get(series, 0.0)
                grown[series] = last - before if last >= before else last
        out: dict[Key, float] = {}
        for series, value in grown.items():
            labels = dict(series)
            key = tuple(labels.get(b, "") for b in by)
            out[key] = out.get(key, 0.0) + value
        return out

    def gauge(
        self,
        name: str,
        by: Sequence[str],
        match: Match | None = None,
        over_time: OverTime = "avg",
        across: Across = "sum",
    ) -> dict[Key, float]:
        """See :meth:`MetricSource.gauge`."""
        per_time: dict[Key, list[float]] = {}
        for scrape in self.scrapes:
            groups: dict[Key, list[float]] = {}
            for labels, value in scrape.samples.get(name, []):
                if _matches(labels, match) and not math.isnan(value):
                    groups.setdefault(tuple(labels.get(b, "") for b in by), []).append(value)
            for key, values in groups.items():
                per_time.setdefault(key, []).append(_reduce(values, across))
        return {key: _reduce(values, over_time) for key, values in per_time.items()}


def host_port(url: str) -> str:
    """``host:port`` of a base URL (the port made explicit), Prometheus's ``instance`` of that target."""
    parsed = httpx.URL(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return f"{parsed.host}:{port}"


async def scrape_window(
    gateway: str,
    workers: Sequence[str],
    window_s: float,
    interval_s: float,
    http: httpx.AsyncClient,
    clock: Callable[[], float] = time.monotonic,
    token: str | None = None,
) -> ScrapedWindow:
    """Scrape ``gateway`` and ``workers`` (base URLs) every ``interval_s`` (the last one at ``window_s``),
    all targets at once each time; ``token``: the bearer token sent to the gateway (its metrics or admin
    token, for a gateway with ``security.metrics_token`` set; docs/security.md).

    Raises:
        SourceError: a target did not answer 200 with an exposition.
    """
    targets = [gateway, *workers]
    ticks = max(1, math.ceil(window_s / interval_s))
    start = clock()
    scrapes: list[Scrape] = []
    for tick in range(ticks + 1):
        due = start + min(window_s, tick * interval_s)
        await asyncio.sleep(max(0.0, due - clock()))
        at = clock()
        gateway_auth = {"Authorization": f"Bearer {token}"} if token else {}
        texts = await asyncio.gather(
            *(_get_metrics(http, url, gateway_auth if url == gateway else {}) for url in targets)
        )
        samples: Samples = {}
        for url, text in zip(targets, texts, strict=True):
            for name, rows in parse_exposition(text, {"instance": host_port(url)}).items():
                samples.setdefault(name, []).extend(rows)
        scrapes.append(Scrape(at, samples))
    return ScrapedWindow(scrapes)


async def _get_metrics(http: httpx.AsyncClient, url: str, headers: Mapping[str, str]) -> str:
    try:
        resp = await http.get(url.rstrip("/") + "/metrics", headers=headers)
    except httpx.HTTPError as exc:
        raise SourceError(f"{url}/metrics: {exc.__class__.__name__}: {exc}") from None
    if resp.status_code in (401, 403):
        raise SourceError(
            f"{url}/metrics answered {resp.status_code}: the gateway asks for its metrics token "
            "(--admin-token, or RADIXGATE_ADMIN_TOKEN in the gateway's settings)"
        )
    if resp.status_code != 200:
        raise SourceError(f"{url}/metrics answered {resp.status_code}")
    return resp.text


async def list_workers(gateway: str, admin_token: str, http: httpx.AsyncClient) -> list[str]:
    """The worker URLs the gateway knows (``GET /admin/workers``, every page).

    Raises:
        SourceError: the gateway refused (a wrong token: 401) or did not answer.
    """
    urls: list[str] = []
    after: str | None = None
    while True:
        params = {"limit": "1000", **({"after": after} if after else {})}
        try:
            resp = await http.get(
                gateway.rstrip("/") + "/admin/workers",
                params=params,
                headers={"Authorization": f"Bearer {admin_token}"},
            )
        except httpx.HTTPError as exc:
            raise SourceError(f"{gateway}/admin/workers: {exc.__class__.__name__}: {exc}") from None
        if resp.status_code != 200:
            raise SourceError(f"{gateway}/admin/workers answered {resp.status_code}: {resp.text[:200]}")
        body = resp.json()
        urls.extend(str(w["url"]) for w in body["data"])
        if not body.get("has_more") or not body["data"]:
            return urls
        after = str(body["data"][-1]["id"])


def promql_duration(seconds: float) -> str:
    """``seconds`` as a PromQL duration in whole milliseconds (``1500ms``)."""
    return f"{max(1, round(seconds * 1000))}ms"


def _selector(name: str, match: Match | None) -> str:
    if not match:
        return name
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(match.items()))
    return f"{name}{{{inner}}}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


@dataclass
class PrometheusWindow:
    """A window read from Prometheus (module docstring).

    Args:
        query: runs an instant PromQL query, returns its vector as (labels, value) pairs; raises
            :class:`SourceError` on a failure (:func:`prometheus_query` builds one over HTTP).
        window_s: the window, ending at the query's evaluation time.
        baseline_s: the span before the window that the baseline covers.
    """

    query: Callable[[str], list[tuple[dict[str, str], float]]]
    window_s: float
    baseline_s: float
    queries: list[str] = field(default_factory=list)

    @property
    def span_s(self) -> float:
        """The window, s."""
        return self.window_s

    def _run(self, expr: str, by: Sequence[str]) -> dict[Key, float]:
        self.queries.append(expr)
        out: dict[Key, float] = {}
        for labels, value in self.query(expr):
            if not math.isnan(value):
                out[tuple(labels.get(b, "") for b in by)] = value
        return out

    def increase(
        self, name: str, by: Sequence[str], match: Match | None = None, baseline: bool = False
    ) -> dict[Key, float]:
        """See :meth:`MetricSource.increase`."""
        rng = (
            f"[{promql_duration(self.baseline_s)}] offset {promql_duration(self.window_s)}"
            if baseline
            else f"[{promql_duration(self.window_s)}]"
        )
        expr = f"sum by ({', '.join(by)}) (increase({_selector(name, match)}{rng}))"
        return self._run(expr, by)

    def gauge(
        self,
        name: str,
        by: Sequence[str],
        match: Match | None = None,
        over_time: OverTime = "avg",
        across: Across = "sum",
    ) -> dict[Key, float]:
        """See :meth:`MetricSource.gauge`."""
        inner = f"{over_time}_over_time({_selector(name, match)}[{promql_duration(self.window_s)}])"
        return self._run(f"{across} by ({', '.join(by)}) ({inner})", by)


def prometheus_query(
    base_url: str, at: float, client: httpx.Client
) -> Callable[[str], list[tuple[dict[str, str], float]]]:
    """A query function for :class:`PrometheusWindow`: ``GET /api/v1/query`` at Unix time ``at``.

    Its calls raise :class:`SourceError` when Prometheus does not answer, or answers an error or a
    result that is not a vector.
    """

    def query(expr: str) -> list[tuple[dict[str, str], float]]:
        try:
            resp = client.get(
                base_url.rstrip("/") + "/api/v1/query", params={"query": expr, "time": f"{at:.3f}"}
            )
        except httpx.HTTPError as exc:
            raise SourceError(f"{base_url}: {exc.__class__.__name__}: {exc}") from None
        try:
            body = resp.json()
        except ValueError:
            raise SourceError(f"{base_url} answered {resp.status_code}, not JSON") from None
        if resp.status_code != 200 or body.get("status") != "success":
            raise SourceError(f"{base_url} refused {expr!r}: {body.get('error', resp.status_code)}")
        data = body["data"]
        if data.get("resultType") != "vector":
            raise SourceError(f"{expr!r} gave a {data.get('resultType')}, not a vector")
        return [(dict(r["metric"]), float(r["value"][1])) for r in data["result"]]

    return query


def merged(groups: Iterable[Mapping[Key, float]]) -> dict[Key, float]:
    """The groups' values summed per key."""
    out: dict[Key, float] = {}
    for group in groups:
        for key, value in group.items():
            out[key] = out.get(key, 0.0) + value
    return out

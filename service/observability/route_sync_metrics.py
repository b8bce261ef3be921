"""The router replica sync's series (:mod:`service.workers.route_sync`):

- ``radixgate_route_sync_routes_total{outcome}``: routes ``published`` by this replica for the others,
  ``learned`` from the others (inserted into this replica's prefix trees), ``dropped`` (not published:
  Redis failed the publish, or the backlog of one event-loop turn was full). A replica that learns nothing
  while the others publish has lost its subscription (``route_sync_lost`` in its log).
"""

from __future__ import annotations

from typing import Literal

from prometheus_client import CollectorRegistry, Counter

RouteOutcome = Literal["published", "learned", "dropped"]


class RouteSyncMetrics:
    """The route sync's counter, in ``registry``; its three outcomes are registered at zero."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.routes = Counter(
            "radixgate_route_sync_routes_total",
            "Routes of the router replica sync: published for the other replicas, learned from them, or "
            "dropped (not published).",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("published", "learned", "dropped"):
            self.routes.labels(outcome)

    def count(self, outcome: str, routes: int) -> None:
        """Add ``routes`` to ``outcome`` (one of :data:`RouteOutcome`)."""
        self.routes.labels(outcome).inc(routes)

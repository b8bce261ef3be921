"""The router replica sync's series (``replicas.share_routes``, :mod:`service.workers.route_sync`):

- ``radixgate_route_sync_routes_total{outcome}``: routes ``published`` (this replica's dispatches sent to
  the other replicas), ``dropped`` (not sent: a full backlog, or Redis failed the publish) and ``learned``
  (the other replicas' dispatches put into this replica's routers). With N replicas, every replica's
  ``learned`` rate near the sum of the others' ``published`` means nothing is lost on the way; a shortfall
  with ``subscribed`` at 0 means Redis cut the subscription (down, or a subscriber past Redis's
  ``client-output-buffer-limit pubsub``);
- ``radixgate_route_sync_subscribed``: 1 while this replica follows the other replicas' routes, 0 while
  its subscription is broken (in multiprocess mode: 0 when any live process's is).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

ROUTE_OUTCOMES = ("published", "dropped", "learned")
"""The values of ``radixgate_route_sync_routes_total``'s ``outcome`` label."""


class RouteSyncMetrics:
    """The route sync's series, in ``registry``; :meth:`routes` and :meth:`subscribed` are the callbacks
    :class:`service.workers.route_sync.RouteSync` takes."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.routes_total = Counter(
            "radixgate_route_sync_routes_total",
            "Router replica sync: routes published to the other gateway replicas, dropped (backlog full "
            "or Redis failed the publish), or learned from them.",
            ["outcome"],
            registry=registry,
        )
        for outcome in ROUTE_OUTCOMES:  # every series from the start (a rate over a missing one is empty)
            self.routes_total.labels(outcome)
        self.subscribed_gauge = Gauge(
            "radixgate_route_sync_subscribed",
            "1 while this replica follows the other gateway replicas' routes (Redis pub/sub), 0 while its "
            "subscription is broken.",
            registry=registry,
            multiprocess_mode="livemin",
        )

    def routes(self, outcome: str, n: int) -> None:
        """``n`` routes had ``outcome`` (one of :data:`ROUTE_OUTCOMES`)."""
        self.routes_total.labels(outcome).inc(n)

    def subscribed(self, up: bool) -> None:
        """The subscription was made (True) or broke (False)."""
        self.subscribed_gauge.set(1 if up else 0)

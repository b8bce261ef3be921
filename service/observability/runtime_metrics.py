"""The gateway process's own health: how late its event loop runs (``radixgate_event_loop_lag_seconds``), how
many tasks it holds (``radixgate_event_loop_tasks``) and how long each quota-store call takes
(``radixgate_store_call_seconds{op}``).

Event-loop lag: :func:`watch_loop_lag` sleeps ``interval_s`` over and over and observes by how much each
sleep overran (``monotonic after - before - interval_s``, floored at 0): the time a callback that was ready
waited for the loop, because the process was busy elsewhere (CPU-bound request work, a blocking call,
a garbage collection, another process on its core). The technique of Node's
``perf_hooks.monitorEventLoopDelay``
and of aiomonitor-style watchdogs; the loop's own timer resolution (about 1 ms on Linux with the default
selector) is the floor of what it can see.

Store calls: every Redis call of a store whose ``observe_call`` hook is set (the tenant store, the quota
limiter and the usage recorder of :mod:`tenancy`; timed by :func:`tenancy.errors.store_operation` or, where
a method may answer without Redis, by :func:`tenancy.errors.timed_call` around the call itself) is timed
from the call to its answer or failure, queueing in the connection pool and the script pipeline
(:mod:`tenancy.script_batch`) included: the latency the request path waits for. ``op`` is the method's
qualified name (``QuotaLimiter.reserve``, ``QuotaLimiter.adjust``, ``QuotaLimiter.settle``,
``TenantStore.authenticate``...), the values ``radixgate_store_unavailable_total{operation}`` uses, bounded
by the store methods. An authentication answered from the auth cache, and a quota call for a tenant with no
limits, make no Redis call and are not observed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram

LOOP_LAG_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Event-loop lag buckets, s: 0.5 ms (the loop's timer resolution) to 10 s (a blocked process)."""

STORE_CALL_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)  # fmt: skip
"""Store-call buckets, s: 100 us (a local Redis round trip) to 5 s (past ``redis.socket_timeout_s``'s
default, where a call fails)."""


class RuntimeMetrics:
    """The event-loop lag and store-call histograms, registered in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.loop_lag = Histogram(
            "radixgate_event_loop_lag_seconds",
            "How late the gateway's event loop woke a sleeping task, s (each observation: one sleep of "
            "observability.loop_lag_interval_s).",
            buckets=LOOP_LAG_BUCKETS_S,
            registry=registry,
        )
        self.store_call = Histogram(
            "radixgate_store_call_seconds",
            "Latency of each quota-store (Redis) call the gateway makes, per store operation, s (waits for "
            "a pooled connection and the script pipeline included).",
            ["op"],
            buckets=STORE_CALL_BUCKETS_S,
            registry=registry,
        )
        self.tasks = Gauge(
            "radixgate_event_loop_tasks",
            "asyncio tasks alive in the gateway's event loop (summed over its processes), sampled every "
            "observability.loop_lag_interval_s: flat under steady load; growing, a leak.",
            multiprocess_mode="livesum",
            registry=registry,
        )
        self._store_children: dict[str, Callable[[float], None]] = {}

    def observe_store_call(self, op: str, seconds: float) -> None:
        """Observe one store call of operation ``op`` that took ``seconds``."""
        observe = self._store_children.get(op)
        if observe is None:
            observe = self._store_children[op] = self.store_call.labels(op).observe
        observe(seconds)


async def watch_loop_lag(
    histogram: Histogram,
    interval_s: float,
    clock: Callable[[], float] = time.monotonic,
    tasks: Gauge | None = None,
) -> None:
    """Sleep ``interval_s`` s at a time until cancelled, observing each sleep's overrun in ``histogram``,
    and setting ``tasks`` (when given) to the number of the loop's tasks not done (``asyncio.all_tasks``)."""
    observe = histogram.observe
    while True:
        before = clock()
        await asyncio.sleep(interval_s)
        observe(max(0.0, clock() - before - interval_s))
        if tasks is not None:
            tasks.set(len(asyncio.all_tasks()))


__all__ = [
    "LOOP_LAG_BUCKETS_S",
    "STORE_CALL_BUCKETS_S",
    "RuntimeMetrics",
    "watch_loop_lag",
]

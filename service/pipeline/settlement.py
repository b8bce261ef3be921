"""Settling requests so that a served request is always charged, even when Redis is briefly short.

A request's settle (:meth:`tenancy.quota.QuotaLimiter.settle`: reconcile the reservation with the real
usage and add the usage counters, one atomic Lua call) is tried once: a failed request's before its error
is sent, a served answer's in a task of its own started as the answer goes out (:meth:`Settler.start`), so
the answer never waits for Redis. When Redis is
unavailable then (its connection pool stayed exhausted under a burst, a reply timed out), the settle is
handed to a small set of background retries owned by the app: more tries, for ``redis.settle_give_up_s``
(60 s) from the first failure and at most ``redis.settle_retries``, each after a "full jitter" exponential
backoff (AWS Architecture Blog, "Exponential Backoff and Jitter", 2015) between 0 and
``min(settle_backoff_max_s, settle_backoff_s * 2**k)``. Bounded by time, not by a count alone: against a
Redis that refuses connections at once (restarting), 8 tries with full jitter were spent in about 3 s, and
the soak's 3-second restart lost a served request's charge (``tests/loadgen/test_soak.py``). The answer is
never held back for them. At shutdown the retries still pending get ``redis.settle_drain_s`` to land,
without backoff.

A settle whose first try timed out may still have been applied by Redis; every settle therefore carries
its request id and writes a marker (``settled:<request id>``, :meth:`tenancy.layout.KeyLayout.settled`)
in the same atomic call, so a retry of one that did land changes nothing. The marker outlives every retry
(:attr:`service.config.settings.RedisSettings.settle_marker_ttl_s`).

The settles of requests admitted under a quota lease (:attr:`tenancy.quota.Reservation.linger`: their
tenant's bucket had a lease's headroom) are summed per tenant for ``redis.settle_linger_s``
(:meth:`Settler.submit`) and settled as one call per tenant, under a marker of its own: the amounts given
back to (or charged to) each bucket and each usage counter add up, so one call does what the requests'
own calls did, except where a bucket's level meets its cap in between (the sum is capped once). It takes
a task, a script call and its reply per request off a busy tenant's path (the benchmark's c64: Redis
commands per request 10.2 -> 0.6, Redis CPU per request 0.026 -> 0.004 ms).

What finally cannot be settled (retries spent, a script error, too many pending, shutdown) is counted in
``radixgate_settle_failures_total`` and logged as one ``settle_lost`` line with the usage it carried.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import secrets
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import structlog

from service.config.settings import RedisSettings
from service.observability.metrics import GatewayMetrics
from service.pipeline.settle_journal import SettleJournal
from service.runtime.task_stop import stop_tasks
from tenancy.billing import UsageRow
from tenancy.errors import StoreUnavailable
from tenancy.quota import QuotaLimiter, Reservation

log = structlog.get_logger("radixgate.settle")

SettleResult = Literal["settled", "deferred", "lost"]
"""What :meth:`Settler.settle` did: landed now, handed to the background retries, or given up."""


@dataclass(frozen=True, slots=True)
class Settlement:
    """One request's settle.

    Attributes:
        request_id: the request's id (its settle lands at most once under it).
        reservation: what admission took.
        used_tokens: prompt + completion tokens to charge; None gives the whole reservation back.
        usage: usage counters to add (fields of :class:`tenancy.models.Usage`, and ``cost`` in picodollars).
        covers: how many requests it settles.
        summed: a tenant's summed settles (:meth:`Settler.submit`): ``request_id`` is the sum's own, and
            ``reservation`` holds the net units given back (negative: charged), ``used_tokens`` None.
        rows: its usage by UTC day, API key and model (:class:`tenancy.billing.UsageRow`; none when
            nothing was charged).
    """

    request_id: str
    reservation: Reservation
    used_tokens: int | None
    usage: Mapping[str, int]
    covers: int = 1
    summed: bool = False
    rows: tuple[UsageRow, ...] = ()


@dataclass(slots=True)
class _Sum:
    """The settles of one tenant (one epoch, one set of quotas) collected during one linger: the units to
    give back to its buckets (negative: charged) and the usage to add."""

    reservation: Reservation
    requests: int = 0
    tokens: int = 0
    usage: dict[str, int] = dataclasses.field(default_factory=dict)
    count: int = 0
    rows: dict[tuple[str, str, str], list[int]] = dataclasses.field(default_factory=dict)

    def settlement(self, linger: bool = False) -> Settlement:
        """One settle of it all: the sums as a reservation given back whole (``used_tokens`` None);
        ``linger``: it waits in the script batcher for a call to share its write with."""
        whole = dataclasses.replace(
            self.reservation, requests=self.requests, tokens=self.tokens, linger=linger
        )
        rows = tuple(UsageRow(*at, *counts) for at, counts in self.rows.items())
        sid = f"sum-{secrets.token_hex(12)}"
        return Settlement(sid, whole, None, self.usage, self.count, summed=True, rows=rows)


class Settler:
    """Settles requests: once inline, then in background retries when Redis is unavailable.

    Args:
        quota: the token buckets (and usage counters) in Redis.
        settings: the Redis settings (``settle_*``).
        metrics: the app's metrics.

    Build one per app in the lifespan, start :meth:`replay` and call :meth:`drain` before closing Redis.
    ``journal``: where :meth:`drain` keeps what Redis did not take (default: ``redis.settle_journal_dir``'s,
    when set).
    """

    def __init__(
        self,
        quota: QuotaLimiter,
        settings: RedisSettings,
        metrics: GatewayMetrics,
        journal: SettleJournal | None = None,
    ) -> None:
        self._quota = quota
        self._cfg = settings
        self._metrics = metrics
        self._once_s = settings.settle_marker_ttl_s
        if journal is None and settings.settle_journal_dir is not None:
            journal = SettleJournal(settings.settle_journal_dir, settings.settle_queue_max)
        self._journal = journal
        self._journaled: set[str] = set()  # request ids written to the journal (not lost)
        self._items: dict[asyncio.Task[None], Settlement] = {}  # each retry's settle
        self._tasks: set[asyncio.Task[None]] = set()
        self._draining = asyncio.Event()
        self._running: dict[str, set[asyncio.Task[Any]]] = {}
        # tenant -> (epoch, *quotas' values) -> sum: a tenant's sums found without scanning the others'
        self._open: dict[str, dict[tuple[object, ...], _Sum]] = {}
        self._flush_at: asyncio.TimerHandle | None = None

    @property
    def pending(self) -> int:
        """Settles being retried now."""
        return len(self._tasks)

    async def _try(self, item: Settlement) -> None:
        await self._quota.settle(
            item.reservation,
            item.used_tokens,
            item.usage,
            once=(item.request_id, self._once_s),
            rows=item.rows,
        )

    async def settle(self, item: Settlement) -> SettleResult:
        """Settle ``item`` now; if Redis is unavailable, hand it to the background retries. Never raises
        (but ``CancelledError``)."""
        try:
            await self._try(item)
        except StoreUnavailable as exc:
            return self._defer(item, str(exc))
        except Exception:  # a script or programming error: retrying cannot help
            log.exception("settle_error", request_id=item.request_id, tenant=item.reservation.tenant_id)
            self._lost(item, "error", attempts=1)
            return "lost"
        return "settled"

    def start(self, tenant_id: str, settle: Coroutine[Any, Any, object]) -> asyncio.Future[object]:
        """Run ``settle`` (of ``tenant_id``'s served answer) in a task of its own, off the answer's
        latency path; until it is done :meth:`settled` waits for it, and :meth:`drain` at shutdown.
        Returns the task."""
        task = asyncio.ensure_future(settle)
        running = self._running.setdefault(tenant_id, set())
        running.add(task)

        def done(_: asyncio.Task[object]) -> None:
            running.discard(task)
            if not running and self._running.get(tenant_id) is running:
                del self._running[tenant_id]

        task.add_done_callback(done)
        return task

    def submit(self, item: Settlement) -> None:
        """Settle ``item`` with the other settles of its tenant submitted within ``settle_linger_s``: one
        Redis call for them all, in a task (:meth:`start`), so nothing waits here. Never raises.

        For the settles of reservations admitted under a lease (the linger is why they may land a few ms
        later); once :meth:`drain` began, each is started on its own at once.
        """
        r = item.reservation
        if self._draining.is_set():
            self.start(r.tenant_id, self.settle(item))
            return
        q = r.quotas  # by value: each tenant read (auth cache off, or each refresh) has its own object
        key = (r.epoch, q.requests_per_min, q.tokens_per_min, q.request_burst, q.token_burst)
        sums = self._open.get(r.tenant_id)
        if sums is None:
            sums = self._open[r.tenant_id] = {}
        total = sums.get(key)
        if total is None:
            total = sums[key] = _Sum(r)
            if self._flush_at is None:
                self._flush_at = asyncio.get_running_loop().call_later(self._cfg.settle_linger_s, self._flush)
        if item.used_tokens is None:
            total.requests += r.requests
            total.tokens += r.tokens
        else:
            total.tokens += r.tokens - item.used_tokens
        usage = total.usage
        for name, amount in item.usage.items():
            if amount:
                usage[name] = usage.get(name, 0) + amount
        rows = total.rows
        for row in item.rows:
            held = rows.get(row[:3])  # (day, key id, model)
            if held is None:
                rows[row[:3]] = list(row[3:])
            else:
                for i, count in enumerate(row[3:]):
                    held[i] += count
        total.count += 1

    def _flush(self) -> None:
        """Start the settle of every sum collected so far (one task per tenant's sum)."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        tenants, self._open = self._open, {}
        for tenant_id, sums in tenants.items():
            for total in sums.values():
                self.start(tenant_id, self.settle(total.settlement()))

    async def ahead_of_reservation(self, tenant_id: str) -> None:
        """Send the sums of ``tenant_id`` still collecting ahead of a reservation of it about to go to
        Redis (``before_remote`` of :class:`tenancy.quota_lease.LeasedQuota`), in the same write: each settle
        starts a batch in the script batcher (lingering) which the reservation, sent once this returns,
        joins after it. A summed refund then lands before the reservation that may need it, as each
        request's own settle did (a reservation refused for want of it: a 429 the quota did not call for).
        Waits one loop round at most; nothing when none collects."""
        sums = self._open.pop(tenant_id, None)
        if not sums:
            return
        for total in sums.values():
            self.start(tenant_id, self.settle(total.settlement(linger=True)))
        await asyncio.sleep(0)  # the settles run up to the batcher, where the reservation joins them

    async def settled(self, tenant_id: str) -> None:
        """Wait until the settles of ``tenant_id`` started so far (:meth:`start`) are done, at most one
        Redis call's bound (``pool_timeout_s + socket_timeout_s``): a client that reads its usage after
        an answer from this replica sees that answer counted (read-your-writes on one replica). Sums
        still collecting (:meth:`submit`) are sent at once."""
        if tenant_id in self._open:
            self._flush()
        running = self._running.get(tenant_id)
        if running:
            await asyncio.wait(set(running), timeout=self._cfg.pool_timeout_s + self._cfg.socket_timeout_s)

    def _defer(self, item: Settlement, cause: str) -> SettleResult:
        if self._draining.is_set() and self._keep([item]):
            return "deferred"  # to the next gateway process, through the journal
        if self._cfg.settle_retries == 0 or self._draining.is_set():
            self._lost(item, "unavailable", attempts=1)
            return "lost"
        if len(self._tasks) >= self._cfg.settle_queue_max:
            self._lost(item, "queue_full", attempts=1)
            return "lost"
        self._metrics.settle_deferred.inc()
        log.warning(
            "settle_deferred", request_id=item.request_id, tenant=item.reservation.tenant_id, cause=cause
        )
        task = asyncio.get_running_loop().create_task(self._retry(item), name=f"settle-{item.request_id}")
        self._tasks.add(task)
        self._items[task] = item
        self._metrics.settle_pending.set(len(self._tasks))
        task.add_done_callback(self._done)
        return "deferred"

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._items.pop(task, None)
        self._metrics.settle_pending.set(len(self._tasks))

    async def _pause(self, retry: int) -> None:
        """Full-jitter backoff before retry ``retry`` (0-based); none once draining."""
        cap = min(self._cfg.settle_backoff_max_s, self._cfg.settle_backoff_s * (1 << min(retry, 30)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._draining.wait(), random.uniform(0, cap))

    async def _retry(self, item: Settlement) -> None:
        attempts = 1
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self._cfg.settle_give_up_s
        try:
            for retry in range(self._cfg.settle_retries):
                if retry and loop.time() >= give_up_at:
                    break
                await self._pause(retry)
                attempts += 1
                try:
                    await self._try(item)
                except StoreUnavailable:
                    continue
                except Exception:
                    log.exception(
                        "settle_error", request_id=item.request_id, tenant=item.reservation.tenant_id
                    )
                    self._lost(item, "error", attempts)
                    return
                log.info(
                    "settle_retried",
                    request_id=item.request_id,
                    tenant=item.reservation.tenant_id,
                    attempts=attempts,
                )
                return
            self._lost(item, "retries_spent", attempts)
        except asyncio.CancelledError:
            if item.request_id not in self._journaled:
                self._lost(item, "shutdown", attempts)
            raise

    def _lost(self, item: Settlement, reason: str, attempts: int) -> None:
        self._metrics.settle_failures.inc(item.covers)  # requests: a lost sum loses each it carried
        r = item.reservation
        # one request: what it reserved and used; a sum: the net units it was giving back to the buckets
        # (negative: charging), its requests' reservations and uses summed away
        amounts = (
            {"given_back_tokens": r.tokens, "given_back_requests": r.requests}
            if item.summed
            else {"used_tokens": item.used_tokens, "reserved_tokens": r.tokens}
        )
        log.error(
            "settle_lost",
            request_id=item.request_id,
            tenant=r.tenant_id,
            reason=reason,
            attempts=attempts,
            requests_covered=item.covers,
            **amounts,
            **{f"usage_{k}": v for k, v in item.usage.items()},
        )

    async def drain(self) -> None:
        """Stop backing off and give the settles under way (:meth:`start`) and the pending retries
        ``settle_drain_s`` to land; the retries still pending then are cancelled and counted lost. Later
        failed settles are counted lost at once."""
        self._draining.set()
        self._flush()
        under_way = set(self._tasks).union(*self._running.values())
        if not under_way:
            return
        _, pending = await asyncio.wait(under_way, timeout=self._cfg.settle_drain_s)
        self._keep([self._items[t] for t in pending if t in self._items])
        await stop_tasks(pending)  # they call Redis, which can swallow one cancel

    def _keep(self, items: list[Settlement]) -> bool:
        """Write ``items`` to the journal for the next gateway process (:meth:`replay`); False when there
        is no journal or it could not be written (they are then counted lost as before)."""
        if self._journal is None or not items:
            return False
        try:  # the slot is this process's; the next one must not release it again
            written = self._journal.write([replace_slot(item) for item in items])
        except OSError as exc:
            log.error("settle_journal_failed", error=str(exc), settles=len(items))
            return False
        for item in items[:written]:
            self._journaled.add(item.request_id)
            log.warning("settle_journaled", request_id=item.request_id, tenant=item.reservation.tenant_id)
        for item in items[written:]:
            self._lost(item, "journal_full", attempts=1)
        self._metrics.settle_journaled.inc(sum(item.covers for item in items[:written]))
        return True

    async def replay(self) -> None:
        """Settle what stopped gateway processes left in the journal (each at most once, under its
        request's marker; one Redis can't take now is retried as any deferred settle); logged as
        ``settle_journal_replayed`` with the count."""
        if self._journal is None:
            return
        items = await asyncio.to_thread(self._journal.claim)
        for item in items:
            await self.settle(item)
        if items:
            log.warning("settle_journal_replayed", settles=len(items))


def replace_slot(item: Settlement) -> Settlement:
    """``item`` without its concurrency slot."""
    if item.reservation.slot is None:
        return item
    return dataclasses.replace(item, reservation=dataclasses.replace(item.reservation, slot=None))


__all__ = ["SettleResult", "Settlement", "Settler", "replace_slot"]

"""The usage of requests served while Redis could not be reached (``redis.on_outage = open``), kept until
Redis is back.

A request admitted from a replica's own buckets (:mod:`service.pipeline.outage`) took nothing in Redis.
Its settle (:func:`service.pipeline.request_record.settlement_of`) is summed here per tenant and epoch:
its usage counters (requests, prompt, cached and completion tokens, errors, cost) and its usage rows by
day, API key and model. When Redis answers again, :meth:`OutageLedger.take` hands each sum over as one
settle of its own (:class:`service.pipeline.settlement.Settlement`, under a marker of its own id) to the
settler, which lands it, retries it while Redis is short (``redis.settle_give_up_s``), or journals it at
shutdown (``redis.settle_journal_dir``): the usage record is never dropped while the outage lasts,
however long, and lands at most once.

What the sums charge: the usage (``GET /v1/usage``, cost, the usage by day) and nothing else. They carry
no bucket (the requests were rate-limited by the local buckets while Redis was away; charging the shared
buckets afterwards would take the same requests from the tenant a second time, as a debt after the
outage) and no budget (a request that takes from a budget is refused while Redis is out of reach).

Memory: one sum per tenant and epoch, each with one row per day, API key and model it served.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from service.pipeline.settlement import Settlement
from tenancy.billing import UsageRow
from tenancy.models import Quotas
from tenancy.quota import Reservation

NO_LIMITS = Quotas()
"""The quotas of a ledger's settle: no bucket (the settle touches the usage alone)."""


@dataclass(slots=True)
class _TenantSum:
    """What one tenant (one epoch) was served while Redis was away."""

    tenant_id: str
    epoch: str | None
    usage: dict[str, int] = field(default_factory=dict)
    rows: dict[tuple[str, str, str], list[int]] = field(default_factory=dict)
    count: int = 0

    def settlement(self) -> Settlement:
        """One settle of it all, under a fresh id (its ``settled:`` marker): no bucket, no budget."""
        reservation = Reservation(self.tenant_id, NO_LIMITS, 0, 0, self.epoch)
        rows = tuple(UsageRow(*at, *counts) for at, counts in self.rows.items())
        sid = f"outage-{secrets.token_hex(12)}"
        return Settlement(sid, reservation, None, dict(self.usage), self.count, summed=True, rows=rows)


class OutageLedger:
    """Per tenant and epoch, the summed usage of the requests a replica served from its own buckets."""

    def __init__(self) -> None:
        self._sums: dict[tuple[str, str | None], _TenantSum] = {}
        self.requests = 0
        """Requests summed and not yet handed over."""

    def __len__(self) -> int:
        return len(self._sums)

    def add(self, item: Settlement) -> None:
        """Add one request's settle (its usage and rows; its reservation's units are ignored: nothing was
        taken in Redis)."""
        r = item.reservation
        key = (r.tenant_id, r.epoch)
        total = self._sums.get(key)
        if total is None:
            total = self._sums[key] = _TenantSum(r.tenant_id, r.epoch)
        for name, amount in item.usage.items():
            if amount:
                total.usage[name] = total.usage.get(name, 0) + amount
        for row in item.rows:
            held = total.rows.get(row[:3])  # (day, key id, model)
            if held is None:
                total.rows[row[:3]] = list(row[3:])
            else:
                for i, count in enumerate(row[3:]):
                    held[i] += count
        total.count += item.covers
        self.requests += item.covers

    def take(self) -> list[Settlement]:
        """Every sum as one settle (:meth:`_TenantSum.settlement`), and empty the ledger; sums with nothing
        to record are left out."""
        sums, self._sums = self._sums, {}
        self.requests = 0
        return [s.settlement() for s in sums.values() if any(s.usage.values()) or s.rows]


__all__ = ["NO_LIMITS", "OutageLedger"]

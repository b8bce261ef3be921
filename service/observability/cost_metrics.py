"""Cost and budget series: what tenants' requests cost, and the budgets they reach.

- ``radixgate_cost_usd_total{tenant,model}``: the cost of the requests served, USD (each request's exact
  cost in picodollars, added as dollars; the exact sums are in usage, ``GET /admin/tenants/{id}/usage``);
- ``radixgate_budget_soft_limit_reached_total{tenant,scope}``: budgets whose spend reached their soft limit,
  one per budget and period (scope ``tenant`` or ``key``), across every replica.

A budget's hard-limit refusals count in
``radixgate_quota_rejections_total{bucket="tenant_budget"|"key_budget", reason="insufficient_quota"}``.
Tenant labels are bounded as everywhere (:class:`.metrics.TenantLabels`), models by the served list.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class CostMetrics:
    """The cost and budget counters, in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.cost = Counter(
            "radixgate_cost_usd_total",
            "Cost of the requests served, USD, at their model's price (docs/tenancy.md).",
            ["tenant", "model"],
            registry=registry,
        )
        self.soft_limit_reached = Counter(
            "radixgate_budget_soft_limit_reached_total",
            "Budgets whose spend reached their soft limit, once per budget and period; scope tenant or key.",
            ["tenant", "scope"],
            registry=registry,
        )

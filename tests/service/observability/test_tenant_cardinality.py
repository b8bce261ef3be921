"""Label cardinality at 10,000 tenants (issue 28): every tenant-labelled series the gateway writes (a finished
request's counters and histograms, a quota rejection, a scheduler outcome) stays within
``observability.max_tenant_labels`` tenant values plus ``other``, so ``/metrics`` has as many series at 10,000
tenants as at the cap plus one.

The requests go through the code the dispatcher runs as each request ends (``record_request``, the label
function of ``GatewayMetrics``) and the scrape is the one ``/metrics`` serves."""

from __future__ import annotations

import time
from collections import Counter

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from service.observability.metrics import GatewayMetrics
from service.pipeline.prepare import PreparedRequest
from service.pipeline.prompting import RenderedPrompt
from service.pipeline.request_record import record_request
from service.pipeline.upstream import Outcome
from tenancy.models import Quotas, Tenant
from tenancy.quota import Reservation

CAP = 100  # the setting's default (service/config/settings.py ObservabilitySettings.max_tenant_labels)
MODELS = ("model-a", "model-b")


def serve(metrics: GatewayMetrics, tenants: int) -> None:
    """``tenants`` tenants each end one request per model: served, refused by quota, shed."""
    quotas = Quotas(requests_per_min=60, tokens_per_min=10_000)
    for i in range(tenants):
        tenant = Tenant(id=f"tenant-{i:05d}", name=f"T{i}", priority_class="standard", quotas=quotas)
        for model in MODELS:
            prepared = PreparedRequest(
                rid=f"r{i}-{model}",
                tenant=tenant,
                model=model,
                chat=True,
                prompt=RenderedPrompt("hi", 5),
                max_tokens=8,
                priority_class="standard",
                body={},
                stream=False,
                include_usage=False,
                arrival=time.perf_counter(),
                model_id=model,
            )
            reservation = Reservation(tenant.id, quotas, 1, 13)
            served = Outcome(status=200, prompt_tokens=5, completion_tokens=8, ttft_s=0.05, finished=True)
            record_request(metrics, prepared, reservation, served, True, 0.2, 0.5)
            record_request(
                metrics, prepared, reservation, Outcome(status=503, shed_reason="beyond_goal"), False, 0.001
            )
        label = metrics.tenant(tenant.id)
        metrics.quota_rejections.labels(label, "requests", "rate_limited").inc()
        metrics.child(metrics.scheduler_outcomes, "standard", label, "cancelled").inc()


def series(metrics: GatewayMetrics) -> tuple[int, set[str]]:
    """(series on the ``/metrics`` page, the tenant label values on it)."""
    count, tenants = 0, set()
    for family in text_string_to_metric_families(metrics.scrape([]).decode()):
        for sample in family.samples:
            count += 1
            if "tenant" in sample.labels:
                tenants.add(sample.labels["tenant"])
    return count, tenants


def test_series_stop_growing_at_the_tenant_label_cap_through_10000_tenants() -> None:
    at_cap = GatewayMetrics(CollectorRegistry(), max_tenant_labels=CAP)
    many = GatewayMetrics(CollectorRegistry(), max_tenant_labels=CAP)
    with structlog.testing.capture_logs() as lines:  # the request log lines, kept off the test's output
        serve(at_cap, CAP + 1)
        serve(many, 10_000)
    assert len(lines) == 4 * (CAP + 1 + 10_000)

    count_cap, tenants_cap = series(at_cap)
    count_many, tenants_many = series(many)
    assert tenants_many == tenants_cap  # the same first CAP tenants, and "other"
    assert len(tenants_many) == CAP + 1 and "other" in tenants_many
    assert count_many == count_cap
    # what "other" holds is everyone past the cap: nothing is lost, only folded
    per_tenant = Counter(
        s.labels["tenant"]
        for f in text_string_to_metric_families(many.scrape([]).decode())
        if f.name == "radixgate_requests"
        for s in f.samples
        if s.name == "radixgate_requests_total" and s.labels.get("status") == "200"
    )
    assert len(per_tenant) == CAP + 1 and set(per_tenant.values()) == {len(MODELS)}  # a series per model
    other = many.registry.get_sample_value(
        "radixgate_requests_total", {"tenant": "other", "model": "model-a", "status": "200"}
    )
    assert other == 10_000 - CAP

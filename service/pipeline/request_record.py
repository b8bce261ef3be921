"""What a finished request is charged (:func:`settlement_of`), and its metrics and ``request`` log line
(:func:`record_request`): the bookkeeping :class:`service.pipeline.dispatch.Dispatcher` does as each request
ends."""

from __future__ import annotations

import functools
import time

import structlog

from policies.billing_periods import DAY_S, utc_day
from policies.pricing import pico_to_usd, request_cost
from service.observability.class_metrics import ClassRequest
from service.observability.metrics import GatewayMetrics
from service.pipeline.prepare import PreparedRequest
from service.pipeline.request_trace import end_trace
from service.pipeline.settlement import Settlement
from service.pipeline.upstream import Outcome
from tenancy.billing import COST_FIELD, NO_KEY, UsageRow
from tenancy.quota import Reservation

log = structlog.get_logger("radixgate.request")


def settlement_of(
    prepared: PreparedRequest, reservation: Reservation, outcome: Outcome, now_s: float | None = None
) -> tuple[Settlement, bool]:
    """What settles a finished request, and whether it is charged.

    Charged: a served answer (finished, or streamed in part), and one whose client left (499) or whose key
    or tenant was revoked while a worker had it: the worker's counts, or the reservation's prompt part when
    it gave none. Refunded in full: everything else (only its error is counted). A charged request's cost
    (picodollars, ``usage["cost"]``) is its worker-reported tokens at the price it was admitted under
    (:func:`policies.pricing.request_cost`: cached prompt tokens at the cached-input price), and its usage
    goes to the row of today (UTC, unix time ``now_s``; None: now), its API key and its model.
    """
    abandoned = (outcome.status == 499 or outcome.revoked) and outcome.dispatched
    charged = outcome.finished or outcome.streamed_any or abandoned
    errors = int(outcome.status not in (200, 499))
    if not charged:
        return Settlement(prepared.rid, reservation, None, {"errors": errors}), False  # refund it all
    if not outcome.prompt_tokens:  # the worker's count is unknown: the reservation's prompt part
        outcome.prompt_tokens = prepared.prompt.num_tokens
    prompt, cached, completion = outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens
    cost = request_cost(reservation.price, prompt, cached, completion)
    usage = {
        "requests": 1,
        "errors": errors,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        COST_FIELD: cost,
    }
    day = _day_text(int((time.time() if now_s is None else now_s) // DAY_S))
    key_id = prepared.key.key_id if prepared.key is not None else NO_KEY
    row = UsageRow(day, key_id, prepared.model_id or prepared.model, 1, prompt, cached, completion, cost)
    used = prompt + completion
    return Settlement(prepared.rid, reservation, used, usage, rows=(row,)), True


def record_request(
    metrics: GatewayMetrics,
    prepared: PreparedRequest,
    reservation: Reservation,
    outcome: Outcome,
    charged: bool,
    latency: float,
    goal_s: float | None = None,
    cost: int = 0,
) -> None:
    """Count a finished request in ``metrics`` (per tenant, and per class against ``goal_s``, its class's
    TTFT goal for its model, s) and log its ``request`` line (``latency`` in s; ``cost``: what it was
    charged, picodollars, logged as ``cost_usd`` and counted in ``radixgate_cost_usd_total``)."""
    slot = outcome.slot
    model = prepared.model_id or prepared.model  # the canonical id: aliases fold into it
    timing = prepared.timing
    timing.finish()
    # traced: the span ends here, and its trace id is the latency observations' exemplar
    exemplar = None if timing.trace is None else end_trace(prepared, outcome, latency)
    metrics.classes.record(
        ClassRequest(
            prepared.priority_class,
            model,
            outcome.status,
            outcome.shed_reason is not None or outcome.expired_after_s is not None,
            outcome.ttft_s,
            latency,
            outcome.completion_tokens,
            goal_s,
            timing.phases.get("decode") if outcome.resumes == 0 else None,
            timing.gap_tally(),
        )
    )
    metrics.phases.record(timing, latency)
    tenant_label = metrics.tenant(prepared.tenant.id)
    m = metrics.request_series(tenant_label, model, outcome.status)
    m.requests.inc()
    m.e2e.observe(latency, exemplar)
    if outcome.ttft_s is not None:
        m.ttft.observe(outcome.ttft_s, exemplar)
    if charged:
        m.prompt_tokens.inc(outcome.prompt_tokens)
        m.completion_tokens.inc(outcome.completion_tokens)
        m.cached_tokens.inc(outcome.cached_tokens)
    if cost:
        metrics.child(metrics.cost.cost, tenant_label, model).inc(pico_to_usd(cost))
    log.info(
        "request",
        request_id=prepared.rid,
        client_request_id=timing.client_request_id,
        tenant=prepared.tenant.id,
        model=model,
        priority_class=prepared.priority_class,
        stream=prepared.stream,
        worker=outcome.worker,
        attempts=outcome.attempts,
        resumes=outcome.resumes,
        moves=outcome.moves,
        resume_mode=outcome.resume_mode,
        status=outcome.status,
        error=outcome.error_code,
        charged=charged,
        prompt_tokens=outcome.prompt_tokens or prepared.prompt.num_tokens,  # the size, charged or not
        completion_tokens=outcome.completion_tokens,
        cached_tokens=outcome.cached_tokens,
        reserved_tokens=reservation.tokens,
        cost_usd=pico_to_usd(cost),
        ttft_ms=None if outcome.ttft_s is None else round(outcome.ttft_s * 1000, 1),
        latency_ms=round(latency * 1000, 1),
        phases_ms=timing.phases_ms(),
        tpot_ms=_ms3(timing.tpot_s(outcome.completion_tokens) if outcome.resumes == 0 else None),
        itl_ms=_ms3(timing.itl_mean_s()),
        retractions=timing.retractions,
        overhead_ms=round(timing.overhead_s(latency) * 1000, 3),
        queued_ms=_ms(outcome.expired_after_s if slot is None else slot.queued_s),
        predicted_ttft_ms=_ms(outcome.shed_predicted_ttft_s if slot is None else slot.predicted_ttft_s),
        shed_reason=outcome.shed_reason,
    )


@functools.lru_cache(maxsize=4)
def _day_text(day_number: int) -> str:
    """``YYYY-MM-DD`` of the UTC day ``day_number`` days after 1970-01-01 (memoized: one a day)."""
    return utc_day(day_number * DAY_S).isoformat()


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def _ms3(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)

"""Per-class service-level metrics: TTFT, TPOT and end-to-end latency per priority class and model, each
request's outcome, and goodput (requests served within their class's TTFT goal).

These are the series SLOs are written on (``deploy/prometheus`` burn-rate rules, issue 28): the per-tenant
series of :mod:`service.observability.metrics` say who; these say whether each class of service kept its
goal. Labels: ``class`` (the configured priority classes) and ``model`` (the registry's canonical ids), both
bounded by the operator's settings, never by what a client sends.

Outcomes (:func:`outcome_of`): ``served`` (an answer, whole or a stream that began), ``shed`` (admission
control: shed at arrival, evicted or expired in the gateway's queue, 503), ``rejected`` (the request's own
fault or its quota: 4xx), ``cancelled`` (the client left, 499), ``error`` (the gateway or a worker failed:
5xx other than shedding).

TPOT: mean time per output token after the first, ``(e2e - ttft) / (completion_tokens - 1)``, for answers
with at least two tokens and a known TTFT (the definition of vLLM's and SGLang's benchmarks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Histogram

ClassOutcome = Literal["served", "shed", "rejected", "cancelled", "error"]

SLO_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
"""Per-class latency buckets, s, 1 ms to 120 s: TTFT goals (0.5 / 2 / 30 s by default) and per-token times
(a few ms on a GPU, tens to hundreds on a CPU) both fall between two close bounds, so
``histogram_quantile`` over them stays within about 30% of the true value."""


def outcome_of(status: int, shed: bool) -> ClassOutcome:
    """A finished request's outcome from its HTTP status and whether admission control shed it."""
    if status == 200:
        return "served"
    if shed:
        return "shed"
    if status == 499:
        return "cancelled"
    if 400 <= status < 500:
        return "rejected"
    return "error"


def tpot_s(e2e_s: float, ttft_s: float | None, completion_tokens: int) -> float | None:
    """Mean time per output token after the first, s; None without a TTFT or with fewer than 2 tokens."""
    if ttft_s is None or completion_tokens < 2:
        return None
    return max(0.0, e2e_s - ttft_s) / (completion_tokens - 1)


@dataclass(frozen=True, slots=True)
class ClassRequest:
    """What the class metrics need of one finished request.

    Attributes:
        band: its priority class. model: its model's canonical id.
        status: its HTTP status. shed: admission control shed it (or it expired in the queue).
        ttft_s: arrival to its first token, s (None when unknown). e2e_s: arrival to its end, s.
        completion_tokens: tokens generated. goal_s: its class's TTFT goal for its model, s.
    """

    band: str
    model: str
    status: int
    shed: bool
    ttft_s: float | None
    e2e_s: float
    completion_tokens: int
    goal_s: float | None


class ClassMetrics:
    """The per-class families, registered in ``registry``.

    ``radixgate_class_requests_total{class,model,outcome}``, ``radixgate_class_goodput_total{class,model}``
    (served with TTFT <= the goal; a non-streamed answer without a TTFT counts when its end-to-end time
    is within the goal, which bounds its TTFT), ``radixgate_class_ttft_seconds``,
    ``radixgate_class_tpot_seconds`` and ``radixgate_class_e2e_seconds`` (``{class,model}``, served
    requests, :data:`SLO_BUCKETS_S`).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["class", "model"]
        self.requests = Counter(
            "radixgate_class_requests_total",
            "Finished requests per priority class, model and outcome (served, shed, rejected, cancelled, "
            "error).",
            [*labels, "outcome"],
            registry=registry,
        )
        self.goodput = Counter(
            "radixgate_class_goodput_total",
            "Requests served within their class's TTFT goal.",
            labels,
            registry=registry,
        )
        self.ttft = Histogram(
            "radixgate_class_ttft_seconds",
            "Time to first token of served requests per class, s.",
            labels,
            buckets=SLO_BUCKETS_S,
            registry=registry,
        )
        self.tpot = Histogram(
            "radixgate_class_tpot_seconds",
            "Mean time per output token after the first, of served requests per class, s.",
            labels,
            buckets=SLO_BUCKETS_S,
            registry=registry,
        )
        self.e2e = Histogram(
            "radixgate_class_e2e_seconds",
            "Arrival to the last byte of served requests per class, s.",
            labels,
            buckets=SLO_BUCKETS_S,
            registry=registry,
        )
        self._served: dict[tuple[str, str], tuple[Counter, Histogram, Histogram, Histogram]] = {}
        self._outcomes: dict[tuple[str, str, str], Counter] = {}

    def record(self, req: ClassRequest) -> None:
        """Count one finished request."""
        outcome = outcome_of(req.status, req.shed)
        key = (req.band, req.model, outcome)
        counter = self._outcomes.get(key)
        if counter is None:
            counter = self._outcomes[key] = self.requests.labels(*key)
        counter.inc()
        if outcome != "served":
            return
        pair = (req.band, req.model)
        series = self._served.get(pair)
        if series is None:
            series = self._served[pair] = (
                self.goodput.labels(*pair),
                self.ttft.labels(*pair),
                self.tpot.labels(*pair),
                self.e2e.labels(*pair),
            )
        goodput, ttft, tpot, e2e = series
        e2e.observe(req.e2e_s)
        if req.ttft_s is not None:
            ttft.observe(req.ttft_s)
        per_token = tpot_s(req.e2e_s, req.ttft_s, req.completion_tokens)
        if per_token is not None:
            tpot.observe(per_token)
        first = req.ttft_s if req.ttft_s is not None else req.e2e_s
        if req.goal_s is None or first <= req.goal_s:
            goodput.inc()

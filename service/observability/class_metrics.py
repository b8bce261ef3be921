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

from service.observability.buckets import SLO_BUCKETS_S, observe_tally

ClassOutcome = Literal["served", "shed", "rejected", "cancelled", "error"]


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
        decode_s: its first token to its last, s, when known (then TPOT is ``decode_s / (tokens - 1)``;
            else it is estimated as ``(e2e - ttft) / (tokens - 1)``).
        itl: a stream's inter-token gaps as :data:`SLO_BUCKETS_S` bucket counts (``+Inf`` last) and their
            sum, s (:meth:`service.observability.breakdown.RequestTiming.gap_tally`); None otherwise.
    """

    band: str
    model: str
    status: int
    shed: bool
    ttft_s: float | None
    e2e_s: float
    completion_tokens: int
    goal_s: float | None
    decode_s: float | None = None
    itl: tuple[list[int], float] | None = None


class ClassMetrics:
    """The per-class families, registered in ``registry``.

    ``radixgate_class_requests_total{class,model,outcome}``, ``radixgate_class_goodput_total{class,model}``
    (served with TTFT <= the goal; a non-streamed answer without a TTFT counts when its end-to-end time
    is within the goal, which bounds its TTFT), ``radixgate_class_ttft_seconds``,
    ``radixgate_class_tpot_seconds``, ``radixgate_class_e2e_seconds`` and ``radixgate_class_itl_seconds``
    (``{class,model}``, served requests, :data:`SLO_BUCKETS_S`; ITL: every gap of a stream).
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
        self.itl = Histogram(
            "radixgate_class_itl_seconds",
            "Inter-token latency of streamed requests per class (each gap between two chunks), s.",
            labels,
            buckets=SLO_BUCKETS_S,
            registry=registry,
        )
        self._served: dict[tuple[str, str], tuple[Counter, Histogram, Histogram, Histogram, Histogram]] = {}
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
                self.itl.labels(*pair),
            )
        goodput, ttft, tpot, e2e, itl = series
        e2e.observe(req.e2e_s)
        if req.ttft_s is not None:
            ttft.observe(req.ttft_s)
        if req.decode_s is not None and req.completion_tokens >= 2:
            per_token: float | None = req.decode_s / (req.completion_tokens - 1)
        else:
            per_token = tpot_s(req.e2e_s, req.ttft_s, req.completion_tokens)
        if per_token is not None:
            tpot.observe(per_token)
        if req.itl is not None:
            observe_tally(itl, *req.itl)
        first = req.ttft_s if req.ttft_s is not None else req.e2e_s
        if req.goal_s is None or first <= req.goal_s:
            goodput.inc()

"""Per-class SLO metrics (service/observability/class_metrics.py): outcomes, goodput, TTFT/TPOT/E2E."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from service.observability.class_metrics import ClassMetrics, ClassRequest, outcome_of, tpot_s


@pytest.mark.parametrize(
    ("status", "shed", "outcome"),
    [
        (200, False, "served"),
        (503, True, "shed"),  # shed at arrival, evicted or expired in the queue
        (503, False, "error"),  # no worker, a worker failed
        (502, False, "error"),
        (499, False, "cancelled"),
        (429, False, "rejected"),
        (400, False, "rejected"),
        (413, False, "rejected"),
    ],
)
def test_outcome_of(status: int, shed: bool, outcome: str) -> None:
    assert outcome_of(status, shed) == outcome


@pytest.mark.parametrize(
    ("e2e", "ttft", "tokens", "want"),
    [(1.0, 0.1, 10, 0.1), (1.0, 0.1, 1, None), (1.0, None, 10, None), (0.5, 0.5, 2, 0.0), (2.1, 0.1, 3, 1.0)],
)
def test_tpot_is_the_mean_gap_after_the_first_token(
    e2e: float, ttft: float | None, tokens: int, want: float | None
) -> None:
    got = tpot_s(e2e, ttft, tokens)
    assert got == (pytest.approx(want) if want is not None else None)


def test_goodput_counts_served_requests_within_their_goal() -> None:
    registry = CollectorRegistry()
    metrics = ClassMetrics(registry)
    for req in [
        ClassRequest("interactive", "m", 200, False, 0.2, 1.0, 11, 0.5),  # good
        ClassRequest("interactive", "m", 200, False, 0.7, 1.0, 11, 0.5),  # served late
        ClassRequest("interactive", "m", 200, False, None, 0.4, 5, 0.5),  # no TTFT: e2e bounds it, good
        ClassRequest("interactive", "m", 200, False, None, 0.9, 5, 0.5),  # no TTFT, e2e past the goal
        ClassRequest("interactive", "m", 503, True, None, 0.01, 0, 0.5),
        ClassRequest("batch", "m", 200, False, 20.0, 30.0, 2, 30.0),
        ClassRequest("batch", "m", 499, False, None, 3.0, 0, 30.0),
    ]:
        metrics.record(req)

    def get(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    served = {"class": "interactive", "model": "m"}
    assert get("radixgate_class_requests_total", **served, outcome="served") == 4
    assert get("radixgate_class_requests_total", **served, outcome="shed") == 1
    assert get("radixgate_class_goodput_total", **served) == 2
    assert get("radixgate_class_ttft_seconds_count", **served) == 2  # only the known TTFTs
    assert get("radixgate_class_e2e_seconds_count", **served) == 4
    assert get("radixgate_class_tpot_seconds_sum", **served) == pytest.approx(0.08 + 0.03)
    batch = {"class": "batch", "model": "m"}
    assert get("radixgate_class_goodput_total", **batch) == 1
    assert get("radixgate_class_requests_total", **batch, outcome="cancelled") == 1
    assert get("radixgate_class_tpot_seconds_sum", **batch) == pytest.approx(10.0)
    assert get("radixgate_class_ttft_seconds_bucket", **batch, le="15.0") == 0
    assert get("radixgate_class_ttft_seconds_bucket", **batch, le="20.0") == 1

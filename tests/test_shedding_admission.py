"""Shedding decisions and the AIMD concurrency window (pure policies, table-driven)."""

from __future__ import annotations

import pytest

from policies.admission import ConcurrencyWindow, WindowConfig
from policies.fair_queue import BandConfig, PriorityBands, QueuedItem
from policies.shedding import DispatchRate, decide_admission

BANDS = [
    BandConfig("interactive", rank=2, max_queue_len=2, wait_budget_s=0.5),
    BandConfig("standard", rank=1, max_queue_len=5, wait_budget_s=5.0),
    BandConfig("batch", rank=0, max_queue_len=5, wait_budget_s=30.0),
]


def queued(band: str, n: int, cost: float = 100) -> list[QueuedItem[str]]:
    return [QueuedItem("p", f"q{i}", 1.0, cost, band, 0.0, 100.0) for i in range(n)]


# (queued per band, arriving band, service rate tokens/s, max_total) -> (admit, reason, evict_band)
TABLE = [
    ({}, "batch", None, None, True, "admitted", None),
    ({"interactive": 2}, "interactive", None, None, False, "band_full", None),
    ({"standard": 5}, "standard", 1e9, None, False, "band_full", None),
    # 1,000 tokens ahead at 1,000 tokens/s = 1 s > interactive budget 0.5 s
    ({"interactive": 1, "standard": 3}, "interactive", 1000.0, None, True, "admitted", None),
    ({"interactive": 1}, "interactive", 100.0, None, False, "predicted_wait", None),
    ({"standard": 4}, "batch", 10.0, None, False, "predicted_wait", None),  # 40 s ahead > 30 s budget
    ({"standard": 4}, "batch", 100.0, None, True, "admitted", None),
    # full queue: an interactive arrival evicts the newest of the lowest backlogged band
    ({"standard": 2, "batch": 2}, "interactive", None, 4, True, "admitted", "batch"),
    ({"standard": 2, "batch": 2}, "standard", None, 4, True, "admitted", "batch"),
    ({"standard": 2, "batch": 2}, "batch", None, 4, False, "queue_full", None),
    ({"interactive": 2, "standard": 2}, "standard", None, 4, False, "queue_full", None),
]


@pytest.mark.parametrize(("depths", "band", "rate", "max_total", "admit", "reason", "evict"), TABLE)
def test_shedding_decision_table(
    depths: dict[str, int],
    band: str,
    rate: float | None,
    max_total: int | None,
    admit: bool,
    reason: str,
    evict: str | None,
) -> None:
    bands: PriorityBands[str] = PriorityBands(BANDS)
    for name, n in depths.items():
        for it in queued(name, n):
            bands.push(it)
    decision = decide_admission(bands, band, "arrival", 1.0, 100, rate, max_total)
    assert (decision.admit, decision.reason, decision.evict_band) == (admit, reason, evict)


def test_predicted_wait_is_reported() -> None:
    bands: PriorityBands[str] = PriorityBands(BANDS)
    for it in queued("standard", 3):
        bands.push(it)
    assert decide_admission(bands, "batch", "x", 1.0, 100, 100.0, None).predicted_wait_s == pytest.approx(3.0)


def test_dispatch_rate_window() -> None:
    rate = DispatchRate(window_s=10, min_span_s=1)
    rate.record(0.0, 500)
    assert rate.rate(0.5) is None
    rate.record(1.0, 500)
    assert rate.rate(2.0) == pytest.approx(500.0)
    assert rate.rate(30.0) == pytest.approx(0.0)


# (slow start, engine queue, kv usage, in flight) -> limit after, starting from 8
WINDOW_TABLE = [
    (False, 0, 0.1, 8, 9.0),  # saturated and healthy: +1
    (True, 0, 0.1, 8, 16.0),  # ... doubling in slow start
    (False, 0, 0.1, 3, 8.0),  # not saturated: unchanged
    (False, 2, 0.1, 8, 9.0),  # a short engine queue (<= 25% of the window) is normal
    (False, 3, 0.1, 8, 5.6),  # engine queueing more: x0.7
    (True, 3, 0.1, 8, 5.6),  # ... also in slow start
    (False, 0, 0.95, 8, 5.6),  # KV nearly full: x0.7
]


@pytest.mark.parametrize(("slow_start", "queue", "kv", "in_flight", "after"), WINDOW_TABLE)
def test_aimd_window_table(slow_start: bool, queue: int, kv: float, in_flight: int, after: float) -> None:
    window = ConcurrencyWindow(WindowConfig(initial=8, slow_start=slow_start))
    assert window.on_load_report(queue, kv, in_flight) == pytest.approx(after)


def test_slow_start_ends_at_the_first_decrease() -> None:
    window = ConcurrencyWindow(WindowConfig(initial=4))
    assert [window.on_load_report(q, 0.0, 999) for q in (0, 0, 10, 0, 0)] == pytest.approx(
        [8, 16, 11.2, 12.2, 13.2]
    )


def test_window_bounds_room_and_top_band_headroom() -> None:
    window = ConcurrencyWindow(
        WindowConfig(initial=2, minimum=1, maximum=3, max_tokens=1000, slow_start=False)
    )
    for _ in range(10):
        window.on_load_report(5, 0.0, 0)
    assert window.size == 1
    for _ in range(10):
        window.on_load_report(0, 0.0, 99)
    assert window.size == 3
    assert window.has_room(2, 500, 400) and not window.has_room(3, 0, 1)
    assert window.has_room(3, 0, 1, top_band=True) and not window.has_room(5, 0, 1, top_band=True)
    assert not window.has_room(1, 700, 400)  # token cap
    assert window.has_room(0, 0, 5000)  # a lone big request always fits

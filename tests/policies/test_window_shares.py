"""Gateway replicas share a worker (issue 29): each replica's part of a worker's window
(policies/window_shares.py), and what its admission core reads of the engine's figures, which count every
replica's requests (``replica_share`` in policies/windows.py and policies/worker_queue.py)."""

from __future__ import annotations

import math

import pytest

from policies.admission_core import AdmissionCore
from policies.admission_types import AdmissionRequest, CoreConfig
from policies.estimates import WorkerEstimates
from policies.fair_queue import BandConfig, PriorityBands
from policies.window_shares import window_share
from policies.windows import LoadReport, WindowConfig, WorkerWindow
from policies.worker_queue import MAX_PREFILL_SHARE, WorkerQueue


@pytest.mark.parametrize(
    ("window", "replicas", "shares"),
    [
        (64, 1, [64]),
        (64, 2, [32, 32]),
        (64, 3, [22, 21, 21]),  # the remainder to the first ids in order
        (512, 3, [171, 171, 170]),
        (512, 5, [103, 103, 102, 102, 102]),
        (7, 4, [2, 2, 2, 1]),
        (2, 3, [1, 1, 1]),  # fewer slots than replicas: one each (3 in all)
        (0, 2, [1, 1]),  # an engine that reported no slots: one each
    ],
)
def test_each_replica_takes_the_floor_plus_the_remainder_in_id_order(
    window: int, replicas: int, shares: list[int]
) -> None:
    ids = [f"replica-{i}" for i in range(replicas)]
    assert [window_share(window, ids, me) for me in ids] == shares
    assert [window_share(window, list(reversed(ids)), me) for me in ids] == shares  # order given: no matter


def test_a_replica_not_yet_listed_counts_itself() -> None:
    assert window_share(64, ["a", "b"], "c") == 21  # three replicas: 22, 21, 21
    assert window_share(64, [], "a") == 64


# ----------------------------------------------------------------------------------------- windows
ENGINE = WindowConfig(mode="engine", initial=8, maximum=1024)


@pytest.mark.parametrize(
    ("share", "report", "reports", "expected"),
    [
        # 4 replicas of 16 slots each on a 64-slot engine: 8 waiting in all is 2 of this replica's
        (0.25, LoadReport(64, 8, 0.3, 16, 0.25), 3, 16),  # 2 <= a quarter of 16: tolerated
        (1.0, LoadReport(64, 8, 0.3, 16, 1.0), 3, 14),  # read as its own: shrinks, min(16 x 0.9, 64 + 4)
        (0.25, LoadReport(64, 40, 0.3, 16, 0.25), 3, 14),  # 10 of its own: min(16 x 0.9, 16 + 4)
        # KV nearly full: the window goes to 0.9 x this replica's part of what runs
        (0.25, LoadReport(40, 0, 0.95, 16, 0.25), 1, 9),  # 40 x 0.25 = 10 -> 9
        (1.0, LoadReport(40, 0, 0.95, 16, 1.0), 1, 14),  # min(16, 40) x 0.9
    ],
)
def test_the_window_reads_its_part_of_the_engine_s_figures(
    share: float, report: LoadReport, reports: int, expected: int
) -> None:
    window = WorkerWindow(ENGINE)
    window.on_report(LoadReport(0, 0, 0.0, 16, share), 0, None)
    assert window.size == 16  # this replica's share of the engine's 64
    for _ in range(reports):
        window.on_report(report, in_flight=16, engine_ttft_s=None)
    assert window.size == expected


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, math.nan])
def test_a_replica_share_outside_zero_to_one_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="replica_share"):
        LoadReport(0, 0, 0.0, 8, share)
    with pytest.raises(ValueError, match="replica_share"):
        AdmissionCore(CoreConfig()).add_worker("w", 8, share)


# ----------------------------------------------------------------------------------------- the engine
def worker(share: float) -> WorkerQueue:
    bands = PriorityBands([BandConfig("interactive", 2, 100, 0.5), BandConfig("standard", 1, 100, 2.0)])
    w = WorkerQueue("w", WorkerWindow(ENGINE), bands, WorkerEstimates(), top_rank=2)
    w.replica_share = share
    return w


@pytest.mark.parametrize(
    ("share", "own", "engine"),
    [(1.0, 600, 600), (0.5, 600, 1200), (0.25, 600, 2400), (1 / 3, 500, 1500), (0.25, 0, 0)],
)
def test_the_prefill_backlog_is_this_replicas_own_over_its_share(share: float, own: int, engine: int) -> None:
    """Each replica has as much pending on the engine as this one (the load balancer gives them the same
    traffic): the engine's backlog, which every prediction and guard reads, is its own over its share."""
    w = worker(share)
    w.prefill_backlog = own
    assert w.backlog(0.0) == engine
    assert w.prefill_backlog == own  # the bookkeeping itself stays this replica's own


@pytest.mark.parametrize("share", [1.0, 0.5, 0.25])
def test_the_higher_classes_prefill_arrivals_count_every_replicas(share: float) -> None:
    """A standard request waits in the engine while the interactive arrivals of every replica are
    prefilled first: ``T = E / (1 - u)``, ``u`` their tokens/s (this replica's over its share) x s/token."""
    w = worker(share)
    for t in range(20):  # the engine's cost: 50 ms + 0.1 ms per token of prefill (from 2,000 tokens up)
        w.est.on_first_token(float(t), 0.05, 100)
        w.est.on_first_token(float(t) + 0.5, 0.05 + 2000 * 1e-4, 2000)
    for k in range(100):  # this replica's interactive arrivals: 1,000 uncached tokens/s
        w.count_arrival(2, 20.0 + k * 0.01, 5.0, tokens=10)
    now = 21.0
    plain = w.est.engine_ttft(500, now)
    per_token = w.est.per_token_ttft(now)
    assert per_token is not None and plain > 0
    tokens = sum(r.rate(now) or 0.0 for k, r in w.arrival_tokens.items() if k > 1)
    u = min(MAX_PREFILL_SHARE, tokens / share * per_token)
    assert w.engine_ttft(500, 1, now) == pytest.approx(plain / (1.0 - u))
    assert w.engine_ttft(500, 1, now) > plain


def test_a_load_report_sets_the_replicas_share_of_the_worker() -> None:
    core = AdmissionCore(CoreConfig())
    core.add_worker("w", 16, 0.25)
    req = AdmissionRequest("a", "t", "standard", "p", 200, 10, 0.0)
    core.arrive(req, 0.0)
    w = core._workers["w"]  # internal bookkeeping, read to check it
    assert w.backlog(0.0) == 800
    core.load("w", LoadReport(4, 0, 0.1, 32, 0.5), 1.0)
    assert w.backlog(1.0) == 400
    window = core.window("w")
    assert window is not None and window.size == 16 and window.ceiling == 32

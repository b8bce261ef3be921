"""A changing worker count in the fleet simulation (loadgen.fleet.sim, .scaling, .controllers) and the
planner experiment (loadgen.fleet.experiments_planner) on a reduced day."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from loadgen.fleet.config import FleetConfig, FleetRequest
from loadgen.fleet.controllers import OracleController, QueueRule, SaturationRule
from loadgen.fleet.experiments_common import PROFILE
from loadgen.fleet.planner_runs import Setup, lapsed_planner
from loadgen.fleet.scaling import LaneView, direction_changes, run_scaled
from loadgen.fleet.sim import FleetSim
from service.config.fleet import PlannerSettings

WORDS = [
    "the",
    "model",
    "reads",
    "a",
    "long",
    "prompt",
    "and",
    "writes",
    "a",
    "short",
    "answer",
    "for",
    "the",
    "gateway",
]


def requests(rate: float, start: float, end: float, max_tokens: int = 64) -> list[FleetRequest]:
    """Evenly spaced requests of ~150 distinct words (no shared prefix)."""
    out = []
    n = int((end - start) * rate)
    for i in range(n):
        words = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(150))
        out.append(FleetRequest(f"r{i}", start + i / rate, "t", f"q{i} {words}", max_tokens))
    return out


def fleet(workers: int, cold_start_s: float) -> FleetConfig:
    return FleetConfig(profile=PROFILE, workers=workers, cold_start_s=cold_start_s)


def test_a_new_worker_takes_requests_only_after_its_cold_start() -> None:
    sim = FleetSim(fleet(1, 30.0), requests(40.0, 0.0, 60.0))
    started: list[str] = []
    sim.call_at(10.0, lambda t: started.append(sim.start_worker(t, sim.config.cold_start_s)))
    result = sim.run()
    new = result.workers[1]
    assert (new.started_s, new.ready_s) == (10.0, 40.0)
    dispatched = [r.dispatch_s for r in result.records if r.worker == 1]
    assert dispatched and min(d for d in dispatched if d is not None) >= 40.0
    # before it was ready, worker 0 ran everything
    assert all(r.worker == 0 for r in result.records if r.arrival_s < 40.0)
    assert all(r.outcome == "ok" for r in result.records)


def test_a_draining_worker_gets_nothing_new_and_its_running_requests_finish() -> None:
    sim = FleetSim(fleet(2, 0.0), requests(60.0, 0.0, 30.0, max_tokens=200))
    running_at_drain: list[int] = []

    def drain(t: float) -> None:
        running_at_drain.append(len(sim.workers[1].jobs))
        sim.stop_worker("sim://worker-001", t)

    sim.call_at(10.0, drain)
    result = sim.run()
    assert running_at_drain[0] > 0
    late = [r for r in result.records if r.worker == 1 and r.dispatch_s is not None and r.dispatch_s > 10.0]
    assert late == []
    drained = [r for r in result.records if r.worker == 1]
    assert drained and all(r.outcome == "ok" and r.done_s is not None for r in drained)
    stopped = result.workers[1].stopped_s
    assert stopped is not None and stopped == pytest.approx(max(r.done_s or 0.0 for r in drained), abs=0.05)
    assert sim.worker_states()["sim://worker-001"] == "stopped"


def test_a_worker_cancelled_while_starting_never_serves() -> None:
    sim = FleetSim(fleet(1, 20.0), requests(20.0, 0.0, 40.0))
    sim.call_at(5.0, lambda t: sim.start_worker(t, sim.config.cold_start_s))
    sim.call_at(15.0, lambda t: sim.stop_worker("sim://worker-001", t))
    result = sim.run()
    assert result.workers[1].ready_s is None and result.workers[1].stopped_s == 15.0
    assert not any(r.worker == 1 for r in result.records)


@dataclass
class Scripted:
    """A controller that answers a fixed count per tick (the controller interface at its simplest)."""

    counts: list[int]
    interval_s: float = 5.0
    name: str = "scripted"
    seen: list[tuple[float, int, int]] = field(default_factory=list)

    def decide(self, view: LaneView, now: float) -> int:
        self.seen.append((now, len(view.eligible()), view.count("starting")))
        return self.counts[min(len(self.seen) - 1, len(self.counts) - 1)]


def test_the_controller_is_asked_every_interval_and_its_count_is_held() -> None:
    ctl = Scripted([3, 3, 3, 3, 1, 1, 1, 2])
    run = run_scaled(fleet(1, 12.0), requests(30.0, 0.0, 50.0), ctl)
    times = [t for t, _, _ in ctl.seen]
    assert times[:8] == [5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0, 40.0]
    # asked for 3 at t=5: two start, both serve from t=17
    assert ctl.seen[1] == (10.0, 1, 2) and ctl.seen[3] == (20.0, 3, 0)
    # down to 1 at t=25: the newest ready workers drain; then 2 at t=40: a new one starts
    assert [(p.t, p.desired, p.starting, p.ready) for p in run.timeline[4:8]] == [
        (25.0, 1, 0, 1),
        (30.0, 1, 0, 1),
        (35.0, 1, 0, 1),
        (40.0, 2, 1, 1),
    ]
    w = run.result.workers
    assert [x.started_s for x in w] == [0.0, 5.0, 5.0, 40.0]
    assert w[1].stopped_s is not None and w[2].stopped_s is not None and w[0].stopped_s is None
    # a worker costs from its request to its end: 1 x 50 s + 2 x (~20 s + drain) + 10 s
    held = run.worker_seconds(0.0, 50.0)
    assert 50 + 2 * 20 + 10 <= held <= 50 + 2 * 26 + 10


def test_cancelling_removes_starting_workers_before_draining_ready_ones() -> None:
    ctl = Scripted([2, 3, 1], interval_s=4.0)
    run = run_scaled(fleet(1, 10.0), requests(10.0, 0.0, 30.0), ctl)
    # t=4: one starts (ready at 14); t=8: another (ready at 18); t=12: down to 1 -> both starting cancelled
    w = run.result.workers
    assert [(x.started_s, x.ready_s, x.stopped_s) for x in w[1:]] == [(4.0, None, 12.0), (8.0, None, 12.0)]
    assert w[0].stopped_s is None


@pytest.mark.parametrize(
    ("series", "window", "changes"),
    [
        ([(0, 5), (1, 6), (2, 7), (3, 7)], (0, 10), 0),
        ([(0, 5), (1, 6), (2, 5), (3, 6)], (0, 10), 2),
        ([(0, 5), (1, 6), (2, 5), (3, 6)], (2.5, 10), 1),  # the fall at t=2 sets the direction
        ([(0, 5), (1, 6), (2, 5), (3, 6)], (0, 1.5), 0),
        ([(0, 5), (1, 5), (2, 4), (3, 4), (4, 3)], (0, 10), 0),
    ],
)
def test_direction_changes_count_reversals(
    series: list[tuple[float, int]], window: tuple[float, float], changes: int
) -> None:
    assert direction_changes(series, *window) == changes


@dataclass
class FakeView:
    """What the threshold rules read: waiting per worker, KV usage, starting workers."""

    waiting_per_worker: dict[str, int]
    kv: float = 0.1
    starting: int = 0

    def waiting(self) -> dict[str, int]:
        return dict(self.waiting_per_worker)

    @property
    def loads(self) -> dict[str, object]:
        from policies.windows import LoadReport

        return {u: LoadReport(10, 0, self.kv, 512) for u in self.waiting_per_worker}

    def count(self, state: str) -> int:
        return {"ready": len(self.waiting_per_worker), "starting": self.starting}.get(state, 0)


def view(n: int, waiting: int, kv: float = 0.1, starting: int = 0) -> FakeView:
    return FakeView({f"w{i}": waiting for i in range(n)}, kv, starting)


def test_the_queue_rule_scales_up_at_once_and_down_one_a_minute_after_its_window() -> None:
    rule = QueueRule()
    assert rule.decide(view(4, 0), 0.0) == 4  # holds what it finds for a window
    assert rule.decide(view(4, 8), 15.0) == 7  # 32 waiting / 5 = 6.4 -> 7 (within max(+100%, +4))
    assert rule.decide(view(7, 5), 30.0) == 7  # 35 / 5 = 7: within the tolerance
    for t in range(45, 330, 15):
        assert rule.decide(view(7, 0), float(t)) == 7  # nothing waits, but 7 was recommended < 300 s ago
    assert rule.decide(view(7, 0), 345.0) == 6
    assert rule.decide(view(6, 0), 360.0) == 6  # one per minute
    assert rule.decide(view(6, 0), 405.0) == 5


@pytest.mark.parametrize(
    ("peaks", "action"),
    [
        ({"a": (0.2, 0.0), "b": (0.2, 0.0), "c": (0.2, 0.0)}, "down"),  # load of 3 fits on 2 with spare
        ({"a": (0.2, 1.5), "b": (0.2, 1.5)}, "hold"),  # 3 waiting on 1 leaves a spare queue of 2 < 3
        ({"a": (0.2, 2.5), "b": (0.2, 2.5)}, "up"),  # mean spare queue 2.5 < 3
        ({"a": (0.75, 0.0), "b": (0.75, 0.0)}, "up"),  # mean spare KV 0.05 < 0.1
        ({"a": (0.85, 0.0), "b": (0.2, 0.0)}, "hold"),  # a is saturated; b alone cannot take one away
        ({"a": (0.85, 0.0), "b": (0.2, 9.0)}, "up"),  # none left unsaturated
    ],
)
def test_the_saturation_rule_follows_llm_d_wva(peaks: dict[str, tuple[float, float]], action: str) -> None:
    assert SaturationRule().analyse(peaks, len(peaks)) == action


def test_the_saturation_rule_adds_none_while_one_is_starting() -> None:
    rule = SaturationRule(decide_every_s=60.0, interval_s=15.0)
    assert rule.decide(view(2, 4), 0.0) == 2  # first call: what it finds
    assert rule.decide(view(2, 4), 60.0) == 3
    assert rule.decide(view(2, 4, starting=1), 120.0) == 3
    assert rule.decide(view(3, 4), 180.0) == 4


@pytest.mark.parametrize(
    ("t", "wanted"),
    [(0.0, 2), (30.0, 2), (50.0, 5), (61.0, 5), (125.0, 5), (185.0, 3), (230.0, 3)],
)
def test_the_oracle_asks_a_cold_start_ahead_and_lets_go_only_when_no_longer_needed(
    t: float, wanted: int
) -> None:
    # minutes need 2, 2, 5, 3 workers; a worker asked for serves 70 s later
    oracle = OracleController([2, 2, 5, 3], minute_s=60.0, lead_s=70.0, interval_s=10.0)
    assert oracle.wanted(t) == wanted


def test_scaled_runs_are_deterministic() -> None:
    a = run_scaled(fleet(1, 10.0), requests(30.0, 0.0, 30.0), Scripted([2, 1, 3]))
    b = run_scaled(fleet(1, 10.0), requests(30.0, 0.0, 30.0), Scripted([2, 1, 3]))
    assert [(r.rid, r.worker, r.first_token_s) for r in a.result.records] == [
        (r.rid, r.worker, r.first_token_s) for r in b.result.records
    ]
    assert replace(a.timeline[0]) == b.timeline[0]


@pytest.mark.parametrize(("headroom", "first", "peak"), [(0.0, 6, 40), (0.05, 7, 42), (0.1, 7, 44)])
def test_the_oracle_s_headroom_scales_its_workers_per_minute(headroom: float, first: int, peak: int) -> None:
    counts = Setup(oracle_headroom=headroom).oracle_counts()  # the day: 0.3x -> 2x of 20 workers
    assert (counts[0], max(counts)) == (first, peak)


def test_the_lapsed_planner_keeps_its_queue_median_in_the_requests_time() -> None:
    base = PlannerSettings().config()
    lapsed = lapsed_planner(base, speed=10.0, cold_start_s=300.0)
    assert (lapsed.interval_s, lapsed.cold_start_s, lapsed.scale_down_window_s) == (1.0, 30.0, 12.0)
    assert lapsed.forecast.median_samples == base.forecast.median_samples  # rates: the day's samples
    assert lapsed.queue_median_samples == 10 * base.forecast.median_samples  # queues: the same real s

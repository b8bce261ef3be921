"""Worker pool: probes (plain and deep), circuit breaker transitions, draining."""

from __future__ import annotations

import asyncio

import pytest

from policies.circuit_breaker import BreakerConfig
from service.workers.client import ProbeReport, SGLangClient
from service.workers.pool import WorkerPool
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer, free_port


async def test_deep_probes_and_breaker_transitions() -> None:
    fake = FakeWorker()
    clock = [0.0]
    transitions: list[tuple[str, str]] = []
    with ThreadedServer(fake.app) as server:
        async with SGLangClient() as client:
            pool = WorkerPool(
                [server.url],
                client,
                1.0,
                2.0,
                BreakerConfig(2, 1, 10.0),
                on_transition=lambda url, state: transitions.append((url, state)),
                clock=lambda: clock[0],
                deep_probe_every=2,
            )
            for _ in range(4):
                await pool.probe_all()
            assert fake.deep_probes == 2 and pool.any_healthy()
            fake.deep_status = 500  # /health still 200, /health_generate 500: only deep probes fail
            await pool.probe_all()  # round 5: plain, passes
            await pool.probe_all()  # round 6: deep, fails -> one failure, not definitive
            assert transitions == [] and pool.any_healthy()
            await pool.probe_all()  # round 7: plain 200 does not clear the failed generation
            await pool.probe_all()  # round 8: deep fails again -> 2 failures: open
            assert [s for _, s in transitions] == ["open"]
            assert not pool.any_healthy() and pool.choose() is None
            fake.deep_status = 200
            await pool.probe_all()  # still cooling down: not probed
            clock[0] = 11.0
            await pool.probe_all()  # half-open probe succeeds -> closed (1 success needed)
            assert [s for _, s in transitions] == ["open", "half_open", "closed"]
            assert pool.any_healthy() and pool.choose() == server.url


async def test_failed_probes_count_for_nothing_while_requests_succeed() -> None:
    fake = FakeWorker()
    fake.deep_status = 500
    clock = [0.0]
    with ThreadedServer(fake.app) as server:
        async with SGLangClient() as client:
            pool = WorkerPool(
                [server.url],
                client,
                1.0,
                2.0,
                BreakerConfig(1, 1, 10.0, trust_window_s=5.0),
                clock=lambda: clock[0],
                deep_probe_every=1,
            )
            pool.record(server.url, "request_ok")
            for step in range(6):  # deep probes fail for 5 s while requests succeed
                clock[0] = float(step)
                await pool.probe_all()
                pool.record(server.url, "request_ok")
                assert pool.any_healthy(), step
            assert fake.deep_probes == 6
            clock[0] = 11.5  # no request for 6.5 s: the next failed deep probe counts (threshold 1)
            await pool.probe_all()
            assert not pool.any_healthy()


async def test_a_refused_probe_opens_at_once() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with SGLangClient() as client:
        pool = WorkerPool([dead], client, 1.0, breaker=BreakerConfig(5, 1, 10.0))
        pool.record(dead, "request_ok")
        await pool.probe_all()  # nothing listens: the connection is refused, which is definitive
        state = pool.get(dead)
        assert state is not None and state.breaker.state == "open"


async def test_refused_connection_opens_at_once_and_drained_worker_leaves_when_idle() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with SGLangClient() as client:
        pool = WorkerPool([dead, "http://w2"], client, 1.0)
        for url in (dead, "http://w2"):
            pool.record(url, "request_ok")
        pool.record(dead, "refused")
        assert pool.choose() == "http://w2"
        pool.acquire("http://w2", 10)
        assert pool.drain("http://w2") and pool.get("http://w2") is not None  # still busy
        assert pool.choose() is None  # draining takes no new requests
        pool.release("http://w2", 10)
        assert pool.get("http://w2") is None  # idle: removed


async def test_every_breaker_move_is_reported_wherever_it_happens() -> None:
    """The cool-down can end on the request path (routing asks who is eligible) rather than in a
    probe round; that open -> half-open move is reported all the same, and so is a restart's
    re-admission after it."""
    async with SGLangClient() as client:
        transitions: list[str] = []
        clock = [0.0]
        url = "http://127.0.0.1:9"
        pool = WorkerPool(
            [url],
            client,
            1.0,
            breaker=BreakerConfig(5, 1, 10.0),
            on_transition=lambda _, state: transitions.append(state),
            clock=lambda: clock[0],
        )
        pool.record(url, "request_ok")
        pool.trip(url)  # its supervisor saw the process die
        assert transitions == ["open"] and not pool.any_healthy()
        clock[0] = 10.5  # cool-down over; routing looks before any probe does
        assert [v.healthy for v in pool.views()] == [True]
        assert transitions == ["open", "half_open"]
        pool.trip(url)
        clock[0] = 40.0
        assert pool.any_healthy()
        pool.readmit(url)  # already half-open: nothing new to report
        assert transitions == ["open", "half_open", "open", "half_open"]
        pool.record(url, "request_ok")
        assert transitions[-1] == "closed"


class GatedProbes:
    """A client whose deep probes wait for the test to answer them; counts the probes asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, bool]] = []
        self.answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def check(self, url: str, timeout_s: float = 2.0, deep: bool = False) -> ProbeReport:
        self.asked.append((url, deep))
        result = await self.answer
        self.answer = asyncio.get_running_loop().create_future()
        return ProbeReport(result, f"probe {result}")  # type: ignore[arg-type]

    def known_info(self, url: str) -> None:
        return None


def _suspect_pool(probes: GatedProbes, verdicts: list[tuple[str, str]]) -> WorkerPool:
    pool = WorkerPool(
        ["http://w1"],
        probes,  # type: ignore[arg-type]
        1.0,
        breaker=BreakerConfig(5, 1, 10.0),
        on_confirmation=lambda url, verdict: verdicts.append((url, verdict)),
    )
    pool.record("http://w1", "request_ok")
    return pool


@pytest.mark.parametrize(
    ("probe", "state", "verdict"),
    [
        ("failed", "open", "confirmed"),  # sick: each of the 12 answers is a failure (5 open it)
        ("ok", "closed", "cleared"),  # it generates: the 5xx were the requests' own fault
        ("refused", "open", "refused"),  # definitive
        ("unknown", "closed", "no_evidence"),  # our own connection pool was full: nothing learned
    ],
)
async def test_concurrent_5xx_share_one_confirmation_probe(probe: str, state: str, verdict: str) -> None:
    probes, verdicts = GatedProbes(), []
    pool = _suspect_pool(probes, verdicts)
    worker = pool.get("http://w1")
    assert worker is not None
    for _ in range(12):  # a burst of 5xx while the first confirmation is in flight
        pool.suspect("http://w1")
        await asyncio.sleep(0)
    assert probes.asked == [("http://w1", True)]  # one deep probe, no storm
    assert worker.breaker.state == "closed" and worker.breaker.failures == 0  # nothing counted yet
    probes.answer.set_result(probe)
    await pool.settle_confirmations()
    assert worker.breaker.state == state and verdicts == [("http://w1", verdict)]
    assert worker.suspects == 0


async def test_a_passing_confirmation_clears_and_the_next_5xx_gets_its_own_probe() -> None:
    probes, verdicts = GatedProbes(), []
    pool = _suspect_pool(probes, verdicts)
    worker = pool.get("http://w1")
    assert worker is not None
    for _ in range(4):  # threshold 5: four confirmed failures keep it closed...
        pool.suspect("http://w1")
    probes.answer.set_result("failed")
    await pool.settle_confirmations()
    assert worker.breaker.state == "closed" and worker.breaker.failures == 4
    for _ in range(30):  # ...and poisoned requests whose probe passes clear them
        pool.suspect("http://w1")
        await asyncio.sleep(0)
        if not probes.answer.done():
            probes.answer.set_result("ok")
        await pool.settle_confirmations()
    assert len(probes.asked) == 31  # each settled confirmation ends; a later 5xx starts a new one
    assert worker.breaker.state == "closed" and worker.breaker.failures == 0
    assert verdicts.count(("http://w1", "cleared")) == 30


async def test_stop_cancels_a_confirmation_in_flight_and_unknown_workers_are_ignored() -> None:
    probes, verdicts = GatedProbes(), []
    pool = _suspect_pool(probes, verdicts)
    pool.suspect("http://elsewhere")  # not in the pool: no probe
    pool.suspect("http://w1")
    await asyncio.sleep(0)
    assert probes.asked == [("http://w1", True)]
    await pool.stop()
    await pool.settle_confirmations()  # nothing left in flight
    assert verdicts == []


async def test_retry_after_says_when_a_worker_may_take_traffic_again() -> None:
    """A request refused for want of a worker is told to come back when one may take it: an open breaker's
    remaining cool-down, the next health probe of a worker not yet seen up; 1 s at least, 60 s at most."""
    clock = [0.0]
    async with SGLangClient() as client:
        pool = WorkerPool(["http://a", "http://b"], client, 2.0, clock=lambda: clock[0])
        pool.record("http://a", "refused")  # open at t=0 for 30 s
        pool.drain("http://b")  # a draining worker says nothing
        clock[0] = 10.0
        assert pool.retry_after_s() == pytest.approx(20.0)
        pool.add("http://c")  # not yet seen up: its first probe comes within the health interval
        assert pool.retry_after_s() == pytest.approx(2.0)
        pool.record("http://c", "request_ok")  # seen up: nothing to wait for but the floor
        assert pool.retry_after_s() == 1.0
        long = WorkerPool(
            ["http://d"], client, 2.0, breaker=BreakerConfig(open_cooldown_s=300.0), clock=lambda: clock[0]
        )
        long.record("http://d", "refused")
        assert long.retry_after_s() == 60.0  # capped
        assert WorkerPool([], client, 2.0).retry_after_s() == 1.0

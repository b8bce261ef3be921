"""The simulated SGLang worker's engine in virtual time: radix cache, batching, priority, determinism."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from loadgen.sim.engine import SimEngine, SimEvent, SimRequest
from loadgen.sim.profiles import SimProfile, get_profile
from loadgen.sim.radix import RadixCache

H100 = get_profile("llama-3.1-8b-h100")
CPU = get_profile("smollm2-135m-cpu2")


def run(engine: SimEngine, until: float = 1e9) -> list[SimEvent]:
    events: list[SimEvent] = []
    while (t := engine.next_event_time()) is not None and t <= until:
        events.extend(engine.advance(t))
    return events


def finished(events: list[SimEvent]) -> dict[str, SimEvent]:
    return {e.rid: e for e in events if e.finish_reason is not None}


def prompt(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


# ----- radix cache
def test_radix_cache_matches_shared_prefix_and_splits_edges() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5], now_s=0.0)
    assert cache.match_prefix([1, 2, 3, 9], 1.0)[0] == 3
    cache.insert([1, 2, 3, 9, 9], now_s=1.0)
    assert cache.total_tokens == 7  # 1 2 3 | 4 5 | 9 9
    assert cache.match_prefix([1, 2, 3, 9, 9, 7], 2.0)[0] == 5
    assert cache.match_prefix([7], 2.0)[0] == 0


def test_radix_cache_evicts_least_recently_used_unlocked_leaves() -> None:
    cache = RadixCache()
    cache.insert([1, 1, 1], now_s=0.0)
    cache.insert([2, 2, 2], now_s=1.0)
    _, held = cache.insert([3, 3, 3], now_s=2.0)
    cache.lock(held)
    cache.match_prefix([1, 1, 1], 3.0)  # touch: now [2,2,2] is the least recently used
    assert cache.evict(3) == 3
    assert cache.match_prefix([2, 2, 2], 4.0)[0] == 0
    assert cache.match_prefix([1, 1, 1], 4.0)[0] == 3
    assert cache.evict(100) == 3  # only [1,1,1] can go; [3,3,3] is locked
    assert cache.total_tokens == 3 and cache.locked_tokens == 3 and cache.evictable_tokens == 0
    cache.unlock(held)
    assert cache.evictable_tokens == 3


def test_shared_system_prompt_is_cached_on_the_second_request() -> None:
    engine = SimEngine(H100)
    system = prompt(1000, 500)
    engine.submit(SimRequest("a", system + prompt(1, 20), 8), 0.0)
    first = finished(run(engine))["a"]
    engine.submit(SimRequest("b", system + prompt(50, 30), 8), first.time_s)
    second = finished(run(engine))["b"]
    assert first.cached_tokens == 0
    assert second.cached_tokens == 500
    assert second.prompt_tokens == 530


def test_kv_capacity_evicts_old_prefixes_lru() -> None:
    small = dataclasses.replace(H100, kv_capacity_tokens=3000)
    engine = SimEngine(small)
    t = 0.0
    for i in range(6):  # 6 x ~810 tokens > 3000: the oldest prefixes are evicted
        engine.submit(SimRequest(f"r{i}", prompt(10_000 * (i + 1), 800), 10), t)
        t = finished(run(engine))[f"r{i}"].time_s
    assert engine.cache.total_tokens <= 3000
    engine.submit(SimRequest("again-old", prompt(10_000, 800), 4), t)
    engine.submit(SimRequest("again-new", prompt(60_000, 800), 4), t)
    done = finished(run(engine))
    assert done["again-old"].cached_tokens == 0
    assert done["again-new"].cached_tokens == 799  # capped at prompt length − 1, as SGLang does


# ----- batching
@pytest.mark.parametrize("profile", [H100, CPU], ids=lambda p: p.name)
def test_two_concurrent_requests_finish_sooner_than_twice_one(profile: SimProfile) -> None:
    one = SimEngine(profile)
    one.submit(SimRequest("solo", prompt(1, 40), 32), 0.0)
    solo = finished(run(one))["solo"].time_s
    two = SimEngine(profile)
    two.submit(SimRequest("x", prompt(1, 40), 32), 0.0)
    two.submit(SimRequest("y", prompt(100, 40), 32), 0.0)
    both = max(e.time_s for e in finished(run(two)).values())
    assert solo < both < 1.5 * solo


def test_events_stream_one_token_per_step_and_finish_with_length() -> None:
    engine = SimEngine(H100)
    engine.submit(SimRequest("r", prompt(1, 10), 5), 0.0)
    events = run(engine)
    assert [e.completion_tokens for e in events] == [1, 2, 3, 4, 5]
    assert [e.finish_reason for e in events] == [None, None, None, None, "length"]
    assert all(a.time_s < b.time_s for a, b in itertools.pairwise(events))


def test_natural_stop_finishes_with_stop() -> None:
    engine = SimEngine(H100)
    engine.submit(SimRequest("r", prompt(1, 10), 50, stop_at=7), 0.0)
    last = run(engine)[-1]
    assert (last.completion_tokens, last.finish_reason) == (7, "stop")


def test_max_running_requests_queues_the_rest() -> None:
    engine = SimEngine(dataclasses.replace(CPU, max_running_requests=2))
    for i in range(5):
        engine.submit(SimRequest(f"r{i}", prompt(100 * i + 1, 20), 16), 0.0)
    engine.advance(0.2)
    stats = engine.stats()
    assert stats.num_running_reqs == 2 and stats.num_queue_reqs == 3
    assert len(finished(run(engine))) == 5


# ----- priority and preemption
def test_high_priority_request_sent_after_many_low_ones_finishes_first() -> None:
    engine = SimEngine(dataclasses.replace(CPU, max_running_requests=1))
    for i in range(6):
        engine.submit(SimRequest(f"low{i}", prompt(100 * i + 1, 20), 24, priority=0), 0.0)
    engine.advance(0.3)  # low0 is running, five are queued
    engine.submit(SimRequest("high", prompt(5000, 20), 24, priority=10), 0.3)
    order = [e.rid for e in run(engine) if e.finish_reason]
    assert order[0] == "high"
    assert engine.stats().preemptions_total == 1
    assert order[1:] == [f"low{i}" for i in range(6)]  # the preempted one resumes first (FCFS)


@pytest.mark.parametrize(
    ("gap", "threshold", "preempts"),
    [
        (10, 0, True),
        (1, 0, True),
        (0, 0, False),
        (10, 10, False),  # SGLang's default threshold: the default classes' gap of 10 does not preempt
        (11, 10, True),
        (5, 4, True),
    ],
)
def test_preemption_needs_a_priority_gap_greater_than_the_threshold(
    gap: int, threshold: int, preempts: bool
) -> None:
    """SGLang's rule (``preempt_to_schedule``: ``priority_diff > threshold``)."""
    engine = SimEngine(dataclasses.replace(CPU, max_running_requests=1), preemption_threshold=threshold)
    engine.submit(SimRequest("low", prompt(1, 20), 24, priority=0), 0.0)
    engine.advance(0.3)
    engine.submit(SimRequest("high", prompt(5000, 20), 24, priority=gap), 0.3)
    order = [e.rid for e in run(engine) if e.finish_reason]
    assert (order[0] == "high") is preempts
    assert engine.stats().preemptions_total == int(preempts)


def test_high_priority_preempts_when_kv_is_full() -> None:
    tight = dataclasses.replace(CPU, kv_capacity_tokens=700, new_token_ratio=1.0)

    def finish_of_late_request(priority: int) -> tuple[dict[str, SimEvent], int]:
        engine = SimEngine(tight)
        for i in range(3):  # 3 x (100 prompt + 100 reserved) of 700 tokens: no room for a fourth
            engine.submit(SimRequest(f"low{i}", prompt(1000 * (i + 1), 100), 100), 0.0)
        engine.advance(0.5)
        assert engine.stats().num_running_reqs == 3
        engine.submit(SimRequest("late", prompt(9000, 100), 100, priority=priority), 0.5)
        return finished(run(engine)), engine.stats().preemptions_total

    boosted, preemptions = finish_of_late_request(5)
    plain, none = finish_of_late_request(0)
    assert preemptions == 1 and none == 0
    assert boosted["late"].time_s < boosted["low2"].time_s  # low2 (latest low) was preempted
    assert boosted["late"].time_s < plain["late"].time_s - 2.0  # without priority it waits its turn
    assert all(e.completion_tokens == 100 for e in boosted.values())


def test_kv_pressure_during_decode_retracts_and_resumes() -> None:
    tight = dataclasses.replace(CPU, kv_capacity_tokens=400, new_token_ratio=0.0)
    engine = SimEngine(tight)
    for i in range(4):
        engine.submit(SimRequest(f"r{i}", prompt(1000 * (i + 1), 50), 60), 0.0)
    done = finished(run(engine))
    assert len(done) == 4 and all(e.completion_tokens == 60 for e in done.values())
    assert engine.stats().preemptions_total >= 1


# ----- request times (SGLang's --enable-metrics meta_info, loadgen/sim/timing.py)
def test_request_times_split_the_ttft_into_floor_queue_and_prefill() -> None:
    engine = SimEngine(dataclasses.replace(CPU, max_running_requests=1))
    engine.submit(SimRequest("first", prompt(1, 40), 4), 0.0)
    engine.submit(SimRequest("second", prompt(500, 40), 4), 0.0)
    events = run(engine)
    floor = CPU.ttft_floor_ms / 1000
    for rid in ("first", "second"):
        first_token = next(e for e in events if e.rid == rid)
        t = first_token.times
        assert t is not None and t.ready_s == pytest.approx(floor) and t.retractions == 0
        assert t.forward_entry_s is not None and t.prefill_finished_s == first_token.time_s
        assert t.queue_s == pytest.approx(t.forward_entry_s - t.ready_s)
        # nothing else: received (0) + floor + queue + prefill is the time to the first token
        assert floor + t.queue_s + (t.prefill_finished_s - t.forward_entry_s) == pytest.approx(
            first_token.time_s
        )
    last_of_first = finished(events)["first"]
    second = next(e for e in events if e.rid == "second").times
    assert second is not None and second.queue_s == pytest.approx(last_of_first.time_s - floor, abs=1e-9)


def test_a_retraction_counts_and_adds_its_second_wait_to_the_queue_time() -> None:
    engine = SimEngine(dataclasses.replace(CPU, max_running_requests=1))
    engine.submit(SimRequest("low", prompt(1, 20), 24, priority=0), 0.0)
    engine.advance(0.3)
    engine.submit(SimRequest("high", prompt(5000, 20), 24, priority=10), 0.3)
    events = run(engine)
    low = [e for e in events if e.rid == "low"]
    before, after = low[0].times, low[-1].times
    assert before is not None and after is not None
    assert (before.retractions, after.retractions) == (0, 1)
    # first forward and first prefill are kept; the wait behind "high" is added to the queue time
    assert (after.forward_entry_s, after.prefill_finished_s) == (
        before.forward_entry_s,
        before.prefill_finished_s,
    )
    high_done = finished(events)["high"].time_s
    assert high_done - 0.35 < after.queue_s - before.queue_s <= high_done - 0.3
    stats = engine.stats()  # a priority preemption: not one of SGLang's retract_decode counters
    assert (stats.preemptions_total, stats.retracted_requests_total) == (1, 0)


def test_kv_retractions_are_counted_with_their_tokens() -> None:
    engine = SimEngine(dataclasses.replace(CPU, kv_capacity_tokens=400, new_token_ratio=0.0))
    for i in range(4):
        engine.submit(SimRequest(f"r{i}", prompt(1000 * (i + 1), 50), 60), 0.0)
    done = finished(run(engine))
    stats = engine.stats()
    retracted = sum(e.times.retractions for e in done.values() if e.times is not None)
    assert stats.retracted_requests_total == stats.preemptions_total == retracted >= 1
    assert stats.retracted_input_tokens_total == 50 * retracted
    assert 0 < stats.retracted_output_tokens_total < 60 * retracted


# ----- abort, determinism, validation
def test_abort_frees_the_request() -> None:
    engine = SimEngine(CPU)
    engine.submit(SimRequest("a", prompt(1, 20), 100), 0.0)
    engine.submit(SimRequest("b", prompt(100, 20), 10), 0.0)
    engine.advance(0.3)
    assert engine.abort("a") and not engine.abort("a") and not engine.abort("zzz")
    events = run(engine)
    assert {e.rid for e in events} == {"b"}
    stats = engine.stats()
    assert stats.num_running_reqs == 0 and stats.num_used_tokens == 0


def test_same_seed_same_events_and_other_seed_other_timing() -> None:
    def trace(seed: int) -> list[SimEvent]:
        engine = SimEngine(H100, seed=seed)
        for i in range(8):
            engine.submit(SimRequest(f"r{i}", prompt(100 * i, 64), 32, priority=i % 3), 0.001 * i)
        return run(engine)

    assert trace(7) == trace(7)
    other = trace(8)
    assert [e.token_id for e in other] == [e.token_id for e in trace(7)]  # text depends on the prompt only
    assert [e.time_s for e in other] != [e.time_s for e in trace(7)]  # step jitter depends on the seed


def test_rejects_invalid_requests() -> None:
    engine = SimEngine(CPU)
    engine.submit(SimRequest("a", prompt(1, 5), 5), 0.0)
    with pytest.raises(ValueError, match="duplicate"):
        engine.submit(SimRequest("a", prompt(1, 5), 5), 0.0)
    with pytest.raises(ValueError):
        engine.submit(SimRequest("b", (), 5), 0.0)
    with pytest.raises(ValueError, match="exceeds"):
        engine.submit(SimRequest("c", prompt(1, 8000), 500), 0.0)


def test_flush_cache_only_when_idle() -> None:
    engine = SimEngine(CPU)
    engine.submit(SimRequest("a", prompt(1, 50), 40), 0.0)
    engine.advance(0.2)
    assert not engine.flush_cache()
    run(engine)
    assert engine.cache.total_tokens > 0 and engine.flush_cache() and engine.cache.total_tokens == 0


def test_the_simulated_engine_preempts_as_launched_workers_do() -> None:
    """One threshold for both: what the launcher passes SGLang and what the simulation models."""
    from service.config.settings import EngineSettings

    assert SimEngine(CPU).preemption_threshold == EngineSettings().priority_preemption_threshold == 0

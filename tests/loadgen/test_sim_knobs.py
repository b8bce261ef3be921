"""The simulated worker's performance knobs (loadgen/sim/knobs.py) and DCGM-style gauges
(loadgen/sim/dcgm.py): each knob changes exactly the part of the step model it names, in virtual time; the
network knobs delay what the worker sends over HTTP; the gauges follow the steps the engine ran."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadgen.sim.__main__ import main as cli_main
from loadgen.sim.__main__ import parse_args
from loadgen.sim.dcgm import (
    DECODE_DRAM,
    DECODE_SM,
    GPU_FACTS,
    PREFILL_DRAM,
    PREFILL_SM,
    activity,
    nvlink_bytes_per_token,
)
from loadgen.sim.engine import SimEngine, SimEvent, SimRequest, StepRecord
from loadgen.sim.knobs import PerfKnobs, apply_to_engine
from loadgen.sim.profiles import get_profile
from loadgen.sim.server import SimServer
from tests.support.servers import ThreadedServer

H100 = get_profile("llama-3.1-8b-h100")
TP8 = get_profile("llama-3.1-70b-h100-tp8")
SPLIT = dataclasses.replace(TP8, mixed_chunk=False, step_jitter=0.0)
"""SGLang's default scheduler (prefill and decode steps apart), no jitter: step times are the model's."""


def run(engine: SimEngine) -> list[SimEvent]:
    events: list[SimEvent] = []
    while (t := engine.next_event_time()) is not None:
        events.extend(engine.advance(t))
    return events


def one_request(knobs: PerfKnobs, prompt: int = 1000, tokens: int = 5) -> tuple[float, float]:
    """TTFT and inter-token gap (s) of one request alone on an engine with ``knobs``."""
    engine = SimEngine(SPLIT)
    apply_to_engine(engine, SPLIT, knobs)
    engine.submit(SimRequest("r", tuple(range(prompt)), tokens), 0.0)
    times = [e.time_s for e in run(engine)]
    return times[0], times[1] - times[0]


def test_prefill_and_decode_factors_slow_their_own_steps_only() -> None:
    ttft, gap = one_request(PerfKnobs())
    floor = SPLIT.ttft_floor_ms / 1000
    assert ttft == pytest.approx(floor + SPLIT.prefill_step_ms(1000) / 1000)
    slow_prefill = one_request(PerfKnobs(prefill_factor=4))
    assert slow_prefill[0] - floor == pytest.approx(4 * (ttft - floor)) and slow_prefill[1] == pytest.approx(
        gap
    )
    slow_decode = one_request(PerfKnobs(decode_factor=3))
    assert slow_decode == (pytest.approx(ttft), pytest.approx(3 * gap))


def test_phantom_sequences_join_every_decode_step_and_hold_kv() -> None:
    knobs = PerfKnobs(extra_batch=100, extra_context_tokens=2000)
    _, gap = one_request(knobs, prompt=10, tokens=3)
    # the step after the first token: the request's context (10 prompt + 1 output) and 100 phantoms
    assert gap * 1000 == pytest.approx(SPLIT.decode_step_ms(101, 11 + 100 * 2000))
    engine = SimEngine(SPLIT)
    apply_to_engine(engine, SPLIT, knobs)
    engine.submit(SimRequest("r", tuple(range(10)), 50), 0.0)
    engine.advance(0.05)
    stats = engine.stats()
    assert stats.num_running_reqs == 101 and stats.num_used_tokens >= 200_000
    run(engine)
    assert engine.stats().num_running_reqs == 0 and engine.stats().num_used_tokens == 0  # idle: none


def test_an_uncached_share_misses_the_prefix_cache() -> None:
    def cached(share: float) -> int:
        engine = SimEngine(SPLIT)
        apply_to_engine(engine, SPLIT, PerfKnobs(uncached_share=share))
        for rid in ("first", "second"):
            engine.submit(SimRequest(rid, tuple(range(500)), 2), engine.now)
            events = run(engine)
        return events[-1].cached_tokens

    assert cached(0.0) == 499 and cached(1.0) == 0


def test_a_small_kv_pool_and_low_reservation_retract_and_the_defaults_come_back() -> None:
    engine = SimEngine(SPLIT)
    apply_to_engine(engine, SPLIT, PerfKnobs(kv_capacity_tokens=900, new_token_ratio=0.05))
    assert (engine.profile.kv_capacity_tokens, engine.profile.new_token_ratio) == (900, 0.05)
    for i in range(4):
        engine.submit(SimRequest(f"r{i}", tuple(range(i * 1000, i * 1000 + 150)), 100), 0.0)
    finished = {e.rid for e in run(engine) if e.finish_reason}
    assert finished == {"r0", "r1", "r2", "r3"} and engine.stats().preemptions_total > 0
    apply_to_engine(engine, SPLIT, PerfKnobs())
    assert engine.profile == SPLIT


def test_the_knobs_refuse_what_is_out_of_bounds() -> None:
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        PerfKnobs(prefill_factor=0.5)
    with pytest.raises(ValueError, match="Extra inputs"):
        PerfKnobs.model_validate({"prefil_factor": 2})
    assert parse_args(["--decode-factor", "3", "--network-delay-s", "0.1"]).knobs == PerfKnobs(
        decode_factor=3, network_delay_s=0.1
    )
    with pytest.raises(SystemExit) as exc:
        parse_args(["--uncached-share", "2"])
    assert exc.value.code == 2
    assert cli_main(["--dcgm", "--profile", "smollm2-135m-cpu2"]) == 2  # a CPU profile has no GPU


def step(
    kind: str, start: float, end: float, prefill: float, decode: float, pf: float = 1, df: float = 1
) -> StepRecord:
    return StepRecord(kind, start, end, prefill, decode, pf, df, 10)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("steps", "sm", "dram"),
    [
        ([], 0.0, 0.0),
        ([step("prefill", 0.0, 1.0, 1000, 0)], PREFILL_SM, PREFILL_DRAM),
        ([step("decode", 0.0, 1.0, 0, 1000)], DECODE_SM, DECODE_DRAM),
        ([step("decode", 0.0, 0.5, 0, 500)], DECODE_SM / 2, DECODE_DRAM / 2),  # idle half the window
        ([step("decode", -1.0, 0.5, 0, 1500)], DECODE_SM / 2, DECODE_DRAM / 2),  # a third inside
        # decode 4x slower: the lost bandwidth keeps the memory interface busy
        ([step("decode", 0.0, 1.0, 0, 250, df=4)], DECODE_SM, (DECODE_DRAM + 3) / 4),
        # prefill 4x slower: compute-bound, the memory interface does no more work
        ([step("prefill", 0.0, 1.0, 250, 0, pf=4)], PREFILL_SM, PREFILL_DRAM / 4),
        # a mixed step, half its time prefill
        ([step("mixed", 0.0, 1.0, 500, 500)], (PREFILL_SM + DECODE_SM) / 2, (PREFILL_DRAM + DECODE_DRAM) / 2),
    ],
)
def test_dcgm_activity_follows_the_steps(steps: list[StepRecord], sm: float, dram: float) -> None:
    act = activity(steps, now_s=1.0, window_s=1.0)
    assert (act.sm, act.dram) == (pytest.approx(sm), pytest.approx(dram))


def test_nvlink_traffic_is_tensor_parallel_all_reduce() -> None:
    facts = GPU_FACTS[TP8.name]
    # 2 all-reduces x 80 layers x 8192 x 2 B x 2 (8 - 1) / 8 per token
    assert nvlink_bytes_per_token(facts, 8) == 2 * 80 * 8192 * 2 * 2 * 7 / 8
    assert nvlink_bytes_per_token(GPU_FACTS[H100.name], 1) == 0


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[SimServer, str]]:
    server = SimServer(TP8, seed=1, model_name="sim-model", dcgm=True, hostname="node-a")
    with ThreadedServer(server.app) as running:
        yield server, running.url


def gen(stream: bool) -> dict[str, object]:
    return {
        "text": "one two three",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "stream": stream,
    }


def test_the_network_knobs_delay_headers_chunks_and_whole_answers(served: tuple[SimServer, str]) -> None:
    server, url = served

    def timed(stream: bool) -> tuple[float, float, list[str]]:
        start = time.monotonic()
        with httpx.stream("POST", f"{url}/generate", json=gen(stream), timeout=30) as resp:
            head = time.monotonic() - start
            texts = [
                line.split('"text":"')[1].split('"')[0] for line in resp.iter_lines() if '"text"' in line
            ]
        return head, time.monotonic() - start, texts

    fast_head, fast_total, fast_texts = timed(True)
    fast_whole = timed(False)[1]
    assert (
        httpx.post(f"{url}/sim/knobs", json={"network_delay_s": 0.3, "chunk_delay_s": 0.05}).status_code
        == 200
    )
    try:
        head, total, texts = timed(True)
        whole = timed(False)[1]
    finally:
        httpx.post(f"{url}/sim/knobs", json={})
    assert texts == fast_texts and len(texts) == 4  # the same answer, later
    assert head >= 0.3 + 0.05 and head > fast_head
    # five chunks (four tokens and [DONE]) through a link of 50 ms each, after 300 ms of latency
    assert total >= 0.3 + 5 * 0.05 and total > fast_total
    assert whole >= 0.35 and whole > fast_whole
    assert server.knobs == PerfKnobs()


def test_knobs_route_validates_and_reports(served: tuple[SimServer, str]) -> None:
    server, url = served
    bad = httpx.post(f"{url}/sim/knobs", json={"decode_factor": 0})
    assert bad.status_code == 400 and "decode_factor" in bad.json()["error"]["message"]
    assert httpx.post(f"{url}/sim/knobs", json={"decode_factor": 2}).json()["decode_factor"] == 2
    try:
        assert server.engine.decode_slowdown == 2
        assert httpx.get(f"{url}/sim/state").json()["knobs"]["decode_factor"] == 2
    finally:
        httpx.post(f"{url}/sim/knobs", json={})
    assert server.engine.decode_slowdown == 1


async def test_dcgm_gauges_are_exported_per_gpu_and_move_with_the_load() -> None:
    server = SimServer(TP8, seed=2, model_name="sim-model", dcgm=True, hostname="node-b")

    def gauges(text: str) -> dict[tuple[str, str], float]:
        return {
            (s.name, s.labels["gpu"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("DCGM_")
        }

    with ThreadedServer(server.app) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            idle = gauges((await http.get("/metrics")).text)
            body = {"text": "word " * 500, "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
            calls = [asyncio.create_task(http.post("/generate", json=body)) for _ in range(8)]
            await asyncio.sleep(0.5)
            busy = gauges((await http.get("/metrics")).text)
            await asyncio.gather(*calls)
    names = {
        "DCGM_FI_PROF_SM_ACTIVE",
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE",
    }
    names |= {"DCGM_FI_PROF_NVLINK_TX_BYTES", "DCGM_FI_PROF_NVLINK_RX_BYTES"}
    assert {name for name, _ in idle} == names and {gpu for _, gpu in idle} == {str(i) for i in range(8)}
    assert idle[("DCGM_FI_PROF_SM_ACTIVE", "0")] == 0 and idle[("DCGM_FI_PROF_NVLINK_TX_BYTES", "0")] == 0
    assert busy[("DCGM_FI_PROF_SM_ACTIVE", "0")] > 0.3 and busy[("DCGM_FI_PROF_DRAM_ACTIVE", "3")] > 0.3
    assert busy[("DCGM_FI_PROF_NVLINK_TX_BYTES", "7")] > 0
    used, free = busy[("DCGM_FI_DEV_FB_USED", "0")], busy[("DCGM_FI_DEV_FB_FREE", "0")]
    assert used + free == GPU_FACTS[TP8.name].memory_mib and 60_000 < used < GPU_FACTS[TP8.name].memory_mib

"""Per-worker {worker, model} series (service/observability/pool_gauges.py, issue 28): the engine gauges the
gateway scrapes from each worker's /metrics (a simulated SGLang worker, and a worker serving known values
with SGLang's priority and data-parallel labels), left out once stale or gone from the pool; the gateway's
queue per worker; and the parse of SGLang's text they rest on."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from loadgen.sim.profiles import get_profile
from loadgen.sim.server import SimServer
from service.config.settings import UpstreamSettings
from service.observability.metrics import GatewayMetrics
from service.observability.pool_gauges import ENGINE_SERIES, PoolGauges, scrape_engines
from service.workers.client import SGLangClient
from service.workers.worker_info import WorkerLoad, parse_load
from tests.conftest import ADMIN_TOKEN
from tests.support.prometheus import SimStack
from tests.support.servers import ThreadedServer

# what SGLang 0.5.23 writes with --enable-priority-scheduling, two DP ranks, speculative decoding: each
# gauge's total under priority="", its breakdown under priority="<n>" (metrics_collector.py,
# _log_gauge_queue_count)
SGLANG_TEXT = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="m",priority=""} 5.0
sglang:num_running_reqs{dp_rank="0",model_name="m",priority="0"} 2.0
sglang:num_running_reqs{dp_rank="0",model_name="m",priority="10"} 3.0
sglang:num_running_reqs{dp_rank="1",model_name="m",priority=""} 4.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",model_name="m",priority=""} 7.0
sglang:num_queue_reqs{dp_rank="0",model_name="m",priority="10"} 7.0
sglang:num_queue_reqs{dp_rank="1",model_name="m",priority=""} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",model_name="m",priority=""} 0.25
sglang:token_usage{dp_rank="1",model_name="m",priority=""} 0.75
# TYPE sglang:token_usage_ratio_unrelated gauge
sglang:token_usage_ratio_unrelated{model_name="m"} 9.0
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{dp_rank="0",model_name="m",priority=""} 0.5
sglang:cache_hit_rate{dp_rank="1",model_name="m",priority=""} 0.25
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{dp_rank="0",model_name="m",priority=""} 100.0
sglang:gen_throughput{dp_rank="1",model_name="m",priority=""} 50.0
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{dp_rank="0",model_name="m",priority=""} 3.0
sglang:spec_accept_length{dp_rank="1",model_name="m",priority=""} 2.0
# TYPE sglang:spec_accept_rate gauge
sglang:spec_accept_rate{dp_rank="0",model_name="m",priority=""} 0.5
sglang:spec_accept_rate{dp_rank="1",model_name="m",priority=""} 0.7
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 3.0
sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 4.0
sglang:e2e_request_latency_seconds_count{model_name="m"} 4.0
sglang:e2e_request_latency_seconds_sum{model_name="m"} 2.5
"""


def test_parse_load_reads_totals_across_ranks_and_skips_the_priority_breakdown() -> None:
    load = parse_load(SGLANG_TEXT)
    assert (load.running, load.queued) == (9, 8)  # 5 + 4 and 7 + 1: the breakdown is not counted again
    assert load.kv_usage == 0.75  # the fullest rank
    assert load.cache_hit_rate == pytest.approx(0.375)
    assert load.gen_throughput == 150.0
    assert load.spec_accept_length == pytest.approx(2.5)
    assert load.spec_accept_rate == pytest.approx(0.6)
    bare = parse_load("sglang:num_running_reqs 2\nsglang:token_usage 0.5\n")
    assert bare == WorkerLoad(2, 0, 0.5)  # absent series: None, not 0
    assert bare.cache_hit_rate is None and bare.spec_accept_length is None


@dataclass
class Worker:
    """A pool worker as the gauges read it."""

    url: str
    model: str | None = "m"
    healthy: bool = True
    in_flight: int = 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def samples(text: str, name: str) -> dict[tuple[str, str], float]:
    """``name``'s samples in exposition ``text``, keyed (worker, model)."""
    return {
        (s.labels["worker"], s.labels["model"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def metrics_app(text: Callable[[], str]) -> Starlette:
    async def route(_: Request) -> PlainTextResponse:
        return PlainTextResponse(text())

    return Starlette(routes=[Route("/metrics", route)])


async def stop(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and wait for it (its connection closed before the client is)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def run_until(gauges: PoolGauges, task: asyncio.Task[None], urls: set[str]) -> None:
    """Wait (up to 10 s) until ``gauges`` holds a reading of every URL in ``urls``."""
    for _ in range(200):
        if urls <= set(gauges.readings):
            return
        await asyncio.sleep(0.05)
    task.cancel()
    raise AssertionError(f"no reading of {urls - set(gauges.readings)}")


async def test_engine_gauges_are_scraped_and_re_exported_per_worker_and_model() -> None:
    clock = Clock()
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, 10, engine_scrape_s=5.0)
    metrics.pool._clock = clock
    down = "http://127.0.0.1:1"  # nothing listens: never read
    with ThreadedServer(metrics_app(lambda: SGLANG_TEXT)) as server:
        workers = [Worker(server.url, "m"), Worker(down, None)]
        async with SGLangClient(UpstreamSettings()) as client:
            task = asyncio.create_task(scrape_engines(metrics.pool, client, lambda: workers, 5.0))
            await run_until(metrics.pool, task, {server.url})
            await stop(task)
        await asyncio.sleep(0.01)  # the closed sockets go before the server's blocking shutdown
        text = metrics.scrape(workers).decode()
    expected = {
        "radixgate_engine_running_requests": 9,
        "radixgate_engine_queued_requests": 8,
        "radixgate_engine_token_usage": 0.75,
        "radixgate_engine_cache_hit_rate": 0.375,
        "radixgate_engine_gen_throughput": 150,
        "radixgate_engine_spec_accept_length": 2.5,
        "radixgate_engine_spec_accept_rate": 0.6,
    }
    assert {s.name for s in ENGINE_SERIES} == set(expected)
    for name, value in expected.items():
        assert samples(text, name) == {(server.url, "m"): pytest.approx(value)}, name
    # the gateway's own queue per worker, with the unknown model of a worker that serves none
    assert samples(text, "radixgate_worker_queued_requests") == {(server.url, "m"): 0, (down, "unknown"): 0}

    clock.now += 15.5  # over three periods with no new reading: left out
    assert samples(metrics.scrape(workers).decode(), "radixgate_engine_token_usage") == {}
    clock.now -= 15.5
    # a worker that left the pool is left out at once
    assert samples(metrics.scrape(workers[1:]).decode(), "radixgate_engine_token_usage") == {}


async def test_a_simulated_worker_s_engine_is_seen_under_load() -> None:
    """loadgen.sim's worker (SGLang's names): two long generations running show as 2 running requests and
    KV in use; the values equal the worker's own /metrics read at the same time."""
    sim = SimServer(get_profile("llama-3.1-8b-h100"), model_name="sim-model", speed=0.5)
    metrics = GatewayMetrics(CollectorRegistry(), 10, engine_scrape_s=0.05)
    with ThreadedServer(sim.app) as server:
        workers = [Worker(server.url, "sim-model")]
        body = {"text": "a question " * 50, "sampling_params": {"max_new_tokens": 150, "ignore_eos": True}}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            calls = [asyncio.create_task(http.post("/generate", json=body)) for _ in range(2)]
            for _ in range(200):
                if parse_load((await http.get("/metrics")).text).running == 2:
                    break
                await asyncio.sleep(0.05)
            own = parse_load((await http.get("/metrics")).text)
            async with SGLangClient(UpstreamSettings()) as client:
                metrics.pool.readings.clear()
                task = asyncio.create_task(scrape_engines(metrics.pool, client, lambda: workers, 0.05))
                await run_until(metrics.pool, task, {server.url})
                await stop(task)
            text = metrics.scrape(workers).decode()
            assert all(r.status_code == 200 for r in await asyncio.gather(*calls))
    assert own.running == 2 and own.kv_usage > 0
    key = (server.url, "sim-model")
    assert samples(text, "radixgate_engine_running_requests") == {key: 2}
    assert samples(text, "radixgate_engine_token_usage")[key] > 0
    assert key in samples(text, "radixgate_engine_cache_hit_rate")
    assert key in samples(text, "radixgate_engine_gen_throughput")
    assert samples(text, "radixgate_engine_spec_accept_length") == {}  # no speculative decoding


def test_queued_follows_the_cores_and_a_model_change_leaves_no_stale_series() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, 10)
    queued = {"http://a": 3}
    metrics.pool.queued_of = lambda: queued
    a, b = Worker("http://a", None), Worker("http://b", "m")
    queued_now = "radixgate_worker_queued_requests"
    text = metrics.scrape([a, b]).decode()
    assert samples(text, queued_now) == {("http://a", "unknown"): 3, ("http://b", "m"): 0}
    a.model, queued["http://a"] = "m", 1  # its model became known
    text = metrics.scrape([a, b]).decode()
    assert samples(text, queued_now) == {("http://a", "m"): 1, ("http://b", "m"): 0}
    # the registry itself still holds the old series: only the scrape leaves it out
    assert ("http://a", "unknown") in samples(generate_latest(registry).decode(), queued_now)
    # no engine scrape configured: no engine families at all
    assert "radixgate_engine_" not in text


def test_a_gateway_exports_its_workers_engines_and_its_own_health(
    redis_url: str, stub_model_dir: Path
) -> None:
    """The app wires it all: a gateway in front of two simulated workers shows each worker's engine
    gauges under its URL and model, its queue per worker, event-loop lag, and the store calls a request
    with quotas makes."""
    obs = {"engine_scrape_s": 0.1, "loop_lag_interval_s": 0.02}
    with (
        SimStack(redis_url, stub_model_dir, observability=obs) as stack,
        httpx.Client(base_url=stack.url, timeout=30) as http,
    ):
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        limits = {"requests_per_min": 1000, "tokens_per_min": 1_000_000}
        body = {"id": "gauged", "name": "g", "priority_class": "standard", "quotas": limits}
        assert http.post("/admin/tenants", json=body, headers=admin).status_code == 201
        issued = http.post("/admin/tenants/gauged/keys", json={"name": "k"}, headers=admin).json()
        auth = {"Authorization": f"Bearer {issued['api_key']}"}
        for i in range(2):
            resp = http.post("/v1/chat/completions", json=stack.chat(f"q{i}"), headers=auth)
            assert resp.status_code == 200, resp.text
        workers = {(s.url, SimStack.MODEL) for s in stack.worker_servers}
        text = ""
        for _ in range(100):
            text = http.get("/metrics").text
            engines = set(samples(text, "radixgate_engine_token_usage"))
            if engines == workers and "QuotaLimiter.settle" in text:
                break
            time.sleep(0.05)
    for series in ENGINE_SERIES[:5]:  # the simulation has no speculative decoding
        assert set(samples(text, series.name)) == workers, series.name
    assert set(samples(text, "radixgate_worker_queued_requests")) == workers
    calls = {
        s.labels["op"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "radixgate_store_call_seconds_count"
    }
    assert calls.get("QuotaLimiter.reserve", 0) >= 1 and calls.get("QuotaLimiter.settle", 0) >= 1, calls
    assert calls.get("TenantStore.authenticate", 0) >= 1, calls
    lag = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "radixgate_event_loop_lag_seconds_count"
    ]
    assert lag and lag[0] > 0

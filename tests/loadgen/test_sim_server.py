"""The simulated SGLang worker over HTTP, parsed with the gateway's own SGLangClient (the contract)."""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadgen.sim.__main__ import main as cli_main
from loadgen.sim.__main__ import parse_args
from loadgen.sim.profiles import get_profile
from loadgen.sim.server import SimServer
from service.config.settings import UpstreamSettings
from service.workers.client import SGLangClient, UpstreamError
from tests.support.paths import REPO
from tests.support.servers import ThreadedServer, free_port

SYSTEM = "You are a helpful assistant of the radixgate test suite. " * 20


@pytest.fixture(scope="module")
def sim() -> Iterator[tuple[SimServer, str]]:
    server = SimServer(get_profile("llama-3.1-8b-h100"), seed=1, speed=1.0, model_name="sim-model")
    with ThreadedServer(server.app) as running:
        yield server, running.url


@pytest.fixture
def url(sim: tuple[SimServer, str]) -> Iterator[str]:
    server, base = sim
    yield base
    httpx.post(f"{base}/sim/fault", json={"mode": "none"})
    assert server.fault.mode == "none"


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as shared:
        yield shared


@pytest.fixture
async def client() -> AsyncIterator[SGLangClient]:
    settings = UpstreamSettings(connect_timeout_s=10.0, read_timeout_s=10.0, pool_timeout_s=10.0)
    async with SGLangClient(settings) as shared:
        yield shared


def body(text: str, n: int = 8, **extra: Any) -> dict[str, Any]:
    return {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}, **extra}


def sse_payloads(raw: str) -> list[Any]:
    chunks = raw.split("\n\n")
    assert chunks[-1] == "" and chunks[-2] == "data: [DONE]"
    assert all(c.startswith("data: ") for c in chunks[:-1])
    return [json.loads(c[6:]) for c in chunks[:-2]]


def test_non_stream_format_is_sglangs(url: str) -> None:
    resp = httpx.post(f"{url}/generate", json=body("hello there, world", 5, rid="ns-1", priority=3))
    assert resp.status_code == 200
    data = resp.json()
    assert set(data) == {"text", "meta_info"}
    meta = data["meta_info"]
    assert set(meta) == {
        "id",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "finish_reason",
        "e2e_latency",
        *SCHEDULER_TIMES,
        *FINISHED_TIMES,
    }
    assert meta["id"] == "ns-1" and meta["prompt_tokens"] == 4  # hello | there | , | world
    assert meta["completion_tokens"] == 5 and len(data["text"].split()) == 5
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert 0 < meta["e2e_latency"] < 1
    assert_times_in_order(meta)


SCHEDULER_TIMES = {"num_retractions", "queue_time", "forward_entry_time", "prefill_finished_time"}
FINISHED_TIMES = {
    "request_received_ts",
    "api_server_dispatch_finish_ts",
    "first_token_latency",
    "request_finished_ts",
    "response_sent_to_client_ts",
    "decode_throughput",
}


def assert_times_in_order(meta: dict[str, Any]) -> None:
    """The last chunk's SGLang 0.5.23 timing fields tell one schedule: received, floor (tokenizer),
    queue, prefill to the first token, decode, sent; an idle worker's queue is empty."""
    received, dispatched = meta["request_received_ts"], meta["api_server_dispatch_finish_ts"]
    entry, prefilled = meta["forward_entry_time"], meta["prefill_finished_time"]
    assert received < dispatched <= entry < prefilled < meta["request_finished_ts"]
    assert time.time() - 60 < received < time.time()  # Unix times (speed 1: the wall clock's)
    assert meta["queue_time"] == pytest.approx(entry - dispatched, abs=1e-5)
    assert meta["first_token_latency"] == pytest.approx(prefilled - received, abs=1e-5)
    assert meta["e2e_latency"] == pytest.approx(meta["request_finished_ts"] - received, abs=1e-5)
    decode_s = meta["request_finished_ts"] - prefilled
    assert meta["decode_throughput"] == pytest.approx((meta["completion_tokens"] - 1) / decode_s, rel=1e-3)
    assert meta["response_sent_to_client_ts"] >= prefilled and meta["num_retractions"] == 0


def test_stream_chunks_carry_the_scheduler_times_and_the_last_the_tokenizer_s(url: str) -> None:
    resp = httpx.post(f"{url}/generate", json=body("time me please, simulator", 4, stream=True))
    metas = [p["meta_info"] for p in sse_payloads(resp.text)]
    assert SCHEDULER_TIMES | {"response_sent_to_client_ts"} <= set(metas[0])
    assert not FINISHED_TIMES - {"response_sent_to_client_ts"} & set(metas[0])  # the last chunk's only
    assert all(set(m) >= SCHEDULER_TIMES and not FINISHED_TIMES & set(m) for m in metas[1:-1])
    assert set(metas[-1]) >= FINISHED_TIMES
    assert_times_in_order(metas[-1])
    for name in ("forward_entry_time", "prefill_finished_time", "queue_time"):  # set once, then kept
        assert len({m[name] for m in metas}) == 1
    # a stream's first chunk went out once; the last one repeats that time (SGLang sets it once)
    assert metas[0]["response_sent_to_client_ts"] == metas[-1]["response_sent_to_client_ts"]


def test_stream_format_is_cumulative_sse_ending_with_done(url: str) -> None:
    resp = httpx.post(f"{url}/generate", json=body("stream me please", 4, stream=True))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(resp.text)
    assert [p["meta_info"]["completion_tokens"] for p in payloads] == [1, 2, 3, 4]
    assert [p["meta_info"]["finish_reason"] for p in payloads] == [
        None,
        None,
        None,
        {"type": "length", "length": 4},
    ]
    texts = [p["text"] for p in payloads]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert texts[-1] == httpx.post(f"{url}/generate", json=body("stream me please", 4)).json()["text"]


async def test_gateway_client_parses_both_forms_identically(url: str, client: SGLangClient) -> None:
    whole = await client.generate(url, body("the gateway client reads this", 12))
    chunks = [c async for c in client.stream(url, body("the gateway client reads this", 12))]
    assert "".join(c.text for c in chunks) == whole.text
    assert (whole.completion_tokens, whole.finish_reason, whole.prompt_tokens) == (12, "length", 5)
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])


async def test_shared_system_prompt_is_cached_on_the_second_request(url: str, client: SGLangClient) -> None:
    first = await client.generate(url, body(SYSTEM + "Question one?", 4))
    second = await client.generate(url, body(SYSTEM + "Another question entirely?", 4))
    assert first.cached_tokens == 0
    assert second.cached_tokens >= len(SYSTEM.split()) + 20  # the whole shared prefix


async def test_sampled_output_depends_on_seed_greedy_does_not(url: str, client: SGLangClient) -> None:
    def sampled(seed: int) -> dict[str, Any]:
        return {"text": "tell me", "sampling_params": {"max_new_tokens": 8, "temperature": 0.8, "seed": seed}}

    a, b, c = [await client.generate(url, sampled(s)) for s in (1, 1, 2)]
    assert a.text == b.text != c.text


async def test_abort_request_ends_the_stream_with_abort(
    url: str, client: SGLangClient, http: httpx.AsyncClient
) -> None:
    stream = client.stream(url, body("a very long answer", 5000, rid="to-abort"))
    first = await stream.__anext__()
    assert first.completion_tokens == 1
    assert await client.abort(url, "to-abort")
    with pytest.raises(UpstreamError, match="aborted"):
        async for _ in stream:
            pass
    state = (await http.get(f"{url}/sim/state")).json()
    assert state["stats"]["num_running_reqs"] == 0 and state["live_requests"] == 0


def test_client_disconnect_aborts_the_request(url: str) -> None:
    with httpx.stream("POST", f"{url}/generate", json=body("disconnect me", 5000, stream=True)) as resp:
        next(resp.iter_lines())
    deadline = time.monotonic() + 5
    while httpx.get(f"{url}/sim/state").json()["stats"]["num_running_reqs"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert httpx.get(f"{url}/sim/state").json()["stats"]["num_running_reqs"] == 0


def test_metrics_use_sglang_names(url: str) -> None:
    httpx.post(f"{url}/generate", json=body("count me in the metrics", 3))
    text = httpx.get(f"{url}/metrics").text
    for name in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:cache_hit_rate",
        "sglang:token_usage",
        "sglang:gen_throughput",
        "sglang:num_used_tokens",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:cached_tokens_total",
        "sglang:time_to_first_token_seconds_bucket",
        "sglang:inter_token_latency_seconds_bucket",
        "sglang:e2e_request_latency_seconds_count",
    ):
        assert f'{name}{{model_name="sim-model"' in text or f'{name}{{le="' in text, name


def test_info_and_health_routes(url: str) -> None:
    for path in ("/health", "/health_generate", "/get_model_info", "/model_info"):
        assert httpx.get(f"{url}{path}").status_code == 200, path
    for path in ("/get_server_info", "/server_info"):
        info = httpx.get(f"{url}{path}").json()
        assert info["max_total_num_tokens"] == 400_000 and info["simulator"]["profile"] == "llama-3.1-8b-h100"
    models = httpx.get(f"{url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["sim-model"]
    assert httpx.post(f"{url}/flush_cache").status_code == 200


def test_bad_requests_get_400_in_sglangs_error_shape(url: str) -> None:
    bads: list[dict[str, Any]] = [
        {"sampling_params": {}},
        {"text": "x", "input_ids": [1]},
        body("x", 0),
        body("", 3),
    ]
    for bad in bads:
        resp = httpx.post(f"{url}/generate", json=bad)
        assert resp.status_code == 400 and resp.json()["error"]["message"], bad
    too_long = body("word " * 10, 200_000)
    assert httpx.post(f"{url}/generate", json=too_long).status_code == 400


async def test_fault_http_500_then_off_after_count(
    url: str, client: SGLangClient, http: httpx.AsyncClient
) -> None:
    assert (await http.post(f"{url}/sim/fault", json={"mode": "http_500", "count": 1})).status_code == 200
    assert (await http.get(f"{url}/health_generate")).status_code == 500
    with pytest.raises(UpstreamError) as info:
        await client.generate(url, body("fail once", 3))
    assert info.value.status == 500 and info.value.retryable
    assert (await client.generate(url, body("fine again", 3))).completion_tokens == 3


async def test_fault_crash_mid_stream_breaks_the_stream(
    url: str, client: SGLangClient, http: httpx.AsyncClient
) -> None:
    await http.post(f"{url}/sim/fault", json={"mode": "crash_mid_stream", "after_tokens": 2})
    got: list[int] = []
    with pytest.raises(UpstreamError):
        async for chunk in client.stream(url, body("crash in the middle", 10)):
            got.append(chunk.completion_tokens)
    assert got == [1, 2]


async def test_fault_slow_scales_step_time(url: str, client: SGLangClient, http: httpx.AsyncClient) -> None:
    fast = (await client.generate(url, body("how fast is this", 20))).text
    started = time.monotonic()
    await client.generate(url, body("how fast is this one", 20))
    normal = time.monotonic() - started
    await http.post(f"{url}/sim/fault", json={"mode": "slow", "factor": 8})
    started = time.monotonic()
    await client.generate(url, body("how slow is this one", 20))
    slow = time.monotonic() - started
    assert fast and slow > 3 * normal


def test_cli_parses_and_lists_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["--profile", "llama-3.1-70b-h100-tp8", "--port", "1234", "--speed", "2"])
    assert (args.profile, args.port, args.speed) == ("llama-3.1-70b-h100-tp8", 1234, 2.0)
    assert cli_main(["--list-profiles"]) == 0
    assert "smollm2-135m-cpu2" in capsys.readouterr().out
    assert cli_main(["--profile", "nope"]) == 2


def test_speed_scales_wall_time_and_eos_gives_stop() -> None:
    cpu = get_profile("smollm2-135m-cpu2")  # ~1.7 simulated s for 32 tokens
    server = SimServer(cpu, speed=10.0, eos_per_token=0.2)
    with ThreadedServer(server.app) as running:
        started = time.monotonic()
        no_eos = body("one two three four", 32)
        no_eos["sampling_params"]["ignore_eos"] = True
        resp = httpx.post(f"{running.url}/generate", json=no_eos)
        wall = time.monotonic() - started
        meta = resp.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 32
        assert 1.4 < meta["e2e_latency"] < 2.0  # simulated seconds
        assert wall < 0.6  # ten times faster on the wall clock
        stopped = httpx.post(f"{running.url}/generate", json=body("one two three four", 32)).json()
        assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
        assert stopped["meta_info"]["completion_tokens"] < 32


def test_cli_process_serves_and_exits_on_a_crash_fault(tmp_path: Path) -> None:
    port = free_port()
    args = ["--profile", "llama-3.1-8b-h100", "--port", str(port), "--fault", "crash_mid_stream"]
    args += ["--fault-after-tokens", "2", "--fault-exit"]
    proc = subprocess.Popen([sys.executable, "-m", "loadgen.sim", *args], cwd=REPO)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        lines: list[str] = []
        with (
            pytest.raises(httpx.HTTPError),
            httpx.stream("POST", f"{base}/generate", json=body("crash now", 50, stream=True)) as resp,
        ):
            lines.extend(ln for ln in resp.iter_lines() if ln.startswith("data: "))
        assert len(lines) == 2
        assert proc.wait(timeout=10) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--speed", "0"], "--speed: above 0"),
        (["--speed", "-1"], "--speed: above 0"),
        (["--eos-per-token", "2"], "--eos-per-token: from 0 to 1"),
        (["--eos-per-token", "-0.1"], "--eos-per-token: from 0 to 1"),
        (["--fault-factor", "0.5"], "--fault-factor: at least 1"),
        (["--fault-after-tokens", "-1"], "--fault-after-tokens: at least 0"),
        (["--port", "70000"], "--port: from 0 to 65535"),
    ],
)
def test_cli_refuses_out_of_range_numbers_with_a_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # they raised a ValueError or pydantic traceback (speed, fault factor) or ran with a chance above 1
    with pytest.raises(SystemExit) as exited:
        cli_main(args)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err

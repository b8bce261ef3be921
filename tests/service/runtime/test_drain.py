"""Stopping is a state the gateway announces (service/runtime/drain.py): SIGTERM to ``python -m service
serve``, one
process and several, in front of the fake worker with slow answers.

From the signal on ``/readyz`` answers 503 and a new request 503 with ``Retry-After`` (or, once the drain
is over, its connection is refused; never accepted and left unanswered); what is in flight finishes, up to
``shutdown.drain_timeout_s``, after which a longer stream is ended (error event, aborted at the worker,
charged what was generated); each request is settled once; the drain's start and end are logged with the
counts; the exit status is 0."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from structlog.testing import capture_logs

from service.config.settings import Settings
from service.config.shutdown import KUBERNETES_GRACE_S, ShutdownSettings
from service.errors import GatewayError
from service.runtime.drain import Drain, drain_on_signals
from tests.service.runtime.test_gateway_processes import MODEL, gateway_env, issue_key, ready_pids, wait_for
from tests.support.fake_worker import TOKENS, FakeWorker
from tests.support.servers import ThreadedServer, free_port

STEP_S = 0.25  # the fake worker's pause per word
SHORT = 6  # words of the requests that finish within the deadline (1.5 s)
LONG = 40  # words of the stream that outlives it (10 s)
DRAIN_S = 3.0


def start(env: dict[str, str], log: Path, port: int, processes: int) -> subprocess.Popen[bytes]:
    """``python -m service serve`` with ``env``, once ``/readyz`` says ready and each process logged
    ``gateway_ready``."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()[-2000:]
        assert time.monotonic() < deadline, "gateway not ready in 60 s"
        try:
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
            if ready and len(ready_pids(log)) == processes:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def chat(base: str, key: str, max_tokens: int, stream: bool) -> tuple[int, list[Any]]:
    """One chat completion on a fresh connection: (status, the stream's events as parsed JSON with
    ``"[DONE]"`` for the end, or the one JSON body)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{base}/v1/chat/completions"
    if not stream:
        resp = httpx.post(url, json=body, headers=headers, timeout=30)
        return resp.status_code, [resp.json()]
    events: list[Any] = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return resp.status_code, events


def log_lines(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def test_default_drain_fits_kubernetes_grace_period() -> None:
    shutdown = Settings().shutdown
    assert shutdown.drain_timeout_s + shutdown.end_timeout_s + 1.0 < KUBERNETES_GRACE_S


@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_drains_what_is_in_flight_and_exits_0(
    processes: int, redis_url: str, stub_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "gateway.log"
    base = f"http://127.0.0.1:{port}"
    prefix = f"drain{processes}:"
    fake = FakeWorker()
    fake.tokens = list(TOKENS) + [" w"] * (LONG - len(TOKENS))
    with ThreadedServer(fake.app) as upstream:
        env = gateway_env(redis_url, stub_model_dir, upstream.url, port, processes, prefix)
        env["RADIXGATE_SHUTDOWN__DRAIN_TIMEOUT_S"] = str(DRAIN_S)
        env["RADIXGATE_SCHEDULER__WINDOW_MODE"] = "fixed"  # all 13 at the worker at once
        env["RADIXGATE_SCHEDULER__WINDOW_INITIAL"] = "32"
        proc = start(env, log, port, processes)
        try:
            key = issue_key(base, "drainer")
            fake.delay_s = STEP_S
            with concurrent.futures.ThreadPoolExecutor(13) as pool:
                streams = [pool.submit(chat, base, key, SHORT, True) for _ in range(8)]
                plain = [pool.submit(chat, base, key, SHORT, False) for _ in range(4)]
                long = pool.submit(chat, base, key, LONG, True)
                wait_for(lambda: len(fake.received) == 13, "13 requests at the worker", timeout_s=20)
                # the parent alone, as Kubernetes and docker stop do (it passes it on to its processes)
                signalled = time.monotonic()
                os.kill(proc.pid, signal.SIGTERM)
                # from the signal until the exit: readiness 503, a new request 503 with Retry-After, or a
                # refused connection; never one accepted and left unanswered (a short client timeout)
                answers: list[tuple[str, int | str]] = []
                while proc.poll() is None:
                    for path, ask in (
                        ("/readyz", lambda: httpx.get(f"{base}/readyz", timeout=2)),
                        (
                            "chat",
                            lambda: httpx.post(
                                f"{base}/v1/chat/completions",
                                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                                headers={"Authorization": f"Bearer {key}"},
                                timeout=2,
                            ),
                        ),
                    ):
                        try:
                            resp = ask()
                        except httpx.ConnectError:
                            answers.append((path, "refused"))
                            continue
                        except httpx.TimeoutException:
                            raise AssertionError(f"{path} accepted and left unanswered: {answers}") from None
                        assert resp.status_code == 503, (path, resp.status_code, resp.text)
                        assert resp.headers["retry-after"] == "1"
                        assert resp.headers["connection"] == "close"
                        if path == "chat":
                            assert resp.json()["error"]["code"] == "shutting_down"
                            assert resp.json()["error"]["type"] == "service_unavailable"
                        else:
                            assert resp.json() == {"ready": False, "draining": True}
                        answers.append((path, resp.status_code))
                    assert time.monotonic() - signalled < 30, "still running 30 s after SIGTERM"
                    time.sleep(0.1)
                code = proc.wait()
                results = [f.result() for f in streams + plain]
                long_status, long_events = long.result()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert ("/readyz", 503) in answers and ("chat", 503) in answers, answers
    # what was in flight finished
    for status, events in results[:8]:
        assert status == 200 and events[-1] == "[DONE]", events
        assert not any("error" in e for e in events[:-1])
    for status, (body,) in results[8:]:
        assert status == 200 and body["usage"]["completion_tokens"] == SHORT, body
    # the long stream was ended at the deadline: an error event, then [DONE]; aborted at its worker
    assert long_status == 200 and long_events[-1] == "[DONE]", long_events
    assert long_events[-2]["error"]["code"] == "shutting_down", long_events[-2:]
    (long_rid,) = [b["rid"] for b in fake.received if b["sampling_params"]["max_new_tokens"] == LONG]
    assert long_rid in fake.aborted
    # each settled once: one request line per request, and the usage of all 13 (the long one charged
    # what was generated)
    lines = log_lines(log)
    served = [line for line in lines if line.get("event") == "request" and line.get("tenant") == "drainer"]
    assert len({line["request_id"] for line in served}) == len(served) == 13, served
    assert sorted(line["status"] for line in served) == [200] * 12 + [503]
    usage = redis.Redis.from_url(redis_url, decode_responses=True).hgetall(f"{prefix}usage:drainer")
    assert (int(usage["requests"]), int(usage["errors"])) == (13, 1), usage
    generated = int(usage["completion_tokens"]) - 12 * SHORT
    assert 1 <= generated < LONG, usage
    # the drain's start and end, with the counts, in each process
    started = [line for line in lines if line.get("event") == "drain_started"]
    finished = [line for line in lines if line.get("event") == "drain_finished"]
    assert len(started) == len(finished) == processes, text[-3000:]
    assert sum(line["in_flight"] for line in started) == 13
    assert all(line["signal"] == "SIGTERM" for line in started)
    assert sum(line["ended"] for line in finished) == 1
    assert all(line["in_flight"] == 0 for line in finished)
    assert all(DRAIN_S <= line["drain_s"] < DRAIN_S + 5 for line in finished if line["ended"])


async def test_signals_drain_first_a_second_sigterm_is_ignored_and_a_second_sigint_cuts_it_short() -> None:
    """The handlers of service/runtime/drain.py in this (main) thread: the first signal begins the drain, the
    handler installed before (uvicorn's) is called with it once the drain is over; a second SIGTERM (the
    parent passing it on to a process group signalled as a whole) changes nothing; a second SIGINT (Ctrl-C
    again) ends what is in flight at once."""
    calls: list[int] = []
    ended: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: calls.append(sig))
    previous_int = signal.signal(signal.SIGINT, lambda sig, frame: calls.append(sig))
    try:

        def end_all(error: GatewayError) -> int:
            ended.append(error.code)
            return 1

        drain = Drain(ShutdownSettings(drain_timeout_s=30.0, end_timeout_s=0.2), end_all)
        drain.enter()  # one request in flight, which never ends
        with drain_on_signals(drain):
            signal.raise_signal(signal.SIGTERM)
            await asyncio.sleep(0.05)
            assert drain.draining and not drain.finished
            signal.raise_signal(signal.SIGTERM)
            await asyncio.sleep(0.05)
            assert ended == [] and calls == []
            signal.raise_signal(signal.SIGINT)
            await asyncio.wait_for(drain.wait(), 5)
            assert ended == ["shutting_down"] and calls == [signal.SIGTERM]
            signal.raise_signal(signal.SIGINT)  # after the drain: straight to the previous handler
            assert calls == [signal.SIGTERM, signal.SIGINT]
        assert signal.getsignal(signal.SIGTERM) is not None and drain.in_flight == 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


async def test_a_drain_with_nothing_in_flight_ends_at_once() -> None:
    stopped = asyncio.Event()
    drain = Drain(ShutdownSettings(drain_timeout_s=30.0), lambda e: 0)
    with capture_logs() as logs:
        assert drain.begin(stopped.set, "SIGTERM") and not drain.begin(stopped.set, "SIGTERM")
        await asyncio.wait_for(stopped.wait(), 1)
    assert [(e["event"], e["in_flight"]) for e in logs] == [("drain_started", 0), ("drain_finished", 0)]

"""A worker that leaves mid-stream (issue 29): a gateway in front of two simulated SGLang workers
(loadgen.sim, slowed down so that a stream lasts seconds), streams running on worker A, then A drained over
the admin API.

- With a short ``upstream.worker_drain_deadline_s`` the streams still running at the deadline resume on B
  (mid-stream failover) and a non-streamed request running on A starts again on B: every client gets its
  whole answer (200, ``[DONE]``, exactly ``max_tokens`` tokens, no error), A runs nothing soon after the
  deadline, and the quota ledger balances (what Redis charged = what the clients were served).
- With a long one the streams finish on A.
- Either way, no new request goes to A from the drain on, and A leaves the pool once nothing runs on it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import ADMIN_TOKEN
from tests.support.prometheus import SimStack

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MAX_TOKENS = 20
SPEED = 0.03  # about 0.15 s a token: a stream lasts about 3 s
STREAMS = 3


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not in {timeout_s} s: {what}"
        time.sleep(0.02)


class StreamRun:
    """One streamed chat completion read whole on its own thread: what the client saw."""

    def __init__(self, base: str, key: str, question: str) -> None:
        self.base, self.key, self.question = base, key, question
        self.status = 0
        self.deltas = 0  # chunks with content
        self.done = False
        self.errors: list[Any] = []
        self.usage: dict[str, int] | None = None
        self.finish: str | None = None
        self.started = threading.Event()  # the first content chunk came

    def __call__(self) -> StreamRun:
        body = {
            "model": SimStack.MODEL,
            "messages": [{"role": "user", "content": self.question}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers = {"Authorization": f"Bearer {self.key}"}
        with (
            httpx.Client(base_url=self.base, timeout=60) as http,
            http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp,
        ):
            self.status = resp.status_code
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    self.done = True
                    continue
                event = orjson.loads(data)
                if "error" in event:
                    self.errors.append(event["error"])
                self.usage = event.get("usage") or self.usage
                for choice in event.get("choices", ()):
                    if choice.get("delta", {}).get("content"):
                        self.deltas += 1
                        self.started.set()
                    self.finish = choice.get("finish_reason") or self.finish
        return self


def sim_state(stack: SimStack, index: int) -> dict[str, Any]:
    url = stack.worker_servers[index].url
    state: dict[str, Any] = httpx.get(f"{url}/sim/state", timeout=5).json()
    return state


def worker_entry(http: httpx.Client, url: str) -> dict[str, Any]:
    entries: list[dict[str, Any]] = http.get("/admin/workers", headers=ADMIN).json()["data"]
    return next(w for w in entries if w["url"] == url.rstrip("/"))


def moves(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith('radixgate_retries_total{kind="worker_drained"}'):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("deadline_s", [0.3, 60.0])
def test_a_drained_workers_streams_finish_there_or_resume_elsewhere_at_the_deadline(
    redis_url: str, stub_model_dir: Path, deadline_s: float
) -> None:
    upstream = {"worker_drain_deadline_s": deadline_s, "max_attempts": 1}  # a move is not an attempt
    with (
        SimStack(redis_url, stub_model_dir, workers=2, speed=SPEED, upstream=upstream) as stack,
        httpx.Client(base_url=stack.url, timeout=60) as http,
    ):
        a, b = (server.url.rstrip("/") for server in stack.worker_servers)
        key = stack.new_key(http)
        tenant = http.get("/admin/tenants", headers=ADMIN).json()["data"][-1]["id"]
        for url in (a, b):
            wait_for(lambda url=url: bool(worker_entry(http, url)["healthy"]), f"{url} healthy")
        # B drained first, so that everything starts on A; then B active again
        http.post(f"/admin/workers/{worker_entry(http, b)['id']}/drain", headers=ADMIN).raise_for_status()
        wait_for(lambda: not worker_entry(http, b)["in_pool"], "B out of the pool")
        runs = [
            StreamRun(stack.url, key, f"Tell me about rolling restarts, part {i}.") for i in range(STREAMS)
        ]
        with concurrent.futures.ThreadPoolExecutor(STREAMS + 1) as pool:
            streams = [pool.submit(run) for run in runs]
            whole = {
                "model": SimStack.MODEL,
                "messages": [{"role": "user", "content": "And a non-streamed answer, please."}],
                "max_tokens": MAX_TOKENS,
            }
            answer = pool.submit(
                httpx.post,
                f"{stack.url}/v1/chat/completions",
                json=whole,
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            )
            for run in runs:
                assert run.started.wait(20), "no first token"
            assert sim_state(stack, 0)["live_requests"] == STREAMS + 1
            assert http.post("/admin/workers", json={"url": b}, headers=ADMIN).status_code == 201
            wait_for(
                lambda: bool(worker_entry(http, b)["in_pool"] and worker_entry(http, b)["healthy"]), "B back"
            )
            calls_a, calls_b = sim_state(stack, 0)["generate_calls"], sim_state(stack, 1)["generate_calls"]
            drained_at = time.monotonic()
            http.post(f"/admin/workers/{worker_entry(http, a)['id']}/drain", headers=ADMIN).raise_for_status()
            # from the drain on, new requests go to B only
            for _ in range(3):
                short = http.post(
                    "/v1/chat/completions",
                    json={**whole, "max_tokens": 1},
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert short.status_code == 200, short.text
            if deadline_s < 1:  # moved: A runs nothing soon after the deadline, long before the streams end
                wait_for(lambda: sim_state(stack, 0)["live_requests"] == 0, "A idle", timeout_s=2.5)
                assert time.monotonic() - drained_at < 2.5
                assert any(run.deltas < MAX_TOKENS for run in runs)  # they were still running then
            results = [s.result() for s in streams]
            whole_answer = answer.result()
        for run in results:
            assert run.status == 200 and run.errors == [] and run.done, (run.status, run.errors)
            assert run.usage is not None and run.usage["completion_tokens"] == MAX_TOKENS
            assert run.deltas == MAX_TOKENS and run.finish == "length"
        assert whole_answer.status_code == 200, whole_answer.text
        assert whole_answer.json()["usage"]["completion_tokens"] == MAX_TOKENS
        assert sim_state(stack, 0)["generate_calls"] == calls_a  # nothing new went to A
        continued = sim_state(stack, 1)["generate_calls"] - calls_b - 3  # beside the 3 short requests
        if deadline_s < 1:
            assert continued == STREAMS + 1 and moves(http) == STREAMS + 1
        else:
            assert continued == 0 and moves(http) == 0
        wait_for(lambda: not worker_entry(http, a)["in_pool"], "A out of the pool")  # idle: removed
        # the ledger: what Redis charged is what the clients were served, each token once
        served = {
            "requests": STREAMS + 1 + 3,
            "completion_tokens": (STREAMS + 1) * MAX_TOKENS + 3,
            "prompt_tokens": sum(r.usage["prompt_tokens"] for r in results if r.usage)
            + whole_answer.json()["usage"]["prompt_tokens"]
            + 3 * short.json()["usage"]["prompt_tokens"],
        }

        def charged() -> dict[str, int]:
            usage = http.get(f"/admin/tenants/{tenant}/usage", headers=ADMIN).json()
            return {name: int(usage.get(name, 0)) for name in served}

        wait_for(lambda: charged() == served, f"charged {charged()} == served {served}", timeout_s=10)

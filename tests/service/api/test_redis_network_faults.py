"""Network faults between the gateway and Redis (issue 31), injected by a TCP proxy in front of a real
redis-server (:class:`tests.support.fault_proxy.FaultProxy`): added latency with jitter, connections
reset in the middle of replies, and a black hole (the proxy accepts and never answers, as a Redis whose
host went away behind a stateful firewall; unlike ``CLIENT PAUSE``, no byte comes back).

For each: what the client gets (an answer, or 503 ``store_unavailable`` with Retry-After in OpenAI's shape,
never a 500), how long a refusal takes (bounded by ``redis.socket_timeout_s``), and the ledger: after the
fault, each tenant's usage counts exactly the answers and tokens its client received.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tenancy.layout import KeyLayout
from tests.service.api.test_api import ADMIN, auth, chat, new_tenant, usage_of
from tests.service.api.test_store_unavailable import (
    HUGE,
    ask,
    assert_unavailable,
    gateway_client,
    settings_for,
)
from tests.support.fake_worker import FakeWorker
from tests.support.fault_proxy import FaultProxy
from tests.support.servers import ThreadedServer

LEDGER = {"requests_per_min": 0.001, "request_burst": 100_000, "tokens_per_min": 0.001, "token_burst": 10**7}
"""Buckets that never refuse here and refill next to nothing: what is left shows what was charged."""


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeWorker, str]]:
    worker = FakeWorker()
    with ThreadedServer(worker.app) as server:
        yield worker, server.url


@pytest.fixture
def proxy(redis_url: str) -> Iterator[FaultProxy]:
    with FaultProxy(redis_url, seed=3) as p:
        yield p


def served_tokens(answers: list[httpx.Response]) -> tuple[int, int]:
    """(answers with status 200, their completion tokens)."""
    ok = [r for r in answers if r.status_code == 200]
    return len(ok), sum(r.json()["usage"]["completion_tokens"] for r in ok)


def wait_for_usage(
    http: httpx.Client, tenant_id: str, requests: int, timeout_s: float = 20
) -> dict[str, int]:
    """The tenant's usage once it counts ``requests`` (settles land in the background), or the last read."""
    deadline = time.monotonic() + timeout_s
    while True:
        usage = usage_of(http, tenant_id)
        if usage["requests"] >= requests or time.monotonic() > deadline:
            return usage
        time.sleep(0.1)


def test_a_slow_jittery_link_to_redis_serves_everything(
    proxy: FaultProxy, stub_model_dir: Path, fake: tuple[FakeWorker, str]
) -> None:
    """40 ms more per reply and up to 30 ms of jitter (each request's reservation and settle wait for it,
    under the 0.5 s socket timeout): every request answered, every one charged once."""
    settings = settings_for(proxy.url, stub_model_dir, fake[1], "rnf-slow:")
    with gateway_client(settings) as http:
        tenant_id, key = new_tenant(http, quotas=HUGE)  # every request reserves in Redis
        proxy.latency_s, proxy.jitter_s = 0.04, 0.03
        answers = [ask(http, key, max_tokens=3) for _ in range(10)]
        proxy.clear()
        assert [r.status_code for r in answers] == [200] * 10
        usage = wait_for_usage(http, tenant_id, 10)
        assert (usage["requests"], usage["completion_tokens"]) == served_tokens(answers) == (10, 30)


def test_connections_reset_mid_reply_give_answers_or_clean_503s_and_a_balanced_ledger(
    proxy: FaultProxy, stub_model_dir: Path, fake: tuple[FakeWorker, str]
) -> None:
    """Every Redis connection is reset (RST) after 1,500 bytes of replies, in the middle of one: redis-py
    retries a broken connection once, so most requests are answered; the rest get 503 in OpenAI's shape,
    never a 500; the usage counts exactly what was answered, and a 503 is charged nothing."""
    settings = settings_for(proxy.url, stub_model_dir, fake[1], "rnf-reset:")
    with gateway_client(settings) as http:
        tenant_id, key = new_tenant(http, quotas=LEDGER)
        proxy.reset_after_bytes = 1500
        answers = [ask(http, key, max_tokens=2) for _ in range(60)]
        resets = proxy.resets
        proxy.clear()
        assert resets >= 3, resets
        for resp in answers:
            if resp.status_code != 200:
                assert_unavailable(resp, "store_unavailable")
        assert sum(r.status_code == 200 for r in answers) >= 20
        served = served_tokens(answers)
        usage = wait_for_usage(http, tenant_id, served[0])
        assert (usage["requests"], usage["completion_tokens"]) == served
        # the buckets (no refill to speak of) were charged once per answer, settled to what it used: a
        # take whose reply was cut and which redis-py sent again was not taken twice
        with redis.Redis.from_url(proxy.target_url, decode_responses=True) as r:
            levels = {
                b: float(r.hget(KeyLayout("rnf-reset:").bucket(tenant_id, b), "level"))
                for b in ("requests", "tokens")
            }
        assert levels["requests"] == pytest.approx(LEDGER["request_burst"] - served[0], abs=0.01)
        spent = usage["prompt_tokens"] + usage["completion_tokens"]
        assert levels["tokens"] == pytest.approx(LEDGER["token_burst"] - spent, abs=0.01), spent


def test_a_black_holed_redis_gives_503_within_the_socket_timeout_and_recovers_with_the_ledger_whole(
    proxy: FaultProxy, stub_model_dir: Path, fake: tuple[FakeWorker, str]
) -> None:
    """Redis's link goes dark while a stream is being answered: the stream finishes (its settle waits and
    lands once Redis is back), new requests get 503 store_unavailable within about the socket timeout
    (0.5 s) instead of hanging, readiness says not ready; once the link is back the gateway recovers by
    itself, and the usage counts exactly the answers the client received."""
    worker = fake[0]
    settings = settings_for(proxy.url, stub_model_dir, fake[1], "rnf-hole:")
    with gateway_client(settings) as http:
        tenant_id, key = new_tenant(http, quotas=HUGE)
        assert ask(http, key, max_tokens=2).status_code == 200
        worker.delay_s = 0.3  # 4 words: 1.2 s
        streamed: list[str] = []

        def stream() -> None:
            body = chat(max_tokens=4, stream=True, stream_options={"include_usage": True})
            with httpx.stream(
                "POST",
                f"{str(http.base_url).rstrip('/')}/v1/chat/completions",
                json=body,
                headers=auth(key),
                timeout=30,
            ) as resp:
                streamed.extend(ln for ln in resp.iter_lines() if ln.startswith("data: "))

        held = threading.Thread(target=stream)
        held.start()
        time.sleep(0.4)  # the stream was admitted (its reservation is in Redis) and is generating
        proxy.black_hole = True
        try:
            worker.delay_s = 0.0
            for _ in range(3):
                started = time.monotonic()
                assert_unavailable(ask(http, key), "store_unavailable")
                assert time.monotonic() - started < 3.0  # socket timeout 0.5 s, pool wait 1 s: bounded
            assert http.get("/readyz").status_code == 503
            held.join(timeout=10)
            assert streamed and streamed[-1] == "data: [DONE]"  # the admitted stream finished
        finally:
            proxy.clear()
        deadline = time.monotonic() + 15
        while (resp := ask(http, key, max_tokens=2)).status_code != 200:
            assert_unavailable(resp, "store_unavailable")
            assert time.monotonic() < deadline, "the gateway did not recover"
            time.sleep(0.2)
        assert http.get("/readyz").status_code == 200
        # the first answer, the stream (4 tokens, its settle held back during the fault), the last answer
        usage = wait_for_usage(http, tenant_id, 3)
        assert (usage["requests"], usage["completion_tokens"]) == (3, 2 + 4 + 2), usage
        assert http.get(f"/admin/tenants/{tenant_id}", headers=ADMIN).status_code == 200

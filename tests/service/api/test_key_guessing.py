"""The bad-key throttle (issue 31): an address that keeps presenting unknown API keys (or wrong admin tokens)
gets ``bad_key_burst`` tries, then ``bad_key_rate_per_s``, each refusal a 429 before any Redis read; other
addresses, and valid keys from them, are untouched."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from service.api.errors import APIError
from service.api.key_guessing import BadKeyThrottle
from service.app import create_app
from service.config.security import SecuritySettings
from tests.conftest import ADMIN_TOKEN, MODEL, gateway_settings
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
_ids = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(host: str, headers: dict[str, str] | None = None) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": "GET", "path": "/", "headers": raw, "client": (host, 5000)})


def refused(throttle: BadKeyThrottle, req: Request) -> int | None:
    """The Retry-After of a refusal, or None when the request may go on."""
    try:
        throttle.check(req)
    except APIError as err:
        assert err.status == 429 and err.code == "too_many_bad_keys"
        return int(err.headers["Retry-After"])
    return None


def test_an_address_gets_its_burst_then_the_rate() -> None:
    clock = Clock()
    throttle = BadKeyThrottle(SecuritySettings(bad_key_rate_per_s=0.5, bad_key_burst=3), clock)
    guesser, other = request("10.0.0.1"), request("10.0.0.2")
    for _ in range(3):
        assert refused(throttle, guesser) is None
        throttle.failed(guesser)
    assert refused(throttle, guesser) == 2  # one unit back in 2 s at 0.5/s
    assert refused(throttle, other) is None  # another address: untouched
    clock.now += 1.0
    assert refused(throttle, guesser) == 1
    clock.now += 1.0
    assert refused(throttle, guesser) is None  # one more try
    throttle.failed(guesser)
    assert refused(throttle, guesser) == 2
    # a guesser that keeps going gets rate x time after its burst: 10 tries in 20 s
    allowed = 0
    for _ in range(200):
        clock.now += 0.1
        if refused(throttle, guesser) is None:
            allowed += 1
            throttle.failed(guesser)
    assert allowed == 10


def test_addresses_are_bounded_and_the_header_names_them() -> None:
    clock = Clock()
    settings = SecuritySettings(
        bad_key_burst=1, bad_key_addresses=2, client_address_header="X-Forwarded-For", bad_key_rate_per_s=0.01
    )
    throttle = BadKeyThrottle(settings, clock)
    via = {"x-forwarded-for": "203.0.113.7, 10.0.0.9"}  # the proxy appends the peer it saw: the last entry
    assert throttle.address(request("10.0.0.1", via)) == "10.0.0.9"
    assert throttle.address(request("10.0.0.1")) == "10.0.0.1"  # no header: the peer
    for host in ("a", "b", "c"):
        throttle.failed(request("proxy", {"x-forwarded-for": host}))
    assert len(throttle) == 2  # "a", the least recently failed, was dropped
    assert refused(throttle, request("proxy", {"x-forwarded-for": "a"})) is None
    assert refused(throttle, request("proxy", {"x-forwarded-for": "c"})) is not None


def test_off_counts_nothing() -> None:
    throttle = BadKeyThrottle(SecuritySettings(bad_key_rate_per_s=0), Clock())
    for _ in range(100):
        throttle.failed(request("10.0.0.1"))
    assert refused(throttle, request("10.0.0.1")) is None and len(throttle) == 0


@pytest.fixture(scope="module")
def http(redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]) -> Iterator[httpx.Client]:
    settings = gateway_settings(redis_url, stub_model_dir, [fake[1]])
    security = SecuritySettings(bad_key_burst=5, bad_key_rate_per_s=0.01, client_address_header="X-Real-IP")
    app = create_app(settings.model_copy(update={"security": security}))
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def key_reads(http: httpx.Client) -> float:
    """Redis reads of API keys so far (``radixgate_store_call_seconds_count``, TenantStore.authenticate)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(http.get("/metrics").text)
        for sample in family.samples
        if sample.name == "radixgate_store_call_seconds_count"
        and sample.labels.get("op") == "TenantStore.authenticate"
    )


def test_a_guesser_is_refused_before_its_guesses_cost_redis_reads(http: httpx.Client) -> None:
    tenant = f"guess{next(_ids)}"
    assert http.post("/admin/tenants", json={"id": tenant, "name": tenant}, headers=ADMIN).status_code == 201
    real = http.post(f"/admin/tenants/{tenant}/keys", json={"name": "k"}, headers=ADMIN).json()["api_key"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    guesser = {"X-Real-IP": "198.51.100.7"}
    before = key_reads(http)
    statuses = []
    for n in range(15):
        guess = f"rg-{n:012x}." + "A" * 43  # well-formed: each would be a Redis read
        resp = http.post(
            "/v1/chat/completions", json=body, headers=guesser | {"Authorization": f"Bearer {guess}"}
        )
        statuses.append(resp.status_code)
        if resp.status_code == 429:
            assert (
                resp.json()["error"]["code"] == "too_many_bad_keys" and int(resp.headers["Retry-After"]) >= 1
            )
    assert statuses == [401] * 5 + [429] * 10
    assert key_reads(http) - before == 5  # the 10 refused cost no read
    # the guesser's real key is refused too while its bucket is empty; another address is served
    mine = {"Authorization": f"Bearer {real}"}
    assert http.post("/v1/chat/completions", json=body, headers=guesser | mine).status_code == 429
    assert (
        http.post("/v1/chat/completions", json=body, headers={"X-Real-IP": "192.0.2.1"} | mine).status_code
        == 200
    )
    # admin tokens are guessed from the same bucket
    admin_guesser = {"X-Real-IP": "198.51.100.8"}
    wrong = [
        http.get("/admin/tenants", headers=admin_guesser | {"Authorization": "Bearer " + "g" * 24})
        for _ in range(7)
    ]
    assert [r.status_code for r in wrong] == [403] * 5 + [429] * 2
    assert http.get("/admin/tenants", headers={"X-Real-IP": "192.0.2.2"} | ADMIN).status_code == 200


def test_the_rate_a_guesser_gets_with_the_defaults(
    redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]
) -> None:
    """One client guessing as fast as it can for 6 s against the default throttle (burst 20, 0.5/s): 401s
    (each one Redis read) = 20 + 0.5 x the time; everything else 429. Prints the figures (``pytest -s``)."""
    app = create_app(gateway_settings(redis_url, stub_model_dir, [fake[1]]))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    statuses: dict[int, int] = {}
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        started = time.monotonic()
        n = 0
        while (elapsed := time.monotonic() - started) < 6.0:
            guess = {"Authorization": f"Bearer rg-{n:012x}." + "A" * 43}
            status = http.post("/v1/chat/completions", json=body, headers=guess).status_code
            statuses[status] = statuses.get(status, 0) + 1
            n += 1
    print(f"\n{n} guesses in {elapsed:.1f} s ({n / elapsed:.0f}/s): {statuses}")
    assert set(statuses) <= {401, 429}
    assert 20 + int(0.5 * elapsed) - 2 <= statuses[401] <= 20 + int(0.5 * elapsed) + 1

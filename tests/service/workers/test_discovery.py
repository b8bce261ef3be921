"""DNS worker discovery against a real DNS server (dnslib) and a real Redis: the shared registry follows the
records, and two gateway replicas serve and drain what it found."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from service.app import create_app
from service.config.discovery import DiscoverySettings
from service.config.settings import Settings
from service.workers.discovery import DnsDiscovery
from service.workers.registry import WorkerRegistry
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_admin_workers import wait_for, workers
from tests.service.api.test_api import MODEL, assert_openai_error, auth, chat, new_tenant
from tests.support.dns_server import RecordsResolver, dns_server
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer

NAME = "workers.radixgate.test"


class Clock:
    """A monotonic clock the test moves, s."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def dns() -> Iterator[tuple[RecordsResolver, str]]:
    with dns_server() as served:
        yield served


@pytest.fixture
async def registry(redis_url: str) -> AsyncIterator[WorkerRegistry]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    await client.flushdb()
    yield WorkerRegistry(client, "disc:")
    await client.aclose()


def follower(ns: str, registry: WorkerRegistry, clock: Clock, **settings: object) -> DnsDiscovery:
    config = DiscoverySettings.model_validate(
        {"dns_name": NAME, "nameserver": ns, "timeout_s": 1, "remove_after_s": 60, **settings}
    )
    return DnsDiscovery(config, registry, clock)


async def test_the_registry_follows_the_records(
    dns: tuple[RecordsResolver, str], registry: WorkerRegistry
) -> None:
    records, ns = dns
    clock = Clock()
    first = follower(ns, registry, clock)
    records.set(NAME, ["10.1.0.1", "10.1.0.2", "fd00::7"])
    assert await first.sync()
    a, b, v6 = "http://10.1.0.1:30000", "http://10.1.0.2:30000", "http://[fd00::7]:30000"
    assert await registry.entries() == {a: "active", b: "active", v6: "active"}
    assert await registry.discovered() == {a: False, b: False, v6: False}
    # b's pod goes: drained at once, still registered
    records.set(NAME, ["10.1.0.1", "fd00::7"])
    clock.now += 10
    assert await first.sync()
    assert (await registry.entries())[b] == "draining"
    # a replica that starts now (it never saw b go) and b's record coming back: active again
    late = follower(ns, registry, clock)
    records.set(NAME, ["10.1.0.1", "10.1.0.2", "fd00::7"])
    assert await late.sync()
    assert (await registry.entries())[b] == "active"
    # gone again, for remove_after_s: removed
    records.set(NAME, ["10.1.0.1", "fd00::7"])
    assert await first.sync()
    clock.now += 59
    assert await first.sync()
    assert (await registry.entries())[b] == "draining"
    clock.now += 1
    assert await first.sync()
    assert b not in await registry.entries()
    assert b not in await registry.discovered()


async def test_a_failed_lookup_changes_nothing_and_an_empty_answer_drains(
    dns: tuple[RecordsResolver, str], registry: WorkerRegistry
) -> None:
    records, ns = dns
    clock = Clock()
    found = follower(ns, registry, clock)
    records.set(NAME, ["10.1.0.1"])
    assert await found.sync()
    records.failing = True  # SERVFAIL: a DNS outage must not drain a healthy fleet
    clock.now += 3600
    assert not await found.sync()
    assert await registry.entries() == {"http://10.1.0.1:30000": "active"}
    records.failing = False
    del records.records[NAME]  # NXDOMAIN: the Service has no ready pod
    assert await found.sync()
    assert await registry.entries() == {"http://10.1.0.1:30000": "draining"}


async def test_a_worker_the_admin_registered_is_never_taken_over(
    dns: tuple[RecordsResolver, str], registry: WorkerRegistry
) -> None:
    records, ns = dns
    clock = Clock()
    await registry.add("http://10.1.0.1:30000")
    await registry.set_mode("http://10.1.0.1:30000", "draining")  # the admin drains it on purpose
    records.set(NAME, ["10.1.0.1"])
    found = follower(ns, registry, clock)
    assert await found.sync()
    assert await registry.entries() == {"http://10.1.0.1:30000": "draining"}
    assert await registry.discovered() == {}
    records.set(NAME, [])
    clock.now += 3600
    assert await found.sync()
    assert await registry.entries() == {"http://10.1.0.1:30000": "draining"}  # nor removed by discovery


def _shared_free_port(hosts: list[str]) -> int:
    """A TCP port free on each of ``hosts`` (127.0.0.0/8 addresses)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = int(probe.getsockname()[1])
        try:
            for host in hosts[1:]:
                with socket.socket() as other:
                    other.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every host")


def replica(redis_url: str, model_dir: Path, ns: str, port: int) -> ThreadedServer:
    settings = Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": "discovery-replicas:"},
            "engine": {"served_model_name": MODEL},
            "upstream": {"workers": [], "health_interval_s": 0.1},
            "api": {"tokenizer_path": str(model_dir)},
            "discovery": {"dns_name": NAME, "nameserver": ns, "port": port, "interval_s": 0.2},
        }
    )
    return ThreadedServer(create_app(settings))


def test_two_replicas_serve_and_drain_the_discovered_workers(
    dns: tuple[RecordsResolver, str], redis_url: str, stub_model_dir: Path
) -> None:
    records, ns = dns
    hosts = ["127.0.0.2", "127.0.0.3"]
    port = _shared_free_port(hosts)
    fakes = [FakeWorker(), FakeWorker()]
    records.set(NAME, hosts)
    with ExitStack() as stack:
        for host, fake in zip(hosts, fakes, strict=True):
            stack.enter_context(ThreadedServer(fake.app, port=port, host=host))
        clients = []
        for _ in range(2):
            server = stack.enter_context(replica(redis_url, stub_model_dir, ns, port))
            clients.append(stack.enter_context(httpx.Client(base_url=server.url, timeout=30)))
        urls = {f"http://{host}:{port}" for host in hosts}
        for http in clients:  # both replicas serve both discovered workers
            wait_for(lambda http=http: {w["url"] for w in workers(http) if w["healthy"]} == urls)
            assert {w["source"] for w in workers(http)} == {"discovery"}
        _, key = new_tenant(clients[0])
        for http in clients:
            for _ in range(4):
                answer = http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key))
                assert answer.status_code == 200
        assert sum(len(fake.received) for fake in fakes) == 8
        # the first worker's pod goes: every replica drains it within a sync period or two
        records.set(NAME, hosts[1:])
        gone = f"http://{hosts[0]}:{port}"
        for http in clients:
            wait_for(lambda http=http: any(w["url"] == gone and not w["in_pool"] for w in workers(http)))
        before = [len(fake.received) for fake in fakes]
        for http in clients:
            for _ in range(4):
                answer = http.post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key))
                assert answer.status_code == 200
        # drained: no new requests; the other took them all
        assert [len(fake.received) for fake in fakes] == [before[0], before[1] + 8]
        # no records at all: both drained, requests get 503 no worker, never a 500
        records.set(NAME, [])
        for http in clients:
            wait_for(lambda http=http: not any(w["in_pool"] for w in workers(http)))
        assert_openai_error(
            clients[1].post("/v1/chat/completions", json=chat(max_tokens=1), headers=auth(key)), 503
        )

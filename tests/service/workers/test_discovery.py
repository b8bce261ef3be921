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
from structlog.testing import capture_logs

from service.app import create_app
from service.config.discovery import DiscoverySettings
from service.config.settings import Settings
from service.workers.discovery import DnsDiscovery, hosts_addresses, read_hosts
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


@pytest.mark.parametrize(
    ("text", "name", "addresses"),
    [
        ("127.0.0.1 localhost\n::1 localhost ip6-localhost\n", "localhost", {"127.0.0.1", "::1"}),
        ("10.0.0.5  gpu-1.lan gpu-1  # a comment\n", "GPU-1.", {"10.0.0.5"}),
        ("# 10.0.0.9 commented\n10.0.0.8 other\n", "commented", set()),
        ("not-an-ip workers\n10.0.0.7 workers\n", "workers", {"10.0.0.7"}),
        ("10.0.0.6\n", "10.0.0.6", set()),  # an address without a name names nothing
    ],
)
def test_the_hosts_file_is_read_as_the_system_reads_it(text: str, name: str, addresses: set[str]) -> None:
    assert hosts_addresses(text, name) == addresses


async def test_a_name_in_the_hosts_file_is_found_before_dns(
    dns: tuple[RecordsResolver, str], registry: WorkerRegistry, tmp_path: Path
) -> None:
    """A name the hosts file lists (``localhost`` on every machine) resolves without DNS, which has no
    record of it (dnspython alone answered NXDOMAIN for localhost, and drained every worker); a name it
    does not list still goes to DNS, and ``hosts_file: null`` turns the file off."""
    records, ns = dns
    hosts = tmp_path / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n10.2.0.1 {NAME}\n")
    records.set(NAME, ["10.1.0.1"])
    assert await follower(ns, registry, Clock(), hosts_file=str(hosts)).sync()
    assert await registry.entries() == {"http://10.2.0.1:30000": "active"}
    hosts.write_text("127.0.0.1 localhost\n")
    assert await follower(ns, registry, Clock(), hosts_file=str(hosts)).sync()
    assert (await registry.entries())["http://10.1.0.1:30000"] == "active"
    local = DiscoverySettings.model_validate({"dns_name": "localhost", "nameserver": ns, "timeout_s": 1})
    no_file = DiscoverySettings.model_validate({**local.model_dump(), "hosts_file": None})
    assert (await read_hosts(local.hosts_file, "localhost")) >= {"127.0.0.1"}  # the machine's /etc/hosts
    found = DnsDiscovery(local, registry, Clock())
    assert await found.sync() and found.state == ("resolved", "")
    dns_only = DnsDiscovery(no_file, registry, Clock())
    assert await dns_only.sync() and dns_only.state == ("no_records", "nxdomain")


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


def events(logs: list[dict[str, object]], *names: str) -> list[tuple[object, ...]]:
    """(event, reason or was) of the captured lines named ``names``, in order."""
    return [(line["event"], line.get("reason", line.get("was"))) for line in logs if line["event"] in names]


STATE_EVENTS = ("discovery_no_records", "discovery_failed", "discovery_resolved")


async def test_the_names_state_is_logged_once_per_change(
    dns: tuple[RecordsResolver, str], registry: WorkerRegistry
) -> None:
    """An answer without records was silent (every discovered worker drained, no line said why), and a
    failed lookup was logged every period: each change of the name's state is one line now."""
    records, ns = dns
    clock = Clock()
    found = follower(ns, registry, clock)
    with capture_logs() as logs:
        for _ in range(3):  # NXDOMAIN: no such name (yet)
            assert await found.sync()
        records.set(NAME, ["10.1.0.1"])
        for _ in range(2):
            assert await found.sync()
        records.set(NAME, [])  # the name is there, without an address: every worker drained
        for _ in range(3):
            assert await found.sync()
        records.failing = True  # SERVFAIL: nothing changes
        for _ in range(3):
            assert not await found.sync()
        records.failing = False
        records.set(NAME, ["10.1.0.1", "10.1.0.2"])
        for _ in range(2):
            assert await found.sync()
    assert events(logs, *STATE_EVENTS) == [
        ("discovery_no_records", "nxdomain"),
        ("discovery_resolved", "no_records"),
        ("discovery_no_records", "no_address_records"),
        ("discovery_failed", "no_nameserver_answered"),
        ("discovery_resolved", "failed"),
    ]
    first, *_ = [line for line in logs if line["event"] == "discovery_no_records"]
    assert first["name"] == NAME and first["log_level"] == "warning"
    assert "RADIXGATE_DISCOVERY__DNS_NAME" in str(first["hint"])
    (failed,) = [line for line in logs if line["event"] == "discovery_failed"]
    assert failed["log_level"] == "warning" and NAME in str(failed["error"])
    assert await registry.entries() == {"http://10.1.0.1:30000": "active", "http://10.1.0.2:30000": "active"}


async def test_a_lookup_that_times_out_is_logged_once(registry: WorkerRegistry) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as silent:  # a nameserver that never answers
        silent.bind(("127.0.0.1", 0))
        ns = f"127.0.0.1:{silent.getsockname()[1]}"
        found = follower(ns, registry, Clock(), timeout_s=0.2)
        with capture_logs() as logs:
            for _ in range(3):
                assert not await found.sync()
    assert events(logs, *STATE_EVENTS) == [("discovery_failed", "timeout")]


def test_a_gateway_whose_name_gives_no_worker_says_so_at_startup(
    dns: tuple[RecordsResolver, str], redis_url: str, stub_model_dir: Path
) -> None:
    """``no_workers_configured`` said to set upstream.workers or engine.launch, with discovery set."""
    _, ns = dns
    app = create_app(
        Settings.model_validate(
            {
                "admin_token": ADMIN_TOKEN,
                "redis": {"url": redis_url, "key_prefix": "discovery-none:"},
                "engine": {"served_model_name": MODEL},
                "upstream": {"workers": []},
                "api": {"tokenizer_path": str(stub_model_dir)},
                "discovery": {"dns_name": NAME, "nameserver": ns, "interval_s": 30},
            }
        )
    )
    with capture_logs() as logs, ThreadedServer(app):
        pass
    assert events(logs, *STATE_EVENTS) == [("discovery_no_records", "nxdomain")]
    (none,) = [line for line in logs if line["event"] == "no_workers_configured"]
    assert f"RADIXGATE_DISCOVERY__DNS_NAME={NAME}) found no worker" in str(none["hint"])
    assert "discovery_no_records or discovery_failed line" in str(none["hint"])


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

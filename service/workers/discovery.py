"""Workers found from a DNS name and shared through the worker registry (``discovery.*``).

Every replica resolves the name each ``discovery.interval_s`` (dnspython's asyncio resolver, the system's
nameservers or ``discovery.nameserver``) and applies :func:`policies.worker_discovery.plan_discovery` to
the registry: found workers are registered for every replica (each replica's pool follows the registry
within its sync period, :func:`service.workers.registry.sync_loop`), gone ones drained, then removed.
Replicas doing the same lookups write the same entries, so the work is idempotent and needs no leader. A
lookup that fails (timeout, SERVFAIL, no nameserver) changes nothing: a DNS outage must not drain a healthy
fleet. ``worker_discovered``, ``worker_record_gone`` and ``discovery_failed`` are logged.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Callable

import dns.asyncresolver
import dns.exception
import dns.resolver
import structlog

from policies.worker_discovery import plan_discovery
from service.config.discovery import DiscoverySettings, nameserver_address
from service.workers.registry import WorkerRegistry
from tenancy.errors import StoreUnavailable

log = structlog.get_logger("radixgate.discovery")


class LookupFailed(Exception):
    """The name could not be resolved this time (timeout, SERVFAIL, no nameserver answered)."""


def make_resolver(settings: DiscoverySettings) -> dns.asyncresolver.Resolver:
    """A resolver on ``settings.nameserver`` (an IP address, with a port or not), or on the system's
    configuration."""
    if settings.nameserver is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        host, port = nameserver_address(settings.nameserver)
        resolver.nameservers = [host]
        resolver.port = port
    resolver.lifetime = settings.timeout_s
    return resolver


async def lookup(resolver: dns.asyncresolver.Resolver, name: str) -> set[str]:
    """The addresses of ``name``'s A and AAAA records; empty when the name has none (NXDOMAIN, NODATA).

    Raises:
        LookupFailed: neither lookup got an answer (timeout, SERVFAIL, no nameserver).
    """
    addresses: set[str] = set()
    failures = 0
    last: Exception | None = None
    for rdtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(name, rdtype)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            continue
        except (dns.exception.Timeout, dns.resolver.NoNameservers, dns.resolver.LifetimeTimeout) as exc:
            failures += 1
            last = exc
            continue
        addresses.update(str(record.address) for record in answer)
    if failures == 2:
        raise LookupFailed(f"{name}: {last}")
    return addresses


def worker_urls(addresses: set[str], settings: DiscoverySettings) -> set[str]:
    """``scheme://address:port`` of each address (IPv6 in brackets)."""
    urls = set()
    for address in addresses:
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        urls.add(f"{settings.scheme}://{host}:{settings.port}")
    return urls


class DnsDiscovery:
    """One replica's follower of ``settings.dns_name``.

    Args:
        settings: ``discovery.*`` (``dns_name`` set).
        registry: the shared worker registry.
        clock: monotonic time, s (injected for tests).
    """

    def __init__(
        self,
        settings: DiscoverySettings,
        registry: WorkerRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert settings.dns_name is not None
        self._settings = settings
        self._name = settings.dns_name
        self._registry = registry
        self._clock = clock
        self._resolver = make_resolver(settings)
        self._gone_since: dict[str, float] = {}

    async def sync(self) -> bool:
        """One lookup and its changes to the registry; False when the lookup or Redis failed (nothing
        changed)."""
        try:
            found = worker_urls(await lookup(self._resolver, self._name), self._settings)
        except LookupFailed as exc:
            log.warning("discovery_failed", name=self._name, error=str(exc))
            return False
        try:
            discovered = await self._registry.discovered()
            plan = plan_discovery(
                found, discovered, self._gone_since, self._clock(), self._settings.remove_after_s
            )
            for url in sorted(plan.add):
                if await self._registry.add_discovered(url):
                    log.info("worker_discovered", name=self._name, worker=url)
            for url in sorted(plan.drain):
                await self._registry.set_mode(url, "draining")
                log.info("worker_record_gone", name=self._name, worker=url, action="drain")
            for url in sorted(plan.remove):
                await self._registry.remove(url)
                log.info("worker_record_gone", name=self._name, worker=url, action="remove")
        except StoreUnavailable:
            return False
        self._gone_since = dict(plan.gone_since)
        return True

    async def run(self) -> None:
        """:meth:`sync` every ``interval_s`` until cancelled (a failing sync is retried next period)."""
        while True:
            try:
                await self.sync()
            except Exception:  # a bug in one sync must not end discovery
                log.exception("discovery_sync_failed", name=self._name)
            await asyncio.sleep(self._settings.interval_s)


__all__ = ["DnsDiscovery", "LookupFailed", "lookup", "make_resolver", "worker_urls"]

"""Workers found from a DNS name and shared through the worker registry (``discovery.*``).

Every replica resolves the name each ``discovery.interval_s`` (the hosts file ``discovery.hosts_file``
first, as the system's resolver does; then dnspython's asyncio resolver, the system's nameservers or
``discovery.nameserver``) and applies :func:`policies.worker_discovery.plan_discovery` to
the registry: found workers are registered for every replica (each replica's pool follows the registry
within its sync period, :func:`service.workers.registry.sync_loop`), gone ones drained, then removed.
Replicas doing the same lookups write the same entries, so the work is idempotent and needs no leader. A
lookup that fails (timeout, SERVFAIL, no nameserver) changes nothing: a DNS outage must not drain a healthy
fleet. ``worker_discovered`` and ``worker_record_gone`` are logged per worker; the name's state is logged
when it changes, not every period: ``discovery_no_records`` (warning: NXDOMAIN or no A/AAAA record, so
every discovered worker is drained), ``discovery_failed`` (warning: the lookup failed; nothing changes),
``discovery_resolved`` (info: records again after either).
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Callable
from pathlib import Path

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
    """The name could not be resolved this time (timeout, SERVFAIL, no nameserver answered).

    Attributes:
        reason: ``"timeout"`` or ``"no_nameserver_answered"`` (SERVFAIL, REFUSED, unreachable): what a
            change of state is judged on; the message has the details.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class NoRecords(Exception):
    """The name resolved to no address: ``"nxdomain"`` (no such name, e.g. a Service with no ready pod's
    record, or a typo) or ``"no_address_records"`` (the name exists, without A or AAAA records)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


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
    """The addresses of ``name``'s A and AAAA records (at least one).

    Raises:
        NoRecords: the name has none (NXDOMAIN, or NODATA for both types).
        LookupFailed: neither lookup got an answer (timeout, SERVFAIL, no nameserver).
    """
    addresses: set[str] = set()
    failures: list[Exception] = []
    nxdomain = 0
    for rdtype in ("A", "AAAA"):
        try:
            answer = await resolver.resolve(name, rdtype)
        except dns.resolver.NXDOMAIN:
            nxdomain += 1
            continue
        except dns.resolver.NoAnswer:
            continue
        except (dns.exception.Timeout, dns.resolver.NoNameservers, dns.resolver.LifetimeTimeout) as exc:
            failures.append(exc)
            continue
        addresses.update(str(record.address) for record in answer)
    if len(failures) == 2:
        reason = "timeout" if isinstance(failures[-1], dns.exception.Timeout) else "no_nameserver_answered"
        raise LookupFailed(f"{name}: {failures[-1]}", reason)
    if not addresses:
        raise NoRecords("nxdomain" if nxdomain else "no_address_records")
    return addresses


def hosts_addresses(text: str, name: str) -> set[str]:
    """The addresses a hosts file (``hosts(5)``: an address, then its names; ``#`` starts a comment) gives
    ``name`` (matched without case or a final dot); empty when it does not list it. Lines whose first
    field is not an IP address are skipped."""
    wanted = name.removesuffix(".").lower()
    addresses: set[str] = set()
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) < 2 or wanted not in (n.removesuffix(".").lower() for n in fields[1:]):
            continue
        try:
            addresses.add(str(ipaddress.ip_address(fields[0])))
        except ValueError:
            continue
    return addresses


async def read_hosts(path: str | None, name: str) -> set[str]:
    """:func:`hosts_addresses` of the file at ``path`` (off the event loop); empty when ``path`` is None or
    cannot be read."""
    if path is None:
        return set()
    try:
        text = await asyncio.to_thread(Path(path).read_text, errors="replace")
    except OSError:
        return set()
    return hosts_addresses(text, name)


def worker_urls(addresses: set[str], settings: DiscoverySettings) -> set[str]:
    """``scheme://address:port`` of each address (IPv6 in brackets)."""
    urls = set()
    for address in addresses:
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        urls.add(f"{settings.scheme}://{host}:{settings.port}")
    return urls


def no_workers_hint(settings: DiscoverySettings) -> str:
    """The ``hint`` of the ``no_workers_configured`` warning (a gateway that starts with no worker): where
    workers come from; with discovery on, that its name gave none (the line before says why)."""
    where = (
        "set RADIXGATE_UPSTREAM__WORKERS, RADIXGATE_ENGINE__LAUNCH=true, or add workers with "
        "POST /admin/workers"
    )
    if settings.dns_name is None:
        return where + " (or find them by DNS: RADIXGATE_DISCOVERY__DNS_NAME)"
    return (
        f"discovery (RADIXGATE_DISCOVERY__DNS_NAME={settings.dns_name}) found no worker: see the "
        f"discovery_no_records or discovery_failed line above; it asks again every "
        f"{settings.interval_s:g} s. Or {where}"
    )


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
        #: the name's state at the last lookup: ("resolved", ""), ("no_records", reason) or ("failed",
        #: reason); None before the first
        self.state: tuple[str, str] | None = None

    def _now_in(self, state: str, reason: str, **fields: object) -> None:
        """Log the name's state when it differs from the last lookup's (once per change, not per period)."""
        before, self.state = self.state, (state, reason)
        if self.state == before:
            return
        if state == "no_records":
            log.warning(
                "discovery_no_records",
                name=self._name,
                reason=reason,
                hint="every worker discovered from this name is drained; check the name "
                "(RADIXGATE_DISCOVERY__DNS_NAME) and that its Service has ready pods",
                **fields,
            )
        elif state == "failed":
            log.warning("discovery_failed", name=self._name, reason=reason, **fields)
        elif before is not None:
            log.info("discovery_resolved", name=self._name, was=before[0], **fields)

    async def sync(self) -> bool:
        """One lookup and its changes to the registry; False when the lookup or Redis failed (nothing
        changed)."""
        try:
            # the hosts file first, as the system's resolver reads it (dnspython does not)
            addresses = await read_hosts(self._settings.hosts_file, self._name)
            if not addresses:
                addresses = await lookup(self._resolver, self._name)
        except LookupFailed as exc:
            self._now_in("failed", exc.reason, error=str(exc))
            return False
        except NoRecords as exc:
            addresses = set()
            self._now_in("no_records", exc.reason)
        else:
            self._now_in("resolved", "", addresses=len(addresses))
        found = worker_urls(addresses, self._settings)
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


__all__ = [
    "DnsDiscovery",
    "LookupFailed",
    "NoRecords",
    "hosts_addresses",
    "lookup",
    "make_resolver",
    "no_workers_hint",
    "read_hosts",
    "worker_urls",
]

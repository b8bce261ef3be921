"""A real DNS server for tests: dnslib's UDP server on loopback, answering A/AAAA from records a test edits.

Used by the worker-discovery tests (:mod:`service.workers.discovery`), as a Kubernetes headless Service's
DNS would answer: one A record per ready pod, none once the pod is gone.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
from collections.abc import Iterator
from typing import Any

from dnslib import AAAA, QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSServer


class RecordsResolver(BaseResolver):  # type: ignore[misc]
    """Answers from :attr:`records` (name without the final dot -> addresses); :attr:`failing` answers
    SERVFAIL to everything (a broken resolver); a name not in records is NXDOMAIN."""

    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.failing = False
        self.queries = 0
        self._lock = threading.Lock()

    def set(self, name: str, addresses: list[str]) -> None:
        """Replace ``name``'s records."""
        with self._lock:
            self.records[name] = list(addresses)

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        """The reply to one query (dnslib's resolver interface)."""
        reply = request.reply()
        with self._lock:
            self.queries += 1
            if self.failing:
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            name = str(request.q.qname).rstrip(".")
            if name not in self.records:
                reply.header.rcode = RCODE.NXDOMAIN
                return reply
            for address in self.records[name]:
                version = ipaddress.ip_address(address).version
                if request.q.qtype == QTYPE.A and version == 4:
                    reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=0))
                elif request.q.qtype == QTYPE.AAAA and version == 6:
                    reply.add_answer(RR(request.q.qname, QTYPE.AAAA, rdata=AAAA(address), ttl=0))
        return reply


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def dns_server() -> Iterator[tuple[RecordsResolver, str]]:
    """A DNS server on 127.0.0.1 (UDP); yields its resolver (edit its records) and ``HOST:PORT``."""
    resolver = RecordsResolver()
    port = _free_udp_port()

    class _Quiet:  # dnslib's logger prints every query; tests want none of it
        def __getattr__(self, _name: str) -> Any:
            return lambda *args, **kwargs: None

    server = DNSServer(resolver, port=port, address="127.0.0.1", logger=_Quiet())
    server.start_thread()
    try:
        yield resolver, f"127.0.0.1:{port}"
    finally:
        server.stop()

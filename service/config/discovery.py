"""The discovery part of the Settings tree: workers found from a DNS name (``discovery.*``).

Split from :mod:`service.config.settings`, which assembles the tree. What is done with these is in
:mod:`service.workers.discovery`.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import BaseModel, Field, field_validator

from service.config.policies import FINITE

DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")
"""One label of a host name: letters, digits and hyphens, not at either end, 1 to 63 characters (RFC 1123
section 2.1, RFC 1035 section 2.3.4); underscores too, as service names carry them (RFC 2782)."""

DNS_PORT = 53


def dns_name(value: str) -> str:
    """``value`` if it is a DNS name's syntax: labels (:data:`DNS_LABEL`) joined by dots, an optional final
    dot, 253 characters at most (RFC 1035 section 2.3.4).

    Raises:
        ValueError: it is not (e.g. a space or ``!`` in it, an empty label).
    """
    labels = value.removesuffix(".").split(".")
    if len(value.removesuffix(".")) > 253 or not all(DNS_LABEL.fullmatch(label) for label in labels):
        raise ValueError(
            f"not a DNS name, got {value!r}: labels of letters, digits and '-' (1-63 characters, no '-' at "
            "either end) joined by dots, e.g. sglang-workers.default.svc.cluster.local"
        )
    return value


def nameserver_address(value: str) -> tuple[str, int]:
    """``(IP address, port)`` of a nameserver given as ``IP``, ``IPV4:PORT`` or ``[IPV6]:PORT`` (port 53
    when none is given). dnspython's resolver takes addresses only: a host name would need a lookup
    before DNS works.

    Raises:
        ValueError: not one of those forms, or a port outside 1-65535.
    """
    host, port = value, str(DNS_PORT)
    if value.startswith("[") and "]:" in value:
        host, port = value[1:].split("]:", 1)
    elif value.startswith("[") and value.endswith("]"):
        host = value[1:-1]
    elif value.count(":") == 1:
        host, port = value.split(":")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is None or not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(
            f"a nameserver is an IP address, IPV4:PORT or [IPV6]:PORT with a port of 1-65535 (the resolver "
            f"asks an address, not a name), got {value!r}"
        )
    return str(address), int(port)


class DiscoverySettings(BaseModel):
    """Workers found from a DNS name, as a Kubernetes headless Service gives one A record per ready pod.

    Each replica resolves ``dns_name`` every ``interval_s``; a worker ``scheme://address:port`` per record
    is registered in the shared worker registry (so every replica serves it, and the admin API sees it);
    a record that is gone drains its worker at once (no new requests; its streams finish) and removes it
    ``remove_after_s`` later. A failed lookup (timeout, SERVFAIL) changes nothing; an answer without
    records drains every discovered worker.
    """

    model_config = FINITE

    dns_name: str | None = Field(
        None,
        min_length=1,
        max_length=253,
        description="DNS name whose A/AAAA records are the workers (e.g. a Kubernetes headless Service: "
        "sglang-workers.default.svc.cluster.local); unset: no discovery.",
    )
    port: int = Field(30000, ge=1, le=65535, description="Port of each discovered worker.")
    scheme: Literal["http", "https"] = Field("http", description="Scheme of each discovered worker.")
    interval_s: float = Field(10.0, gt=0, le=3600, description="How often the name is resolved, s.")
    timeout_s: float = Field(2.0, gt=0, le=60, description="Timeout of one lookup, s.")
    remove_after_s: float = Field(
        60.0,
        ge=0,
        le=86400,
        description="How long a worker whose record is gone stays registered (draining: no new requests, "
        "its streams finish) before it is removed, s.",
    )
    nameserver: str | None = Field(
        None,
        description="Nameserver to ask, an IP address, IPV4:PORT or [IPV6]:PORT (port 53 when none is "
        "given; unset: the system's resolver, /etc/resolv.conf).",
    )
    hosts_file: str | None = Field(
        "/etc/hosts",
        max_length=4096,
        description="Hosts file read before DNS, as the system's resolver does (nsswitch 'files dns'): a "
        "name listed there resolves to its addresses (e.g. localhost); null: DNS only.",
    )

    @field_validator("dns_name")
    @classmethod
    def _dns_name(cls, value: str | None) -> str | None:
        return None if value is None else dns_name(value)

    @field_validator("nameserver")
    @classmethod
    def _nameserver_address(cls, value: str | None) -> str | None:
        if value is not None:
            nameserver_address(value)
        return value


__all__ = ["DNS_LABEL", "DiscoverySettings", "dns_name", "nameserver_address"]

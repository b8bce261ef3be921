"""The discovery part of the Settings tree: workers found from a DNS name (``discovery.*``).

Split from :mod:`service.config.settings`, which assembles the tree. What is done with these is in
:mod:`service.workers.discovery`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from service.config.policies import FINITE


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
        description="Nameserver to ask, HOST or HOST:PORT (unset: the system's resolver, /etc/resolv.conf).",
    )

    @field_validator("nameserver")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is None:
            return None
        host, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
        if not host or (port and not (port.isdigit() and 1 <= int(port) <= 65535)):
            raise ValueError(f"a nameserver is HOST or HOST:PORT, got {value!r}")
        return value


__all__ = ["DiscoverySettings"]

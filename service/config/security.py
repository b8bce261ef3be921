"""The security part of the Settings tree (``security.*``): where the operator endpoints answer, the token
on ``/metrics``, and the throttle on bad API keys.

Split from :mod:`service.config.settings`, which assembles the tree. What the gateway does with these is in
:mod:`service.api.operator_access` and :mod:`service.api.key_guessing`; docs/security.md describes each.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr, field_validator

from service.config.policies import FINITE


class SecuritySettings(BaseModel):
    """What an outsider who reaches the API port can see and try.

    The operator endpoints are ``/metrics`` (tenant ids in labels), the detail of ``/readyz`` (worker URLs,
    Redis) and ``/admin/*``. With ``operator_port`` unset they answer on the API port: ``/admin`` behind the
    admin token, ``/metrics`` behind ``metrics_token`` when one is set, ``/readyz``'s detail only to a
    request with either token. With ``operator_port`` set they answer only on that port (404 on the API
    port), which a deployment keeps off the public network (compose.yaml binds nothing of it to the host's
    interfaces; Kubernetes scrapes it inside the cluster).
    """

    model_config = FINITE

    operator_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port of the operator endpoints (/metrics, /admin/*, /readyz with its detail): when "
        "set they answer only there, and 404 on the API port (which keeps /healthz and a bare /readyz); "
        "unset: on the API port.",
    )
    operator_host: str = Field(
        "127.0.0.1",
        description="Interface of operator_port (0.0.0.0 in a container, so that Prometheus in the "
        "cluster reaches it; never publish it).",
    )
    metrics_token: SecretStr = Field(
        SecretStr(""),
        description="Bearer token /metrics asks for (16+ chars; the admin token works too): Prometheus sends "
        "it with `authorization: {credentials_file: ...}`; empty: /metrics answers whoever reaches its port.",
    )
    bad_key_rate_per_s: float = Field(
        0.5,
        ge=0,
        le=1000,
        description="Bad API keys (unknown, revoked, malformed) or admin tokens one client address may try "
        "per second once its burst is spent; the "
        "next is answered 429 with Retry-After before any Redis lookup (a per-process token bucket per "
        "address, policies/token_bucket.py); 0: no throttle, requests/s.",
    )
    bad_key_burst: int = Field(
        20,
        ge=1,
        le=100_000,
        description="Bad API keys or admin tokens one client address may try at once before the rate above "
        "applies.",
    )
    bad_key_addresses: int = Field(
        10_000,
        ge=1,
        le=10_000_000,
        description="Client addresses whose bad-key buckets a process remembers (least recently seen "
        "dropped first: a dropped address starts again with a full burst).",
    )

    client_address_header: str = Field(
        "",
        max_length=64,
        description="Request header that carries the client's address (X-Real-IP, or X-Forwarded-For: its "
        "last entry) for the bad-key throttle, set by the proxy in front; only when every request comes "
        "through it (a client could send it itself otherwise). Empty: the TCP peer's address.",
    )

    @field_validator("metrics_token")
    @classmethod
    def _metrics_token_length(cls, value: SecretStr) -> SecretStr:
        secret = value.get_secret_value()
        if secret and len(secret) < 16:
            raise ValueError("metrics_token must be at least 16 characters")
        return value

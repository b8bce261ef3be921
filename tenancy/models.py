"""Tenant and API-key records as stored in Redis (pydantic models, JSON on the wire and in Redis)."""

from __future__ import annotations

import re
import time
from datetime import datetime
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

TENANT_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")

MAX_RATE = 1e12
"""Largest quota rate or burst an admin may set, per minute or tokens (a finite bound: an overflowing
number such as 1e400 must not turn into "unlimited")."""

MIN_WEIGHT = 1e-3
"""Smallest fair-queuing weight an admin may set (the largest is 1000): a request's cost over its weight
is its WFQ finish-tag increment, and a weight such as 1e-320 makes it infinite."""

MIN_RATE = 1e-3
"""Smallest quota rate an admin may set, per minute (one request in about 17 hours): below it, refill
times overflow what a ``Retry-After`` can say (nu11: ``requests_per_min: 1e-300`` answered
``Retry-After: 10000000000``, ``tokens_per_min: 5e-324`` a burst of ``4.94066e-324`` tokens)."""

MAX_ALLOWED_MODELS = 256
"""Most entries in a tenant's ``allowed_models`` (each a served model id, so real lists are short): the list
is stored in the tenant record, read on authentication and returned in every admin listing page, and was
unbounded (nu13: 40,000 copies of one id made a 1 MB record)."""

MAX_MODEL_ID_CHARS = 256
"""Longest model id in ``allowed_models``, characters."""

MAX_MODEL_QUOTAS = 64
"""Most per-model entries in a tenant's ``quotas.models`` (each a served model id; read on every request
of the tenant, so the list is short)."""
MAX_CONCURRENT_REQUESTS = 1_000_000
"""Largest ``max_concurrent_requests`` an admin may set, requests (a cap is a count of requests in flight
across every replica; a million is beyond any fleet, and a bound keeps it an integer Redis compares)."""

MIN_REQUEST_BURST = 1.0
"""Smallest request-bucket capacity, requests: a bucket below one request never admits any."""

_ADMIN_INPUT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
"""Admin bodies: no unknown fields, no coercion ("no" is not a bool, "12" not a number), finite numbers."""


def _dedupe_models(value: list[str] | None) -> list[str] | None:
    """``allowed_models`` without repeats, in the order given (a repeat says nothing more)."""
    return None if value is None else list(dict.fromkeys(value))


AllowedModels = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=MAX_MODEL_ID_CHARS)]] | None,
    Field(max_length=MAX_ALLOWED_MODELS),
    AfterValidator(_dedupe_models),
]
"""An admin's ``allowed_models``: at most :data:`MAX_ALLOWED_MODELS` ids, repeats dropped."""


class BucketLimits(BaseModel):
    """The limits of one pair of token buckets (requests and tokens). ``None`` means unlimited for that
    bucket.

    Attributes:
        requests_per_min: RPM refill rate, requests/min.
        tokens_per_min: TPM refill rate, tokens/min (prompt + completion).
        request_burst: request bucket capacity, requests (defaults to ``requests_per_min``).
        token_burst: token bucket capacity, tokens (defaults to ``tokens_per_min``); a single request
            reserving more tokens than this can never pass.
    """

    model_config = _ADMIN_INPUT

    requests_per_min: float | None = Field(None, ge=MIN_RATE, le=MAX_RATE)
    tokens_per_min: float | None = Field(None, ge=MIN_RATE, le=MAX_RATE)
    request_burst: float | None = Field(None, gt=0, le=MAX_RATE)
    token_burst: float | None = Field(None, gt=0, le=MAX_RATE)

    @property
    def effective_request_burst(self) -> float | None:
        """Capacity of the request bucket, requests: ``request_burst``, else ``requests_per_min`` but at
        least one request (a rate of 0.5/min admits one request every 2 minutes)."""
        if self.requests_per_min is None and self.request_burst is None:
            return None
        return self.request_burst or max(self.requests_per_min or 0.0, MIN_REQUEST_BURST)

    @property
    def effective_token_burst(self) -> float | None:
        """Capacity of the token bucket, tokens."""
        return self.token_burst or self.tokens_per_min

    @property
    def limited(self) -> bool:
        """Whether either bucket has a rate (a limits object without one takes nothing)."""
        return self.requests_per_min is not None or self.tokens_per_min is not None


class ModelQuota(BucketLimits):
    """A tenant's limits on one model (``quotas.models[]``), on top of its own: a request for that model
    takes from both.

    Attributes:
        model: the model's canonical id (an alias is refused when it is set: aliases fold into the id).
    """

    model: str = Field(..., min_length=1, max_length=MAX_MODEL_ID_CHARS, description="A served model id.")


class Quotas(BucketLimits):
    """Per-tenant token-bucket limits (:class:`BucketLimits`), and per-model ones.

    Attributes:
        models: at most :data:`MAX_MODEL_QUOTAS` entries, one per model id (None: no model has limits of
            its own).
    """

    models: list[ModelQuota] | None = Field(
        None,
        max_length=MAX_MODEL_QUOTAS,
        description="Per-model limits [{model, requests_per_min, tokens_per_min, bursts}], one per model.",
    )

    @field_validator("models")
    @classmethod
    def _one_per_model(cls, value: list[ModelQuota] | None) -> list[ModelQuota] | None:
        """Refuse two entries for one model id (which of them would apply?)."""
        if value is not None:
            seen: set[str] = set()
            for entry in value:
                if entry.model in seen:
                    raise ValueError(f"model '{entry.model[:80]}' has two entries; give one per model")
                seen.add(entry.model)
        return value

    def for_model(self, model_id: str) -> ModelQuota | None:
        """The entry of ``model_id`` that limits anything (None: none, or one without a rate)."""
        for entry in self.models or ():
            if entry.model == model_id:
                return entry if entry.limited else None
        return None


class TenantSpec(BaseModel):
    """Fields an admin sets on a tenant (create or full update)."""

    model_config = _ADMIN_INPUT

    name: str = Field(..., min_length=1, max_length=200)
    priority_class: str | None = Field(
        None, min_length=1, max_length=64, description="None: the gateway's default_priority_class setting."
    )
    max_priority_class: str | None = Field(None, max_length=64)
    weight: float = Field(
        1.0, ge=MIN_WEIGHT, le=1000, description="Fair-queuing weight inside a priority band."
    )
    quotas: Quotas = Field(default_factory=Quotas)
    max_tokens_cap: int | None = Field(
        None, ge=1, le=10**9, description="Largest max_tokens per request, tokens."
    )
    allowed_models: AllowedModels = Field(None, description="Model ids this tenant may use; None = all.")
    enabled: bool = True
    max_concurrent_requests: int | None = Field(
        None,
        ge=1,
        le=MAX_CONCURRENT_REQUESTS,
        description="Most requests in flight at once across every replica, requests; None = no cap.",
    )

    @field_validator("priority_class", mode="before")
    @classmethod
    def _class_not_null(cls, value: Any) -> Any:
        """Omitted means the default class; an explicit ``null`` is refused, naming the field."""
        if value is None:
            raise ValueError("priority_class cannot be null (omit it for the default class)")
        return value


class TenantPatch(BaseModel):
    """Partial update of a tenant; absent fields are kept, ``null`` clears only fields that may be unset.

    Raises (on validation):
        ValueError: ``null`` for a field a tenant must have (name, priority_class, weight, quotas, enabled).
    """

    model_config = _ADMIN_INPUT

    name: str | None = Field(None, min_length=1, max_length=200)
    priority_class: str | None = Field(None, min_length=1, max_length=64)
    max_priority_class: str | None = Field(None, max_length=64)
    weight: float | None = Field(None, ge=MIN_WEIGHT, le=1000)
    quotas: Quotas | None = None
    max_tokens_cap: int | None = Field(None, ge=1, le=10**9)
    allowed_models: AllowedModels = None
    enabled: bool | None = None
    max_concurrent_requests: int | None = Field(None, ge=1, le=MAX_CONCURRENT_REQUESTS)

    @field_validator("name", "priority_class", "weight", "quotas", "enabled", mode="before")
    @classmethod
    def _required_not_null(cls, value: Any, info: ValidationInfo) -> Any:
        """A field's own check, so the error names it (``param``; nu13: a model-level check gave null)."""
        if value is None:
            raise ValueError(f"{info.field_name} cannot be null")
        return value


class TenantCreate(TenantSpec):
    """Body of ``POST /admin/tenants``: a spec plus the tenant id."""

    id: str = Field(..., description="Tenant id: lowercase letters, digits, '-', '_'; 1-63 chars.")

    @field_validator("id")
    @classmethod
    def _valid_id(cls, value: str) -> str:
        if not TENANT_ID_PATTERN.match(value):
            raise ValueError("tenant id must match ^[a-z0-9][a-z0-9_-]{0,62}$")
        return value


class Tenant(TenantCreate):
    """A stored tenant."""

    model_config = ConfigDict(extra="ignore")

    priority_class: str = Field(..., min_length=1, max_length=64, description="As stored (always set).")
    weight: float = Field(1.0, gt=0, le=1000, description="As set; records written before MIN_WEIGHT load.")
    allowed_models: list[str] | None = Field(
        None, description="As stored; records written before MAX_ALLOWED_MODELS load."
    )
    created_at: float = Field(default_factory=time.time, description="Unix time, s.")
    epoch: str = Field(
        "",
        description="Random generation of this tenant id, new on each creation (tenancy.layout); "
        "empty in records written before epochs existed.",
    )

    @model_validator(mode="after")
    def _default_max_class(self) -> Tenant:
        if self.max_priority_class is None:
            self.max_priority_class = self.priority_class
        return self


MAX_EXPIRES_AT = 253_402_300_799.0
"""Latest ``expires_at`` an admin may set, unix s (9999-12-31T23:59:59Z, the last second RFC 3339 writes)."""


def _expiry(value: Any) -> Any:
    """``expires_at`` as unix seconds: a number as given, an RFC 3339 string (with its offset, e.g.
    ``2027-01-31T00:00:00Z``) converted; anything else is left for the field's own check to refuse."""
    if isinstance(value, bool):
        raise ValueError("expires_at must be unix seconds or an RFC 3339 date-time, not a boolean")
    if isinstance(value, int):
        return float(value)
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(
                "expires_at must be unix seconds or an RFC 3339 date-time such as 2027-01-31T00:00:00Z"
            ) from None
        if moment.tzinfo is None:
            raise ValueError("expires_at needs a UTC offset (RFC 3339: 'Z' or '+01:00')")
        return moment.timestamp()
    return value


ExpiresAt = Annotated[
    Annotated[float, Field(gt=0, le=MAX_EXPIRES_AT)] | None,
    BeforeValidator(_expiry),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_EXPIRES_AT},
                {"type": "string", "format": "date-time"},
                {"type": "null"},
            ]
        }
    ),
]
"""A key's expiry: unix seconds, given as a number or an RFC 3339 date-time; at most year 9999."""


class KeyTerms(BaseModel):
    """What an API key carries beyond its tenant's terms (all optional; a key without them is its
    tenant's).

    Attributes:
        expires_at: unix s after which the key is refused (401 ``expired_api_key``); None: never.
        allowed_models: model ids or aliases the key may use, each also allowed to its tenant; None: its
            tenant's models.
        quotas: the key's own token buckets, each at most its tenant's (checked when set); a request
            takes from them and from its tenant's. None: none.
        max_concurrent_requests: the key's own concurrency cap, requests in flight across every replica,
            at most its tenant's (checked when set: a tenant's cap lowered later binds first anyway).
            None: only its tenant's cap applies.
    """

    model_config = _ADMIN_INPUT

    expires_at: ExpiresAt = Field(
        None, description="Unix seconds, or an RFC 3339 date-time; the key gets 401 expired_api_key after it."
    )
    allowed_models: AllowedModels = Field(
        None, description="Model ids this key may use (a subset of its tenant's); None = its tenant's."
    )
    quotas: BucketLimits | None = Field(
        None, description="The key's own RPM/TPM buckets, at most its tenant's."
    )
    max_concurrent_requests: int | None = Field(
        None,
        ge=1,
        le=MAX_CONCURRENT_REQUESTS,
        description="Most requests of this key in flight at once, requests, at most its tenant's cap; "
        "None = only the tenant's cap applies.",
    )


class KeyCreate(KeyTerms):
    """Body of ``POST /admin/tenants/{id}/keys``."""

    name: str = Field("", max_length=200, description="A label for the key (not secret).")


class KeyPatch(KeyTerms):
    """Body of ``PATCH /admin/tenants/{id}/keys/{key_id}``: absent fields are kept, ``null`` clears a term
    (never expires, its tenant's models, no quotas or concurrency cap of its own); ``quotas`` merges field
    by field (RFC 7386), as a tenant's does."""

    name: str | None = Field(None, max_length=200)

    @field_validator("name", mode="before")
    @classmethod
    def _name_not_null(cls, value: Any) -> Any:
        if value is None:
            raise ValueError("name cannot be null (an empty string clears it)")
        return value


class ApiKeyRecord(BaseModel):
    """A stored API key: never the key itself, only its HMAC-SHA256 digest, and its terms."""

    model_config = ConfigDict(extra="ignore")

    key_id: str
    tenant_id: str
    digest: str
    name: str = ""
    created_at: float = Field(default_factory=time.time)
    revoked: bool = False
    expires_at: float | None = None
    allowed_models: list[str] | None = None
    quotas: BucketLimits | None = None
    max_concurrent_requests: int | None = Field(None, description="The key's own cap, requests.")

    def expired(self, now_s: float) -> bool:
        """Whether the key is past its expiry at unix time ``now_s``."""
        return self.expires_at is not None and now_s >= self.expires_at

    @property
    def limits(self) -> BucketLimits | None:
        """The key's own buckets' limits when any has a rate (None: the key takes from no bucket)."""
        quotas = self.quotas
        return quotas if quotas is not None and quotas.limited else None


class ApiKeyInfo(BaseModel):
    """What admins see of a key (no digest)."""

    key_id: str
    tenant_id: str
    name: str
    created_at: float
    revoked: bool
    prefix: str = Field(..., description="The key's visible prefix, e.g. 'rg-ab12cd34ef56'.")
    expires_at: float | None = Field(None, description="Unix s after which the key is refused; None: never.")
    allowed_models: list[str] | None = Field(None, description="The key's models; None: its tenant's.")
    quotas: BucketLimits | None = Field(None, description="The key's own buckets; None: none.")
    max_concurrent_requests: int | None = Field(None, description="The key's own cap, requests.")


class IssuedKey(ApiKeyInfo):
    """A newly created key; ``api_key`` is shown this once and never stored."""

    api_key: str


USAGE_FIELDS = (
    "requests",
    "errors",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "quota_rejections",
    "oversized_rejections",
    "concurrency_rejections",
)
"""The counters of :class:`Usage` (fields of the ``usage:<id>`` hash)."""


class Usage(BaseModel):
    """Accumulated usage of a tenant (counters since the tenant was created)."""

    tenant_id: str
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    quota_rejections: int = Field(0, description="Requests refused with 429 (a token bucket was short).")
    oversized_rejections: int = Field(
        0, description="Requests refused with 413: they need more than a bucket's burst, so never pass."
    )
    concurrency_rejections: int = Field(
        0, description="Requests refused with 429 because the tenant or the key had its cap in flight."
    )

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens

    def report(self, quotas: Quotas) -> dict[str, Any]:
        """The usage routes' body (``GET /v1/usage`` and the admin one): the counters, ``total_tokens`` and
        the tenant's ``quotas``."""
        return {**self.model_dump(), "total_tokens": self.total_tokens, "quotas": quotas.model_dump()}

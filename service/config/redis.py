"""The Redis section of the settings (``RADIXGATE_REDIS__*``): the connection, the auth cache, quota leases,
settles and their journal, and what a replica does while Redis cannot be reached (``on_outage``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, Field, model_validator

from service.config.checks import RedisUrl
from service.config.policies import FINITE

__all__ = ["RedisSettings"]


class RedisSettings(BaseModel):
    """Connection to the shared Redis that holds tenants, keys, token buckets and usage."""

    model_config = FINITE

    url: RedisUrl = Field(
        "redis://127.0.0.1:6379/0",
        description="redis:// URL of the shared Redis; with cluster, of any node of the Redis Cluster.",
    )
    cluster: bool = Field(
        False,
        description="The url is a node of a Redis Cluster: the client finds the others and sends each call "
        "to the node of its slot (each tenant's keys share one slot: docs/redis-cluster.md).",
    )
    key_prefix: str = Field("rg:", description="Prefix of every Redis key radixgate writes.")
    socket_timeout_s: float = Field(
        2.0, gt=0, description="Longest wait for one Redis reply, s; then 503 (Redis slow or paused)."
    )
    connect_timeout_s: float = Field(1.0, gt=0, description="TCP connect timeout to Redis, s.")
    max_connections: int = Field(
        64, ge=1, description="Redis connections per gateway replica (a blocking pool: callers wait)."
    )
    pool_timeout_s: float = Field(
        1.0, gt=0, description="Longest wait for a free Redis connection, s; then 503 with Retry-After."
    )
    retry_after_s: int = Field(
        1, ge=1, description="Retry-After sent with a 503 when Redis is unavailable, s."
    )
    auth_cache_ttl_s: float = Field(
        1.0,
        ge=0,
        description="Longest a replica answers an authenticated API key from memory, s: revocation and "
        "tenant changes reach every replica at once through Redis pub/sub, and within this bound when a "
        "message is lost; the requests that find a key's entry expired share one Redis read (0 = every "
        "request asks Redis itself).",
    )
    auth_cache_entries: int = Field(
        10_000, ge=1, description="API keys a replica remembers at most (oldest dropped first)."
    )
    quota_lease_s: float = Field(
        0.5,
        ge=0,
        le=60,
        description="Local quota leases: a replica may take up to this many seconds of a tenant's RPM and "
        "TPM from Redis ahead of its requests and admit them from memory, with no Redis round trip; "
        "leased units were debited, so no replica over-admits, and what is unused goes back after twice "
        "this time. Small quotas lease nothing (below one whole unit). 0 = one Redis call per request, s.",
    )
    quota_lease_max_fraction: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Largest share of a bucket's burst one replica's lease holds (it bounds what a lease "
        "holds back from the other replicas).",
    )
    concurrency_lease_s: float = Field(
        30.0,
        ge=0.5,
        le=3600,
        description="Lease of a concurrency slot (tenants and keys with max_concurrent_requests), s: the "
        "replica that holds a slot renews it every third of this; a slot of a replica that died is free "
        "again at most this long after its last renewal.",
    )
    settle_linger_s: float = Field(
        0.002,
        ge=0,
        le=1,
        description="The settles of a tenant's requests admitted under a quota lease (off the answer's path) "
        "are summed for this long and settled as one Redis call, s (0 = those of one event-loop round); "
        "small quotas, which lease nothing, settle at once.",
    )
    settle_retries: int = Field(
        1000,
        ge=0,
        le=100_000,
        description="Most background retries of a served request's settle (charge and usage) that failed on "
        "the response path because Redis was unavailable; with settle_give_up_s, whichever ends first; then "
        "it is counted lost (0: no retry).",
    )
    settle_give_up_s: float = Field(
        60.0,
        ge=0,
        le=3600,
        description="How long a served request's settle is retried while Redis is unavailable, s, from its "
        "first failure (a Redis restart or failover of up to this long loses no charge); then it is "
        "counted lost.",
    )
    settle_backoff_s: float = Field(
        0.1, gt=0, description="Base of the jittered exponential backoff between settle retries, s."
    )
    settle_backoff_max_s: float = Field(
        5.0, gt=0, description="Longest backoff between two settle retries, s."
    )
    settle_queue_max: int = Field(
        10_000,
        ge=1,
        description="Settles a replica retries at once at most; one more is counted lost at once.",
    )
    settle_journal_dir: Path | None = Field(
        None,
        description="Folder where a stopping gateway writes the settles Redis did not take during its "
        "drain, replayed (each at most once) by the next process started on it; unset: they are counted "
        "lost (radixgate_settle_failures_total).",
    )
    settle_drain_s: float = Field(
        10.0,
        ge=0,
        description="At shutdown, longest wait for the settles still being retried, s (then counted lost).",
    )

    on_outage: Literal["closed", "open"] = Field(
        "closed",
        description="What a replica does while Redis cannot be reached (docs/failure-modes.md, Redis "
        "outage policy): closed = new requests get 503 store_unavailable with Retry-After (those admitted "
        "finish and their settles land later); open = API keys this replica authenticated recently are "
        "accepted from memory, and each replica admits from a local token bucket per tenant (and key, "
        "model) holding the limit divided by the live replicas it last saw; their usage is recorded once "
        "Redis is back.",
    )
    outage_auth_stale_s: float = Field(
        300.0,
        ge=0,
        le=86_400,
        description="on_outage=open: how long after its last authentication from Redis an API key is still "
        "accepted from this replica's memory while Redis is unreachable, s (an unknown key gets 503; a key "
        "this replica saw revoked gets 401; 0 = none: every request gets 503 until Redis is back).",
    )
    outage_buckets: int = Field(
        100_000,
        ge=1,
        le=10_000_000,
        description="on_outage=open: local token buckets a replica keeps at most (one per tenant, key and "
        "model bucket it admits from; the least recently used are dropped first).",
    )

    @model_validator(mode="after")
    def _cluster_has_database_0(self) -> RedisSettings:
        """A Redis Cluster has database 0 only: a cluster url naming another is refused here, where
        ``config check`` sees it, not at the client's start."""
        if self.cluster:
            parts = urlsplit(str(self.url))
            db = parts.path.strip("/") or parse_qs(parts.query).get("db", ["0"])[0]
            if db not in ("", "0"):
                raise ValueError(f"url names database {db}: a Redis Cluster has database 0 only (cluster)")
        return self

    @property
    def settle_window_s(self) -> float:
        """Longest time from a request's first settle try to the end of its last retry, s: every backoff at
        its cap and every try waiting out the pool and the socket timeouts, or the give-up time plus the
        backoff and the try that began before it, whichever is shorter."""
        per_try = self.pool_timeout_s + self.socket_timeout_s
        backoffs = sum(
            min(self.settle_backoff_max_s, self.settle_backoff_s * (1 << min(k, 30)))
            for k in range(min(self.settle_retries, 10_000))
        )
        by_count = backoffs + (self.settle_retries + 1) * per_try
        return min(by_count, self.settle_give_up_s + self.settle_backoff_max_s + 2 * per_try)

    @property
    def settle_marker_ttl_s(self) -> int:
        """Lifetime of a request's "settled" marker, whole s: twice the retry window and the shutdown
        drain, plus a minute, so a retry never outlives the marker that makes it a no-op."""
        return int(2 * (self.settle_window_s + self.settle_drain_s)) + 60

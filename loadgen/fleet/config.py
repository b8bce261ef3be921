"""Inputs of the fleet simulation: the fleet, its gateway settings, tenants and the planned requests.

The defaults mirror the gateway's own settings (``service/config.py``: ``default_priority_classes``,
``SchedulerSettings``, ``RoutingSettings``) so a simulation with default values behaves like a gateway
started with default values; ``tests/test_fleet_sim.py`` checks the two stay equal. ``loadgen`` must not
import ``service`` (it is a client of the gateway), hence the copy rather than an import.

Units: times in seconds unless a name says ``_ms``; sizes in tokens; rates per minute where the name says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loadgen.sim.profiles import SimProfile, get_profile
from policies.admission import WindowConfig
from policies.cache_aware import CacheAwareConfig
from policies.routing import RouterName
from policies.token_bucket import BucketLimit


@dataclass(frozen=True, slots=True)
class ClassSpec:
    """A priority class (band), as ``service.config.PriorityClassSettings``.

    Attributes:
        rank: higher rank is served first (strict priority between bands).
        sglang_priority: ``priority`` sent to the worker (higher runs first, may preempt).
        wait_budget_s: longest gateway queue wait before the request expires (503 ``queue_timeout``), s.
        ttft_goal_s: time-to-first-token goal (SLO) used for goodput, s.
        max_queue_len: most requests waiting in this band.
        min_share: guaranteed fraction of dispatched tokens while backlogged (0..1).
    """

    rank: int
    sglang_priority: int
    wait_budget_s: float
    ttft_goal_s: float
    max_queue_len: int
    min_share: float = 0.0


def default_classes() -> dict[str, ClassSpec]:
    """``interactive`` > ``standard`` > ``batch``: the gateway's ``default_priority_classes``."""
    return {
        "interactive": ClassSpec(2, 10, 1.0, 1.0, 1000),
        "standard": ClassSpec(1, 5, 5.0, 5.0, 2000),
        "batch": ClassSpec(0, 0, 30.0, 30.0, 10000),
    }


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A tenant: fair-queuing weight, default class and quotas (``tenancy.models.Tenant``).

    Attributes:
        id: tenant id (the WFQ flow).
        weight: fair-queuing weight inside a band (> 0).
        priority_class: class its requests run in unless a request names a lower one.
        requests_per_min, tokens_per_min: bucket rates; None = unlimited.
        request_burst, token_burst: bucket capacities; None = the per-minute rate (the gateway's default).
    """

    id: str
    weight: float = 1.0
    priority_class: str = "standard"
    requests_per_min: float | None = None
    tokens_per_min: float | None = None
    request_burst: float | None = None
    token_burst: float | None = None

    def request_limit(self) -> BucketLimit | None:
        """The request bucket, or None when unlimited."""
        if self.requests_per_min is None:
            return None
        return BucketLimit(self.requests_per_min, self.request_burst or self.requests_per_min)

    def token_limit(self) -> BucketLimit | None:
        """The token bucket, or None when unlimited."""
        if self.tokens_per_min is None:
            return None
        return BucketLimit(self.tokens_per_min, self.token_burst or self.tokens_per_min)


@dataclass(frozen=True, slots=True)
class FleetRequest:
    """One planned request, as the gateway would see it after preparation.

    Attributes:
        rid: unique id.
        arrival_s: when the client sends it (virtual s from the start of the run).
        tenant: tenant id (must be in the config's tenants, else an unlimited weight-1 tenant is assumed).
        prompt: rendered prompt text as sent to the worker (routing matches it; the pseudo-tokenizer of
            ``loadgen.sim.tokens`` counts it).
        max_tokens: completion limit, tokens (the engine generates exactly this many: ``ignore_eos``).
        priority_class: class asked for; None = the tenant's.
        session_id: sticky key (consistent hashing only).
    """

    rid: str
    arrival_s: float
    tenant: str
    prompt: str
    max_tokens: int
    priority_class: str | None = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The simulated fleet and the gateway in front of it.

    Attributes:
        profile: every worker's ``loadgen.sim.profiles`` profile, or its name.
        workers: number of workers.
        routing: routing policy (``policies.routing.make_router``).
        cache_aware: settings of the cache-aware router; default = the gateway's ``RoutingSettings``
            (SGLang router defaults, tree capped at 2**24 characters per worker).
        classes: priority classes by name.
        tenants: tenants by id.
        window: per-worker AIMD window (``SchedulerSettings``: initial 8, 1..256, top-band headroom 2).
        max_queue_total: most requests queued across bands.
        load_poll_interval_s: period of the worker load polls that drive the windows, s.
        expiry_interval_s: period of the queue-deadline check, s.
        gateway_latency_s: fixed time from arrival to the gateway's scheduler (HTTP parse, Redis quota
            call, tokenization), s; 0 models an ideal gateway.
        network_latency_s: time from dispatch to the worker's receipt, and from a token's generation to
            the client, s.
        seed: seeds every worker's step jitter (worker i gets ``seed * 1000 + i``).
        fair_queuing: WFQ between tenants inside a band (the gateway always does this); False is an
            ablation for experiments: every tenant is one flow, so a band is served first come, first served.
    """

    profile: str | SimProfile = "llama-3.1-70b-h100-tp8"
    workers: int = 1
    routing: RouterName = "cache_aware"
    cache_aware: CacheAwareConfig = field(
        default_factory=lambda: CacheAwareConfig(max_tree_chars_per_worker=2**24)
    )
    classes: dict[str, ClassSpec] = field(default_factory=default_classes)
    tenants: dict[str, TenantSpec] = field(default_factory=dict)
    window: WindowConfig = field(default_factory=WindowConfig)
    max_queue_total: int = 10000
    load_poll_interval_s: float = 1.0
    expiry_interval_s: float = 0.05
    gateway_latency_s: float = 0.0
    network_latency_s: float = 0.0
    seed: int = 0
    fair_queuing: bool = True

    def sim_profile(self) -> SimProfile:
        """The workers' profile (looked up when given by name)."""
        return self.profile if isinstance(self.profile, SimProfile) else get_profile(self.profile)

    @property
    def profile_name(self) -> str:
        """The workers' profile name."""
        return self.sim_profile().name

    def tenant(self, tenant_id: str) -> TenantSpec:
        """The tenant's spec; an unlimited, weight-1, ``standard`` tenant when it is not configured."""
        spec = self.tenants.get(tenant_id)
        if spec is not None:
            return spec
        fallback = "standard" if "standard" in self.classes else next(iter(self.classes))
        return TenantSpec(tenant_id, priority_class=fallback)

    def class_of(self, req: FleetRequest) -> str:
        """The class a request runs in: the one it asks for when not above its tenant's, else the tenant's.

        Mirrors ``service.preparation`` loosely: a request may ask for a lower class, never a higher one.
        """
        own = self.tenant(req.tenant).priority_class
        asked = req.priority_class
        if asked is None or asked not in self.classes:
            return own
        return asked if self.classes[asked].rank <= self.classes[own].rank else own

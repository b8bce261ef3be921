"""Inputs of the fleet simulation: the fleet, its gateway's admission core, tenants and the planned requests.

The gateway's scheduling decisions come from :class:`policies.admission_core.AdmissionCore`, configured by
the same :class:`policies.admission_types.CoreConfig` whose defaults the gateway's settings translate into:
nothing here redeclares a policy default. What is the simulation's own: the simulated workers' profile and
count, the load-poll period, latencies and seeds.

Units: times in seconds unless a name says ``_ms``; sizes in tokens; rates per minute where the name says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from loadgen.fleet.replicas import ROUTE_SYNC_DELAY_S, Balance
from loadgen.sim.profiles import SimProfile, get_profile
from policies.admission_types import CoreConfig
from policies.token_bucket import BucketLimit
from tenancy.models import Quotas


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """A tenant: fair-queuing weight, default class and quotas (``tenancy.models.Tenant``).

    Attributes:
        id: tenant id (the WFQ flow).
        weight: fair-queuing weight inside a band (> 0).
        priority_class: class its requests run in unless a request names a lower one.
        requests_per_min, tokens_per_min: bucket rates; None = unlimited.
        request_burst, token_burst: bucket capacities; None = the per-minute rate (the gateway's default;
            the request bucket holds at least one request).
    """

    id: str
    weight: float = 1.0
    priority_class: str = "standard"
    requests_per_min: float | None = None
    tokens_per_min: float | None = None
    request_burst: float | None = None
    token_burst: float | None = None

    def quotas(self) -> Quotas:
        """The same limits as the gateway's tenant record holds them."""
        return Quotas(
            requests_per_min=self.requests_per_min,
            tokens_per_min=self.tokens_per_min,
            request_burst=self.request_burst,
            token_burst=self.token_burst,
        )

    def request_limit(self) -> BucketLimit | None:
        """The request bucket, or None when unlimited (capacity as the gateway derives it)."""
        burst = self.quotas().effective_request_burst
        if self.requests_per_min is None or burst is None:
            return None
        return BucketLimit(self.requests_per_min, burst)

    def token_limit(self) -> BucketLimit | None:
        """The token bucket, or None when unlimited (capacity as the gateway derives it)."""
        burst = self.quotas().effective_token_burst
        if self.tokens_per_min is None or burst is None:
            return None
        return BucketLimit(self.tokens_per_min, burst)


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
        model: the served model it names (:attr:`FleetModel.name`); None = the config's first model.
    """

    rid: str
    arrival_s: float
    tenant: str
    prompt: str
    max_tokens: int
    priority_class: str | None = None
    session_id: str | None = None
    model: str | None = None


@dataclass(frozen=True, slots=True)
class FleetModel:
    """One served model of a multi-model fleet: its own workers and its own admission core.

    The gateway gives each model of ``RADIXGATE_MODELS`` its own core
    (``service.config.models.ServedModel.core_config``, ``service.pipeline.served_models``); the simulation
    does the same: a request is queued, routed and shed among its model's workers only, with its model's
    class goals and windows. Tenants and their quotas are shared by every model.

    Attributes:
        name: the model id requests name (:attr:`FleetRequest.model`).
        profile: its workers' ``loadgen.sim.profiles`` profile, or its name.
        workers: its number of workers (>= 1).
        core: its admission core's configuration.
    """

    name: str
    profile: str | SimProfile
    workers: int
    core: CoreConfig = field(default_factory=CoreConfig)

    def sim_profile(self) -> SimProfile:
        """Its workers' profile (looked up when given by name)."""
        return self.profile if isinstance(self.profile, SimProfile) else get_profile(self.profile)


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The simulated fleet and the gateway in front of it.

    Attributes:
        profile: every worker's ``loadgen.sim.profiles`` profile, or its name.
        workers: number of workers.
        core: the admission core's configuration (classes, windows, routing, ablations): the gateway's
            defaults unless changed (:meth:`with_core`).
        tenants: tenants by id.
        gateway_latency_s: fixed time from arrival to the gateway's scheduler (HTTP parse, Redis quota
            call, tokenization), s; 0 models an ideal gateway.
        network_latency_s: time from dispatch to the worker's receipt, and from a token's generation to
            the client, s.
        seed: seeds every worker's step jitter (worker i gets ``seed * 1000 + i``, counted over every
            model's workers in order).
        models: several served models, each with its own workers and core (:class:`FleetModel`); empty
            (the default) = one model, ``"default"``, of ``workers`` workers of ``profile`` with ``core``.
            Tenants' classes (:meth:`class_of`) are read from ``core``: give every model the same class
            names.
        replicas: gateway replicas in front of the workers, each with its own admission core per model
            (:mod:`loadgen.fleet.replicas`); 1 = one gateway.
        balance: how the load balancer spreads requests over the replicas: ``round_robin`` or ``random``
            (seeded by ``seed``).
        share_windows: each replica takes only its share of a worker's window (the gateway's
            ``replicas.share_windows``, on by default); off, each takes all of it.
        share_routes: each replica's router learns the other replicas' dispatches
            ``route_sync_delay_s`` after them (the gateway's ``replicas.share_routes``, on by default).
        route_sync_delay_s: from a replica's dispatch to the others learning it, s
            (:data:`loadgen.fleet.replicas.ROUTE_SYNC_DELAY_S`, 1 ms).
        cold_start_s: from asking for a worker (:meth:`loadgen.fleet.sim.FleetSim.start_worker`) to its
            first request, s. 300 s, a Llama-3.1-70B TP-8 SGLang worker on H100 scheduled onto a node
            whose image is cached: its ~140 GB of BF16 weights read from network storage and initialised
            on 8 GPUs (Anyscale measured 4 min 25 s to download and initialise Llama-2-70B on an 8-GPU
            node from object storage, "Loading Llama-2 70b 20x faster with Anyscale Endpoints", 2023), then
            CUDA graph capture and warm-up (54 s of graph capture of vLLM's 5-minute cold start of an 8B
            model in Tensorfuse's breakdown, "Reducing GPU cold start time when using vLLM", 2025). The
            gateway's planner plans with the same figure (``planner.cold_start_s``).
    """

    profile: str | SimProfile = "llama-3.1-70b-h100-tp8"
    workers: int = 1
    core: CoreConfig = field(default_factory=CoreConfig)
    tenants: dict[str, TenantSpec] = field(default_factory=dict)
    gateway_latency_s: float = 0.0
    network_latency_s: float = 0.0
    seed: int = 0
    models: tuple[FleetModel, ...] = ()
    replicas: int = 1
    balance: Balance = "round_robin"
    share_windows: bool = True
    share_routes: bool = True
    route_sync_delay_s: float = ROUTE_SYNC_DELAY_S
    cold_start_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.route_sync_delay_s < float("inf"):
            raise ValueError(f"route_sync_delay_s must be finite and >= 0 (got {self.route_sync_delay_s})")
        if not 0 <= self.cold_start_s < float("inf"):
            raise ValueError(f"cold_start_s must be finite and >= 0 (got {self.cold_start_s})")

    def served_models(self) -> tuple[FleetModel, ...]:
        """The served models: :attr:`models`, or the one ``"default"`` model of this config's workers."""
        return self.models or (FleetModel("default", self.profile, self.workers, self.core),)

    def with_core(self, **changes: Any) -> FleetConfig:
        """A copy whose core configuration has ``changes`` (``CoreConfig`` field names)."""
        return replace(self, core=replace(self.core, **changes))

    @property
    def routing(self) -> str:
        """The routing policy's name."""
        return self.core.routing

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
        classes = self.core.classes
        fallback = "standard" if "standard" in classes else next(iter(classes))
        return TenantSpec(tenant_id, priority_class=fallback)

    def class_of(self, req: FleetRequest) -> str:
        """The class a request runs in: the one it asks for when not above its tenant's, else the tenant's.

        Mirrors ``service.pipeline.prepare`` loosely: a request may ask for a lower class, never a higher one.
        """
        classes = self.core.classes
        own = self.tenant(req.tenant).priority_class
        asked = req.priority_class
        if asked is None or asked not in classes:
            return own
        return asked if classes[asked].rank <= classes[own].rank else own

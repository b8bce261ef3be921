"""The one Settings tree of radixgate (pydantic-settings).

Every tunable lives here (its engine and scheduling sections in :mod:`service.config.engine` and
:mod:`service.config.policies`); nothing else reads ``os.environ``. Environment variables use the prefix
``RADIXGATE_`` and ``__`` between nesting levels, e.g. ``RADIXGATE_REDIS__URL`` or ``RADIXGATE_ENGINE__TP``;
below them, a TOML or YAML file (``config_file``, :mod:`service.config.sources`). The settings object is built
once by :func:`service.app.create_app` (or by the command line) and passed down.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from policies.admission_types import CoreConfig
from service.config.checks import HttpUrls, LogLevel
from service.config.discovery import DiscoverySettings
from service.config.engine import (
    EngineSettings,
    HomeSettings,
    configured_home,
    default_cpu_shim,
    default_home,
    home_engine_paths,
)
from service.config.fleet import PlannerSettings, ReplicaSettings
from service.config.models import ModelRegistry, ModelSettings, build_registry
from service.config.policies import (
    DEFAULT_CLASS,
    FINITE,
    PriorityClassSettings,
    RoutingSettings,
    SchedulerSettings,
    default_priority_classes,
)
from service.config.pricing import PricingSettings, check_priced_models
from service.config.redis import RedisSettings
from service.config.security import SecuritySettings
from service.config.shutdown import ShutdownSettings
from service.config.sources import ConfigFileSource
from service.config.tracing import TracingSettings

__all__ = [
    "ApiSettings",
    "EngineSettings",
    "ObservabilitySettings",
    "RedisSettings",
    "Settings",
    "UpstreamSettings",
    "configured_home",
    "default_cpu_shim",
    "default_home",
]


class UpstreamSettings(BaseModel):
    """Workers the gateway sends requests to, and how it talks to them."""

    model_config = FINITE

    workers: HttpUrls = Field(default_factory=list, description="Base URLs of running SGLang workers.")
    connect_timeout_s: float = Field(3.0, gt=0, description="TCP connect timeout to a worker, seconds.")
    max_connections: int = Field(
        1024, ge=1, description="HTTP connections to workers per replica (all workers together)."
    )
    max_keepalive_connections: int = Field(
        256, ge=0, description="Idle HTTP connections to workers kept open per replica."
    )
    pool_timeout_s: float = Field(
        5.0, gt=0, description="Longest wait for a free worker connection, s; then 503 with Retry-After."
    )
    keepalive_s: float = Field(
        4.0,
        gt=0,
        description="Idle worker connections are closed after this long, s (below SGLang's own 5 s).",
    )
    read_timeout_s: float = Field(
        300.0, gt=0, description="Longest silence on a worker call before its answer or first token, s."
    )
    http_client: Literal["httptools", "aiohttp"] = Field(
        "httptools",
        description="HTTP/1.1 client of the worker pool: asyncio protocols with httptools' parser "
        "(service/workers/native_transport.py: about 1/5 of aiohttp's client CPU per call), or aiohttp's "
        "ClientSession.",
    )
    stream_idle_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest silence on a worker stream after its first token, s; then it resumes on "
        "another worker (a hung engine).",
    )
    health_interval_s: float = Field(5.0, gt=0, description="Period of /health probes, seconds.")
    health_timeout_s: float = Field(5.0, gt=0, description="Timeout of one /health probe, seconds.")
    deep_probe_every: int = Field(
        6, ge=0, description="Every n-th probe round calls /health_generate instead (0 = never)."
    )
    breaker_failures: int = Field(
        5,
        ge=1,
        description="Failures (requests, deep or plain probes) with no success between that open a "
        "worker's breaker; a refused connection opens it at once.",
    )
    breaker_successes: int = Field(2, ge=1, description="Consecutive half-open successes that close it.")
    breaker_cooldown_s: float = Field(30.0, gt=0, description="Time an open breaker blocks a worker, s.")
    probe_trust_window_s: float = Field(
        30.0,
        ge=0,
        description="Failed probes count for nothing while a request to the worker succeeded this "
        "recently, s (real traffic outranks health signals).",
    )
    retry_backoff_s: float = Field(
        0.05, ge=0, description="Base of the jittered exponential backoff between attempts, s."
    )
    max_attempts: int = Field(2, ge=1, description="Attempts before the first token (other workers).")
    abort_grace_s: float = Field(
        1.0,
        ge=0,
        description="After a non-streamed request's client left, longest wait for the worker's answer to "
        "the abort (the tokens it computed, which are charged), s.",
    )
    send_priority: bool = Field(
        True, description="Send 'priority' to workers (they must run --enable-priority-scheduling)."
    )
    worker_drain_deadline_s: float = Field(
        15.0,
        ge=0,
        le=3600,
        description="How long a draining worker (admin drain, its DNS record gone, a scale-down) keeps the "
        "requests it runs, s: then its streams still running resume on another worker of its model "
        "(mid-stream failover: one unbroken stream, each token charged once) and its non-streamed requests "
        "start again there; 0: at once. Kept where they run while no other worker can take them.",
    )


class ApiSettings(BaseModel):
    """Limits and defaults of the OpenAI-compatible API."""

    model_config = FINITE

    max_body_bytes: int = Field(1_048_576, ge=1024, description="Largest request body accepted, bytes.")
    body_timeout_s: float = Field(
        10.0, gt=0, le=300, description="Longest time to receive a whole request body (slow senders: 408), s."
    )
    offload_body_bytes: int = Field(
        32_768,
        ge=0,
        description="Completion bodies larger than this are validated, rendered and token-counted in a "
        "worker thread (the tokenizer releases Python's lock there), so one tenant's long prompt does not "
        "stall the event loop every other request runs on (a 1 MB prompt counts for ~0.8 s); 0: always.",
    )
    max_offloaded_prepares: int = Field(
        2,
        ge=1,
        le=64,
        description="Most such preparations running at once per gateway process; later ones wait their turn, "
        "round robin across tenants.",
    )
    max_offload_waiting_per_tenant: int = Field(
        16,
        ge=0,
        le=10_000,
        description="Most long-prompt requests one tenant may have waiting for those preparations (each "
        "holds its body in memory); one more is answered 429 with Retry-After.",
    )
    stream_send_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Longest a stream waits for its client to take one chunk, s; then the gateway closes "
        "the connection, aborts the worker's request and charges what was generated (499): a client that "
        "stops reading would hold a worker slot for as long as it keeps the socket open (nginx's "
        "send_timeout, 60 s, bounds the time between two writes the same way).",
    )
    end_revoked_requests: bool = Field(
        True,
        description="End a tenant's in-flight requests on every replica when the tenant is disabled or "
        "deleted or their API key is revoked (401/403, or an error event in a stream under way; the "
        "tokens generated so far are charged); false: they run to their end.",
    )
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when the request gives none, tokens.")
    context_length: int | None = Field(
        None,
        ge=16,
        description="Prompt + completion limit of the model, tokens: the smaller of this and what its "
        "workers report on /server_info (unset: theirs; 8192 when neither says).",
    )
    tokenizer_path: Path | None = Field(
        None, description="Folder with tokenizer.json and the chat template (defaults to engine.model_path)."
    )
    prompt_cache_chars: int = Field(
        4_000_000,
        ge=0,
        description="Characters of rendered chats, and of prompt pieces with their token counts, each "
        "replica remembers at most (0 = none).",
    )
    max_n: int = Field(8, ge=1, le=128, description="Most choices (n) one request may ask for.")
    tool_call_format: Literal["hermes", "llama3_json", "mistral"] = Field(
        "hermes",
        description="How the served model family writes tool calls: hermes (Hermes, Qwen, SmolLM2 "
        "<tool_call>), llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS]).",
    )
    rate_limit_headers: bool = Field(
        True,
        description="Send OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens} headers on every "
        "answer of a tenant with a quota and on a bucket's 429/413 (docs/tenancy.md); false saves making "
        "them (about 8 us of CPU a request).",
    )


class ObservabilitySettings(BaseModel):
    """Logs and metrics."""

    model_config = FINITE

    log_level: LogLevel = Field("INFO", description="Log level of the JSON logs.")
    max_tenant_labels: int = Field(
        100, ge=1, description="Distinct tenant label values in metrics; the rest report as 'other'."
    )
    metrics_multiproc_dir: Path | None = Field(
        None,
        description="prometheus_client multiprocess directory: /metrics then sums every gateway process "
        "of the host. `serve` sets it (with PROMETHEUS_MULTIPROC_DIR) to a fresh private temp dir when "
        "WORKERS > 1 and removes it at exit; set it by hand only under your own process manager (the same, "
        "empty dir in PROMETHEUS_MULTIPROC_DIR). Unset: this process's in-memory metrics.",
    )
    metrics_refresh_s: float = Field(
        1.0,
        gt=0,
        description="With metrics_multiproc_dir: how often each process writes the gauges it otherwise "
        "sets at scrape time (worker_in_flight_requests, worker_healthy), s.",
    )
    engine_scrape_s: float = Field(
        5.0,
        ge=0,
        description="Period of the gateway's scrape of every pool worker's /metrics behind the "
        "radixgate_engine_* gauges (running, queued, KV usage, cache hit rate, throughput, speculative "
        "accept length), s; 0: off.",
    )
    loop_lag_interval_s: float = Field(
        0.5,
        ge=0,
        description="Sleep of the task that measures event-loop lag (radixgate_event_loop_lag_seconds: "
        "each sleep's overrun), s; 0: off.",
    )


class Settings(HomeSettings):
    """Root of radixgate's configuration. Env prefix ``RADIXGATE_``, nested delimiter ``__``; below the
    environment, the TOML or YAML file ``config_file`` names (:mod:`service.config.sources`)."""

    model_config = SettingsConfigDict(
        env_prefix="RADIXGATE_",
        env_nested_delimiter="__",
        extra="ignore",
        env_file=None,
        allow_inf_nan=False,
    )

    host: str = Field("127.0.0.1", description="Interface the gateway listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port the gateway listens on.")
    workers: int = Field(
        1,
        ge=1,
        description="Gateway processes on this host sharing the port (uvicorn workers); each is one "
        "replica with its own scheduler, all sharing Redis; /metrics sums them (prometheus_client "
        "multiprocess mode, only when more than 1). More than 1 needs engine.launch false.",
    )
    http_write_coalescing: bool = Field(
        True,
        description="Join what one event-loop step writes to a client connection into one socket write "
        "(a non-streamed answer's headers and body: one send instead of two; "
        "service/runtime/http_protocol.py); false: uvicorn's own httptools protocol.",
    )
    gc_young_threshold: int = Field(
        5000,
        ge=100,
        le=100_000,
        description="Net new container objects before Python's cyclic garbage collector scans its "
        "youngest generation (the first value of gc.set_threshold; CPython's default is 700). The objects "
        "of the requests in flight are scanned at each collection: at 700 the collector took ~22 us of "
        "CPU per request at 64 concurrent requests, at 5000 ~1 us, its longest pauses unchanged (2-5 ms; "
        "bench c64).",
    )
    admin_token: SecretStr = Field(
        SecretStr(""), description="Bearer token for /admin routes (16+ chars); admin API off while empty."
    )
    key_pepper: SecretStr = Field(
        SecretStr("radixgate-default-pepper"),
        description="HMAC key mixed into stored API-key digests; set your own in production "
        "(changing it invalidates every issued key).",
    )
    redis: RedisSettings = Field(default_factory=RedisSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    api: ApiSettings = Field(default_factory=ApiSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    shutdown: ShutdownSettings = Field(default_factory=ShutdownSettings)
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    discovery: DiscoverySettings = Field(default_factory=DiscoverySettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    replicas: ReplicaSettings = Field(default_factory=ReplicaSettings)
    planner: PlannerSettings = Field(default_factory=PlannerSettings)
    pricing: PricingSettings = Field(default_factory=PricingSettings)
    priority_classes: dict[str, PriorityClassSettings] = Field(
        default_factory=default_priority_classes,
        description="JSON object replacing all classes: name -> {rank, sglang_priority, ttft_goal_ms, "
        "serve_late, queue_wait_budget_ms, max_queue_len, min_share, window_share}; higher rank first.",
    )
    default_priority_class: str = Field(
        DEFAULT_CLASS,
        description="Class of a tenant created without one, and of a stored tenant whose class is no "
        "longer among priority_classes (reported at startup, logged once per tenant).",
    )
    extra_models: list[str] = Field(
        default_factory=list, description="Further model ids served by the same workers (aliases)."
    )
    models: list[ModelSettings] = Field(
        default_factory=list,
        description="JSON list of served models, each {id, aliases, workers, tokenizer_path, "
        "context_length, owned_by, tool_call_format, tools, structured_outputs, routing, scheduler, "
        "priority_classes}; requests route by `model` to their model's workers (docs/models.md). Unset: "
        "one model from engine.served_model_name, extra_models, upstream.workers and the api section.",
    )
    config_file: Path | None = Field(
        None,
        description="TOML or YAML file of settings (`--config`), nested as the tree is ([redis] url = ...); "
        "environment variables override its values.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments, then the environment, then ``config_file`` (pydantic-settings' own file sources)."""
        return init_settings, env_settings, ConfigFileSource(settings_cls)

    @field_validator("admin_token")
    @classmethod
    def _admin_token_length(cls, value: SecretStr) -> SecretStr:
        secret = value.get_secret_value()
        if secret and len(secret) < 16:
            raise ValueError("admin_token must be at least 16 characters")
        return value

    @field_validator("models", mode="before")
    @classmethod
    def _models_are_one_list(cls, value: object) -> object:
        """``RADIXGATE_MODELS__<FIELD>=...`` reaches here as a map (pydantic-settings nests ``__`` names):
        name the variable and say that the models are one JSON list."""
        if isinstance(value, dict):
            names = [f"RADIXGATE_MODELS__{'__'.join(path).upper()}" for path in _leaf_paths(value)]
            raise ValueError(
                f"{', '.join(names)}: the models are one JSON list, "
                """RADIXGATE_MODELS='[{"id": ...}, ...]' (docs/models.md)"""
            )
        return value

    @field_validator("priority_classes")
    @classmethod
    def _some_class(cls, value: dict[str, PriorityClassSettings]) -> dict[str, PriorityClassSettings]:
        if not value:
            raise ValueError("at least one priority class is needed")
        return value

    @field_validator("default_priority_class")
    @classmethod
    def _default_class_is_configured(cls, value: str, info: ValidationInfo) -> str:
        classes = info.data.get("priority_classes")  # absent when the classes themselves were invalid
        if classes and value not in classes:
            raise ValueError(
                f"'{value}' is not a configured priority class ({', '.join(classes)}); name one of them "
                "(tenants created without a class, and those whose class was removed, run in it)"
            )
        return value

    @model_validator(mode="after")
    def _engine_paths_under_home(self) -> Settings:
        unset = {"python", "model_path"} - self.engine.model_fields_set
        if unset:
            paths = home_engine_paths(self.home)
            self.engine = self.engine.model_copy(update={name: paths[name] for name in unset})
        return self

    @model_validator(mode="after")
    def _one_process_launches_engines(self) -> Settings:
        if self.workers > 1 and self.engine.launch:
            raise ValueError(
                "workers > 1 needs engine.launch false: every gateway process would launch its own "
                "engines; run them with `python -m service worker` and list them in upstream.workers"
            )
        return self

    @model_validator(mode="after")
    def _models_resolve(self) -> Settings:
        check_priced_models(self.pricing, self.model_registry())  # ValueError: a model that does not resolve
        return self

    def model_registry(self) -> ModelRegistry:
        """The served models, each with its settings resolved (:func:`service.config.models.build_registry`).

        Raises:
            ValueError: see :func:`~service.config.models.build_registry`.
        """
        return build_registry(
            self.models,
            served_model_name=self.engine.served_model_name,
            extra_models=self.extra_models,
            workers=self.upstream.workers,
            tokenizer_path=self.tokenizer_path,
            context_length=self.api.context_length,
            tool_call_format=self.api.tool_call_format,
            classes=self.priority_classes,
            scheduler=self.scheduler,
            routing=self.routing,
        )

    def core_config(self) -> CoreConfig:
        """The admission core's configuration (classes, windows, routing) from these settings."""
        return replace(
            CoreConfig(),
            classes={name: c.policy() for name, c in self.priority_classes.items()},
            window=self.scheduler.window_config(),
            routing=self.routing.policy,
            cache_aware=self.routing.cache_aware_config(),
            max_queue_total=self.scheduler.max_queue_total,
            load_report_interval_s=self.scheduler.load_poll_interval_s,
            estimates=self.scheduler.estimate_config(),
            first_token_deadline_factor=self.scheduler.first_token_deadline_factor,
        )

    @property
    def served_models(self) -> list[str]:
        """Model ids and aliases the gateway answers for (``/v1/models``), each once, the served name
        first (every model's, :meth:`ModelRegistry.names`)."""
        return self.model_registry().names

    @property
    def tokenizer_path(self) -> Path:
        """Folder holding the tokenizer and chat template used to count prompt tokens."""
        return self.api.tokenizer_path or self.engine.model_path


def _leaf_paths(tree: dict[str, object], above: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The key paths to every leaf of a nested map."""
    paths: list[tuple[str, ...]] = []
    for key, value in tree.items():
        here = (*above, str(key))
        paths += _leaf_paths(value, here) if isinstance(value, dict) and value else [here]
    return paths

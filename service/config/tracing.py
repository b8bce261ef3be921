"""The tracing part of the Settings tree: OpenTelemetry traces of each request (``tracing.*``), off by
default.

Split from :mod:`service.config.settings`, which assembles the tree. What is traced, and how, is in
:mod:`service.observability.tracing` and docs/observability.md ("Tracing").
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from service.config.policies import FINITE


class TracingSettings(BaseModel):
    """OpenTelemetry traces: one SERVER span per admitted request with a child span per phase, exported
    over OTLP/HTTP (protobuf) in batches. Off: no tracer provider is built and a request pays one test."""

    model_config = FINITE

    enabled: bool = Field(False, description="Trace requests with OpenTelemetry (OTLP/HTTP export).")
    otlp_endpoint: str = Field(
        "http://localhost:4318/v1/traces",
        min_length=1,
        description="OTLP/HTTP traces endpoint the spans are sent to (a collector's /v1/traces).",
    )
    service_name: str = Field(
        "radixgate", min_length=1, description="The service.name resource attribute of the spans."
    )
    sample_ratio: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="Share of new traces recorded (trace-id ratio); a request that carries a traceparent "
        "follows its caller's sampled flag instead.",
    )

"""OpenTelemetry traces of requests: one ``SERVER`` span per admitted request, a child span per phase of its
:class:`~service.observability.breakdown.RequestTiming`, W3C trace context in from the client and out to
the worker, and the trace id for the latency histograms' exemplars.

Off by default (``tracing.enabled``): the app factory then builds no :class:`Tracing` (no tracer
provider, no exporter, no thread) and a request pays one ``is None`` test where it is admitted and one
where it ends. The provider is the app's own object (``app.state.tracing``), never OpenTelemetry's global
one: two apps in one process (tests) trace apart, and importing this module sets nothing.

Cost when on: the request span is started when the request is admitted (its start time set back to the
route's start), so its id exists before the upstream call carries it; the phase spans are made at the
end from the times :class:`RequestTiming` already holds, with explicit start and end times (nothing is
timed twice, no context is attached to the event loop's tasks). Spans go to a ``BatchSpanProcessor``
(a background thread exports them over OTLP/HTTP protobuf, ``opentelemetry-exporter-otlp-proto-http``).

Times: :class:`RequestTiming` keeps ``time.perf_counter()`` seconds; a span needs epoch nanoseconds. Each
request reads both clocks once when it is admitted and shifts its times by their difference.

Where each phase span lies (``[start, end]``, perf_counter s): see :func:`phase_windows`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from service.observability.breakdown import RequestTiming

TRACE_HEADERS = (b"traceparent", b"tracestate")
"""The W3C Trace Context request headers (https://www.w3.org/TR/trace-context/), ASGI's lowercase names."""

GATEWAY_PHASES = ("auth", "prepare", "quota", "route", "queue")
"""The gateway's own phases, one after another from the route's start (each ``RequestTiming.mark`` ends
one where the previous ended; ``route`` and ``queue`` follow ``quota``)."""

ENGINE_PHASES = ("engine_tokenize", "engine_queue", "engine_prefill")
"""The worker's phases: durations on the worker's clock, laid end to end so that the last ends at the
first token (the network's share of the attempt falls before them)."""

WORKER_CLOCK = "radixgate.phase.clock"
"""Attribute of a span whose duration was measured by the worker (value ``"worker"``)."""

SUMMED = "radixgate.phase.summed"
"""Attribute of a span that stands for several waits added up (``client_write``: each write that waited
for the client), laid at the request's end."""


def phase_windows(timing: RequestTiming, end: float) -> list[tuple[str, float, float]]:
    """``(phase, start, end)`` of each measured phase of a request that ended at ``end`` (perf_counter s),
    in :data:`service.observability.breakdown.PHASES` order:

    - :data:`GATEWAY_PHASES`: end to end from ``timing.start``;
    - ``retry``: the first attempt's start to the answering one's; ``upstream_connect``: that attempt's
      start to its headers;
    - :data:`ENGINE_PHASES`: end to end, the last ending at the first token (else at the answer's end),
      none starting before the answering attempt;
    - ``decode``: from the first token, its length; ``client_write``: its summed waits, ending at ``end``.
    """
    p = timing.phases
    out: list[tuple[str, float, float]] = []
    cursor = timing.start
    for name in GATEWAY_PHASES:
        d = p.get(name)
        if d is not None:
            out.append((name, cursor, cursor + d))
            cursor += d
    began = timing.attempt_at
    if "retry" in p and timing.first_attempt_at is not None and began is not None:
        out.append(("retry", timing.first_attempt_at, began))
    if "upstream_connect" in p and began is not None and timing.head_at is not None:
        out.append(("upstream_connect", began, timing.head_at))
    anchor = timing.first_token_at if timing.first_token_at is not None else timing.upstream_end
    if anchor is not None:
        engine: list[tuple[str, float, float]] = []
        for name in reversed(ENGINE_PHASES):
            d = p.get(name)
            if d is not None:
                start = anchor - d if began is None else max(began, anchor - d)
                engine.append((name, start, anchor))
                anchor = start
        out.extend(reversed(engine))
    if "decode" in p and timing.first_token_at is not None:
        out.append(("decode", timing.first_token_at, timing.first_token_at + p["decode"]))
    if "client_write" in p:
        out.append(("client_write", max(timing.start, end - p["client_write"]), end))
    return out


class RequestTrace:
    """One request's trace: its started ``SERVER`` span and the clock shift of its times.

    Attributes:
        span: the request's span (a non-recording one when the sampler dropped it).
        offset_ns: epoch ns minus perf_counter ns, read when the request was admitted.
    """

    __slots__ = ("_tracing", "offset_ns", "span")

    def __init__(self, tracing: Tracing, span: Span, offset_ns: int) -> None:
        self._tracing = tracing
        self.span = span
        self.offset_ns = offset_ns

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self.offset_ns

    @property
    def sampled(self) -> bool:
        """Whether this request's spans are recorded (and exported): the sampled flag of its context
        (``is_recording`` turns false once the span has ended)."""
        return self.span.get_span_context().trace_flags.sampled

    @property
    def trace_id(self) -> str:
        """The trace id, 32 lowercase hex characters (the client's when it sent a ``traceparent``)."""
        return format(self.span.get_span_context().trace_id, "032x")

    def headers(self) -> dict[str, str]:
        """``traceparent`` (and ``tracestate`` when the client sent one) naming the request span as the
        parent, for the worker's call (SGLang's ``external_trace_header``)."""
        carrier: dict[str, str] = {}
        self._tracing.propagator.inject(carrier, context=set_span_in_context(self.span))
        return carrier

    def exemplar(self) -> dict[str, str] | None:
        """``{"trace_id": ...}`` for a histogram observation of this request, when its trace is recorded
        (an exemplar naming a dropped trace would lead nowhere)."""
        return {"trace_id": self.trace_id} if self.sampled else None

    def finish(
        self,
        timing: RequestTiming,
        end: float,
        attributes: Mapping[str, Any],
        status: int,
        error: str | None = None,
    ) -> None:
        """End the request span at ``end`` (perf_counter s) with ``attributes`` and HTTP ``status``
        (``error``: the error code of a failed request), after a child span per phase
        (:func:`phase_windows`). A request the sampler dropped records nothing."""
        span = self.span
        if not span.is_recording():
            return
        tracer = self._tracing.tracer
        parent = set_span_in_context(span)
        for name, start, stop in phase_windows(timing, end):
            attrs: dict[str, Any] = {"radixgate.phase": name}
            if name in ENGINE_PHASES:
                attrs[WORKER_CLOCK] = "worker"
            elif name == "client_write":
                attrs[SUMMED] = True
            child = tracer.start_span(
                name, context=parent, kind=SpanKind.INTERNAL, attributes=attrs, start_time=self._ns(start)
            )
            child.end(end_time=self._ns(max(start, stop)))
        span.set_attributes(dict(attributes))
        span.set_attribute("http.response.status_code", status)
        if error is not None or status >= 400:
            span.set_attribute("error.type", error or str(status))
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self._ns(end))


class Tracing:
    """The app's tracer provider and what a request needs of it.

    Args:
        exporter: where finished spans go (OTLP in service, the SDK's ``InMemorySpanExporter`` in tests).
        service_name: the ``service.name`` resource attribute.
        sample_ratio: share of new traces recorded (``TraceIdRatioBased``); a traced caller's
            ``traceparent`` decides for its requests (``ParentBased``).
        batch: export from a background thread in batches (``BatchSpanProcessor``); False exports each
            span as it ends (tests).
    """

    def __init__(
        self, exporter: SpanExporter, service_name: str, sample_ratio: float = 1.0, batch: bool = True
    ) -> None:
        self.provider = TracerProvider(
            resource=Resource.create({SERVICE_NAME: service_name}),
            sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
        )
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("radixgate")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def otlp(cls, endpoint: str, service_name: str, sample_ratio: float) -> Tracing:
        """Spans exported over OTLP/HTTP (protobuf) to ``endpoint`` (a collector's ``/v1/traces``)."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(OTLPSpanExporter(endpoint=endpoint), service_name, sample_ratio)

    def parent(self, headers: Iterable[tuple[bytes, bytes]]) -> Context | None:
        """The caller's trace context from a request's ASGI ``headers`` (``traceparent``, ``tracestate``);
        None when it sent none (a malformed one is ignored: the request starts a trace of its own)."""
        carrier = {n.decode("latin-1"): v.decode("latin-1") for n, v in headers if n in TRACE_HEADERS}
        return self.propagator.extract(carrier) if carrier else None

    def begin(
        self,
        name: str,
        start: float,
        headers: Iterable[tuple[bytes, bytes]],
        attributes: Mapping[str, Any] | None = None,
    ) -> RequestTrace:
        """Start the ``SERVER`` span ``name`` of a request that started at ``start`` (perf_counter s), a
        child of the caller's trace when its ``headers`` carry one."""
        offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)
        span = self.tracer.start_span(
            name,
            context=self.parent(headers),
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=int(start * 1e9) + offset_ns,
        )
        return RequestTrace(self, span, offset_ns)

    def shutdown(self) -> None:
        """Export what is left and stop the processor's thread (the app's lifespan end)."""
        self.provider.shutdown()


__all__ = ["ENGINE_PHASES", "GATEWAY_PHASES", "RequestTrace", "Tracing", "phase_windows"]

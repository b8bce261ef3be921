"""A request's trace, begun where it is admitted and ended beside its log line
(:mod:`service.observability.tracing` holds the spans; this module knows the request).

Attributes of the request span, GenAI semantic conventions (opentelemetry-semantic-conventions 0.66b2,
``gen_ai_attributes.py``; the GenAI names now live in github.com/open-telemetry/semantic-conventions-genai):

- ``gen_ai.operation.name``: ``chat`` or ``text_completion``; ``gen_ai.request.model``: the model the
  request named (an id or an alias); ``gen_ai.response.model``: the canonical id that served it;
  ``gen_ai.request.max_tokens``.
- ``gen_ai.usage.input_tokens``, ``gen_ai.usage.output_tokens``, ``gen_ai.usage.cache_read.input_tokens``
  (the prompt tokens the worker's radix cache held); ``gen_ai.response.time_to_first_chunk``: the TTFT, s,
  when known (:mod:`service.observability.breakdown`).

radixgate's own: ``radixgate.request_id`` (the gateway's id), ``radixgate.client_request_id`` (the
caller's ``X-Request-Id``, when kept), ``radixgate.tenant.id`` (never the key, nor its id),
``radixgate.priority_class``, ``radixgate.stream``, ``radixgate.n``, ``radixgate.worker``,
``radixgate.attempts``, ``radixgate.resumes``, ``radixgate.shed_reason``, ``radixgate.retractions``; and
``http.request.method``, ``url.path``, ``http.response.status_code``, ``error.type``. No prompt or answer
text, no message, no key material.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, cast

from service.pipeline.prepare import PreparedRequest
from service.pipeline.upstream import Outcome

if TYPE_CHECKING:  # the SDK is the optional extra "otel": imported only when tracing is on
    from service.observability.tracing import RequestTrace, Tracing

TRACE_BODY_FIELD = "external_trace_header"
"""The SGLang ``/generate`` body field that carries the W3C trace headers (``GenerateReqInput
.external_trace_header``, sglang 0.5.23 ``srt/managers/io_struct.py``): with ``--enable-trace`` the
worker's tokenizer manager takes the trace context from it before the HTTP headers, and its spans join the
gateway's trace as children of the request span. A worker without ``--enable-trace`` ignores it."""


def begin_trace(tracing: Tracing, prepared: PreparedRequest, scope: MutableMapping[str, Any]) -> RequestTrace:
    """Start an admitted request's span (from its route's start, a child of the caller's
    ``traceparent`` when its ASGI ``scope`` has one), keep it on ``prepared.timing.trace``, and put the
    trace context into the worker's body (:data:`TRACE_BODY_FIELD`)."""
    operation = "chat" if prepared.chat else "text_completion"
    trace = tracing.begin(
        f"{operation} {prepared.model}",
        prepared.timing.start,
        scope["headers"],
        {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": prepared.model,
            "http.request.method": scope.get("method", "POST"),
            "url.path": scope.get("path", ""),
        },
    )
    prepared.timing.trace = trace
    prepared.body[TRACE_BODY_FIELD] = trace.headers()
    return trace


def end_trace(prepared: PreparedRequest, outcome: Outcome, latency: float) -> dict[str, str] | None:
    """End the request's span (its end ``latency`` s after its start) with its attributes and phase
    spans; returns the exemplar labels for its latency observations (None when it is not sampled). Only
    for a traced request (``prepared.timing.trace`` set by :func:`begin_trace`)."""
    trace = cast("RequestTrace", prepared.timing.trace)
    timing = prepared.timing
    attributes: dict[str, Any] = {
        "gen_ai.response.model": prepared.model_id or prepared.model,
        "gen_ai.request.max_tokens": prepared.max_tokens,
        "gen_ai.usage.input_tokens": outcome.prompt_tokens or prepared.prompt.num_tokens,
        "gen_ai.usage.output_tokens": outcome.completion_tokens,
        "gen_ai.usage.cache_read.input_tokens": outcome.cached_tokens,
        "radixgate.request_id": prepared.rid,
        "radixgate.tenant.id": prepared.tenant.id,
        "radixgate.priority_class": prepared.priority_class,
        "radixgate.stream": prepared.stream,
        "radixgate.n": prepared.n,
        "radixgate.attempts": outcome.attempts,
        "radixgate.resumes": outcome.resumes,
    }
    optional = {
        "gen_ai.response.time_to_first_chunk": outcome.ttft_s,
        "radixgate.client_request_id": timing.client_request_id,
        "radixgate.worker": outcome.worker,
        "radixgate.shed_reason": outcome.shed_reason,
        "radixgate.retractions": timing.retractions,
    }
    attributes.update({k: v for k, v in optional.items() if v is not None})
    trace.finish(timing, timing.start + latency, attributes, outcome.status, outcome.error_code)
    return trace.exemplar()


__all__ = ["TRACE_BODY_FIELD", "begin_trace", "end_trace"]

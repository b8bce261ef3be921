"""What a worker says of itself: its flags and limits (``GET /server_info``) and its load (``GET /metrics``).

Learned once per worker by :class:`service.workers.client.SGLangClient` and again after it was seen down (a
restart may change its flags).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class TokenLimits:
    """Token limits of a worker (or the tightest over several).

    Attributes:
        max_prompt_tokens: longest prompt the worker schedules, tokens.
        max_total_tokens: longest prompt + completion it runs without cutting ``max_new_tokens``, tokens.
    """

    max_prompt_tokens: int
    max_total_tokens: int

    def tightest(self, other: TokenLimits | None) -> TokenLimits:
        """The smaller of both limits, field by field."""
        if other is None:
            return self
        return TokenLimits(
            min(self.max_prompt_tokens, other.max_prompt_tokens),
            min(self.max_total_tokens, other.max_total_tokens),
        )


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker reports about itself on ``GET /server_info`` (SGLang's resolved server arguments
    merged with its scheduler's start-up info).

    Attributes:
        incremental_streaming: the worker runs with ``--incremental-streaming-output`` (streamed ``text``
            and ``output_ids`` are deltas, not cumulative); None when it does not say (SGLang's default,
            cumulative, is then assumed only where the chunks themselves cannot tell).
        limits: its token limits, None when it reports none.
        max_running: requests the engine runs at once (:func:`engine_max_running`), None when unknown;
            the admission core starts the worker's window there.
        model: the model name it serves (SGLang's ``served_model_name``; its model path unless
            ``--served-model-name`` was given; ``model_path`` when only that is given; else the first id
            of its ``/v1/models``, :meth:`with_listed_model`), None when it says none.
        context_length: the model's context length it reports, tokens: ``context_length`` (SGLang
            reports it only when ``--context-length`` was given), else ``max_req_input_len + 6`` (SGLang's
            ``max_req_len + 1``: the model's context, or less when the KV pool is smaller); None when it
            says neither.
    """

    incremental_streaming: bool | None = None
    limits: TokenLimits | None = None
    max_running: int | None = None
    model: str | None = None
    context_length: int | None = None

    @classmethod
    def parse(cls, payload: Any) -> WorkerInfo:
        """Read a ``/server_info`` body.

        Limits (SGLang 0.5.23, ``tp_worker.py`` and ``scheduler.py``): the scheduler's
        ``max_req_len = min(context_len - 1, kv_capacity - 1)`` and ``max_req_input_len = max_req_len - 5``;
        it refuses a prompt of ``max_req_input_len`` tokens or more and silently cuts ``max_new_tokens`` to
        ``max_req_len - prompt - 1``. So a prompt may have ``max_req_input_len - 1`` tokens and prompt +
        completion ``max_req_input_len + 4``. Without ``max_req_input_len`` the model's
        ``context_length`` is used the same way (``max_req_len = context_length - 1``).
        """
        if not isinstance(payload, dict):
            return cls()
        flag = payload.get("incremental_streaming_output")
        limits = None
        max_input = payload.get("max_req_input_len")
        context = payload.get("context_length")
        if isinstance(max_input, int) and max_input > 1:
            limits = TokenLimits(max_input - 1, max_input + 4)
        elif isinstance(context, int) and context > 7:
            limits = TokenLimits(context - 7, context - 2)
        return cls(
            incremental_streaming=flag if isinstance(flag, bool) else None,
            limits=limits,
            max_running=engine_max_running(payload),
            model=_named(payload.get("served_model_name")) or _named(payload.get("model_path")),
            context_length=context
            if isinstance(context, int) and context > 0
            else (max_input + 6 if isinstance(max_input, int) and max_input > 1 else None),
        )

    def with_listed_model(self, payload: Any) -> WorkerInfo:
        """This info with ``model`` from a ``GET /v1/models`` body (OpenAI's list: ``data[0].id``) when it
        had none."""
        if self.model is not None or not isinstance(payload, dict):
            return self
        data = payload.get("data")
        first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
        listed = _named(first.get("id"))
        return self if listed is None else replace(self, model=listed)


def _named(value: Any) -> str | None:
    """A non-empty string, else None."""
    return value if isinstance(value, str) and value else None


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """Load a worker reports on ``/metrics`` (summed over its DP ranks; SGLang 0.5.23's scheduler gauges,
    ``python/sglang/srt/observability/metrics_collector.py``).

    Attributes:
        running: ``sglang:num_running_reqs``, requests.
        queued: ``sglang:num_queue_reqs``, requests waiting inside the engine.
        kv_usage: ``sglang:token_usage``, fraction of the KV cache in use (0..1; the fullest rank).
        cache_hit_rate: ``sglang:cache_hit_rate``, prefix-cache hit rate 0..1 (mean over ranks); None
            when not reported.
        gen_throughput: ``sglang:gen_throughput``, generated tokens/s (summed over ranks); None when not
            reported.
        spec_accept_length: ``sglang:spec_accept_length``, mean tokens accepted per speculative verify
            step (mean over ranks); None without speculative decoding.
        spec_accept_rate: ``sglang:spec_accept_rate``, accepted drafts / proposed drafts, 0..1 (mean over
            ranks); None without speculative decoding.
    """

    running: int
    queued: int
    kv_usage: float
    cache_hit_rate: float | None = None
    gen_throughput: float | None = None
    spec_accept_length: float | None = None
    spec_accept_rate: float | None = None


_SUMMED = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput")
_MAXED = ("sglang:token_usage",)
_MEANED = ("sglang:cache_hit_rate", "sglang:spec_accept_length", "sglang:spec_accept_rate")
_READ = _SUMMED + _MAXED + _MEANED
# a sample line starts with its name, then its labels or a space (https://prometheus.io/docs/instrumenting/
# exposition_formats/#text-format-details); the rest of SGLang's text (about 100 families, histograms
# included) is skipped before parsing
_PREFIXES = tuple(f"{name}{end}" for name in _READ for end in ("{", " "))


def parse_load(metrics_text: str) -> WorkerLoad:
    """Read the load gauges (:class:`WorkerLoad`) from SGLang's Prometheus text.

    Only the lines of those gauges are parsed. With ``--enable-priority-scheduling`` SGLang adds a
    ``priority`` label: the total under ``priority=""`` and a breakdown under ``priority="<n>"``; only
    the totals are read (summing both counted every request twice). Ranks (``dp_rank``) are summed,
    the KV usage is the fullest rank's, rates are averaged.
    """
    lines = [line for line in metrics_text.splitlines() if line.startswith(_PREFIXES)]
    values: dict[str, list[float]] = {name: [] for name in _READ}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name in values and not sample.labels.get("priority"):
                values[sample.name].append(sample.value)

    def total(name: str) -> float:
        return sum(values[name])

    def mean(name: str) -> float | None:
        found = values[name]
        return sum(found) / len(found) if found else None

    return WorkerLoad(
        int(total("sglang:num_running_reqs")),
        int(total("sglang:num_queue_reqs")),
        max(values["sglang:token_usage"], default=0.0),
        cache_hit_rate=mean("sglang:cache_hit_rate"),
        gen_throughput=total("sglang:gen_throughput") if values["sglang:gen_throughput"] else None,
        spec_accept_length=mean("sglang:spec_accept_length"),
        spec_accept_rate=mean("sglang:spec_accept_rate"),
    )


def engine_max_running(info: Any) -> int | None:
    """``max_running_requests`` of a worker from its ``/server_info`` JSON: SGLang reports
    ``internal_states[i].effective_max_running_requests_per_dp`` per data-parallel rank (the explicit
    ``--max-running-requests`` or what it derived from the KV pool), summed here; else the top-level
    ``max_running_requests`` server argument; None when absent."""
    if not isinstance(info, dict):
        return None
    states = info.get("internal_states")
    if isinstance(states, list):
        per_dp = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)]
        values = [int(v) for v in per_dp if isinstance(v, int | float) and v > 0]
        if values:
            return sum(values)
    value = info.get("max_running_requests")
    return int(value) if isinstance(value, int | float) and value > 0 else None

"""Where one request's time went: its phases (:class:`RequestTiming`), for the ``Server-Timing`` header, the
``request`` log line and the ``radixgate_request_phase_seconds{phase}`` histogram.

The phases (:data:`PHASES`), in seconds, on the gateway's ``time.perf_counter()`` clock unless said:

- ``auth``: the route's start to the API key checked (auth cache, else Redis).
- ``prepare``: the body read and parsed, the prompt rendered and its tokens counted.
- ``quota``: the token buckets' reservation (a local lease, else one Redis script call).
- ``route``: the admission core's decision at arrival: shed, or queue and, when a window has room, the
  worker (cache-aware routing): :meth:`service.pipeline.scheduler.Scheduler.acquire` up to its answer.
- ``queue``: the wait in the gateway's queue after that decision, until the request holds a slot (a
  request routed later, when a slot frees, is routed within this wait).
- ``retry``: failed attempts before the answering one, and their backoff: the first attempt's start to
  the start of the attempt that answered (left out when the first one answered).
- ``upstream_connect``: that attempt's start to the worker's status line and headers: a connection (kept
  alive or new), the request written, the worker's accept. SGLang sends a stream's headers before it
  tokenizes; a non-streamed answer's come with its body, so this phase is a stream's only.
- ``engine_tokenize``: the worker's tokenizer, from its receipt of the request to its dispatch to the
  scheduler (SGLang's ``meta_info.api_server_dispatch_finish_ts - request_received_ts``, both on the
  worker's clock, so no clock skew between hosts enters).
- ``engine_queue``: the wait in the engine's own queue (``meta_info.queue_time``).
- ``engine_prefill``: the engine's forward passes up to the first token (``meta_info.prefill_finished_time
  - forward_entry_time``, the worker's clock).
- ``decode``: the first token to the last: a stream's as the gateway received them; a non-streamed
  answer's from the worker (``e2e_latency - first_token_latency``).
- ``client_write``: a stream's waits for the client to take its events (writes into a full socket
  buffer, uvicorn's flow control); a non-streamed answer is written after its log line, untimed.

SGLang reports the ``engine_*`` fields with ``--enable-metrics`` (0.5.23:
``srt/observability/req_time_stats.py``, ``convert_to_output_meta_info``; the launcher passes the flag),
the simulated worker the same from its simulated schedule (``loadgen/sim/timing.py``). A worker that
reports none leaves them out.

A stream's TTFT is its first token's arrival at the gateway minus the route's start. The phases up to it
(:data:`TTFT_PHASES`) are each measured, none is a remainder, so their sum is the share of the TTFT they
explain (:meth:`RequestTiming.ttft_share`; ``python -m loadgen breakdown-share`` measures it under load); what
is left is time nothing names: the network both ways, the worker's detokenizer and IPC, and the event
loop's waits between the gateway's steps. A non-streamed answer's TTFT is known only from the worker: the
attempt's start plus the worker's ``first_token_latency``; without it the TTFT is left out, never
replaced by the end-to-end time.

``Server-Timing``: W3C Server Timing (https://www.w3.org/TR/server-timing/), ``name;dur=<ms>`` entries
joined by ``", "``: the phases measured when the headers go out, and ``ttft``.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Mapping
from typing import Any

from service.observability.buckets import SLO_BUCKETS_S

PHASES = (
    "auth",
    "prepare",
    "quota",
    "route",
    "queue",
    "retry",
    "upstream_connect",
    "engine_tokenize",
    "engine_queue",
    "engine_prefill",
    "decode",
    "client_write",
)
"""Every phase name, in the order a request meets them (the ``phase`` label)."""

TTFT_PHASES = PHASES[:10]
"""The phases that end by a stream's first token: their sum over its TTFT is the share they explain."""

_GAP_SLOTS = len(SLO_BUCKETS_S) + 1  # the +Inf bucket last


def _seconds(value: Any) -> float | None:
    """A non-negative finite number of a worker's ``meta_info``, else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1e12:
        return float(value)
    return None


def _between(meta: Mapping[str, Any], start: str, end: str) -> float | None:
    """``meta[end] - meta[start]`` (two times on the worker's clock, s) when both are there and in order."""
    a, b = _seconds(meta.get(start)), _seconds(meta.get(end))
    return b - a if a and b and b >= a else None


def engine_phases(meta: Mapping[str, Any]) -> dict[str, float]:
    """The ``engine_*`` phases (s) a worker's ``meta_info`` reports, by name (see the module docstring);
    the ones it does not report are missing."""
    out: dict[str, float] = {}
    tokenize = _between(meta, "request_received_ts", "api_server_dispatch_finish_ts")
    if tokenize is not None:
        out["engine_tokenize"] = tokenize
    queue = _seconds(meta.get("queue_time"))
    if queue is not None:
        out["engine_queue"] = queue
    prefill = _between(meta, "forward_entry_time", "prefill_finished_time")
    if prefill is not None:
        out["engine_prefill"] = prefill
    return out


class RequestTiming:
    """The phases of one request as it runs (see the module docstring), and its token times.

    Args:
        start: the route's start, ``time.perf_counter()`` s (default now).

    Attributes:
        start: the route's start, s.
        phases: phase name -> seconds, for the phases measured so far.
        ttft_s: the start to the first token, s (None until known).
        attempt_at, first_attempt_at: when the answering and the first attempt started (perf_counter s).
        head_at: when the answering attempt's headers came (perf_counter s; streams).
        first_token_at, last_token_at: a stream's first and latest chunk (perf_counter s).
        upstream_end: when the worker's answer ended (its last chunk), perf_counter s.
        retractions: times the engine retracted the request (``meta_info.num_retractions``), if reported.
        client_write_s: the stream's waits on the client so far, s.
        client_request_id: the caller's own ``X-Request-Id`` (sanitized), for its log line and span.
        trace: its :class:`service.observability.tracing.RequestTrace` when tracing is on (else None).
    """

    __slots__ = (
        "_gap_sum",
        "_gaps",
        "_mark",
        "attempt_at",
        "client_request_id",
        "client_write_s",
        "first_attempt_at",
        "first_token_at",
        "head_at",
        "last_token_at",
        "phases",
        "retractions",
        "start",
        "trace",
        "ttft_s",
        "upstream_end",
    )

    def __init__(self, start: float | None = None) -> None:
        self.start = time.perf_counter() if start is None else start
        self._mark = self.start
        self.phases: dict[str, float] = {}
        self.ttft_s: float | None = None
        self.attempt_at: float | None = None
        self.first_attempt_at: float | None = None
        self.head_at: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.upstream_end: float | None = None
        self.retractions: int | None = None
        self.client_write_s = 0.0
        self.client_request_id: str | None = None
        self.trace: object | None = None  # a RequestTrace (not imported: tracing imports this module)
        self._gaps: list[int] | None = None
        self._gap_sum = 0.0

    # -- the gateway's steps ---------------------------------------------------------------------------
    def mark(self, phase: str, now: float | None = None) -> None:
        """End ``phase`` at ``now`` (default the clock's now): it lasted since the previous mark (the start
        for the first)."""
        now = time.perf_counter() if now is None else now
        self.phases[phase] = max(0.0, now - self._mark)
        self._mark = now

    def queued(self, route_s: float, wait_s: float) -> None:
        """The scheduler's decision took ``route_s`` and the wait after it ``wait_s`` (s)."""
        self.phases["route"] = route_s
        self.phases["queue"] = wait_s

    def attempt(self, now: float) -> None:
        """An attempt on a worker starts at ``now``; ignored after the first token (a resume)."""
        if self.first_token_at is None and self.ttft_s is None:
            if self.first_attempt_at is None:
                self.first_attempt_at = now
            self.attempt_at = now
            self.head_at = None

    def headers(self, now: float) -> None:
        """The answering attempt's status line and headers came at ``now`` (a stream's)."""
        if self.first_token_at is None:
            self.head_at = now

    def _attempt_phases(self) -> None:
        p = self.phases
        began = self.attempt_at
        if began is None:
            return
        if self.first_attempt_at is not None and began > self.first_attempt_at:
            p["retry"] = began - self.first_attempt_at
        if self.head_at is not None and self.head_at >= began:
            p["upstream_connect"] = self.head_at - began

    def first_chunk(self, now: float, meta: Mapping[str, Any] | None) -> None:
        """A stream's first chunk came at ``now`` (the first token), with its ``meta_info``."""
        if self.first_token_at is not None:
            return
        self._attempt_phases()
        if meta:
            self.phases.update(engine_phases(meta))
        self.first_token_at = self.last_token_at = now
        self.ttft_s = now - self.start

    def token(self, now: float) -> None:
        """A stream's next chunk came at ``now``: its gap since the previous one is tallied (ITL)."""
        last = self.last_token_at
        if last is None:
            return
        gap = now - last
        self.last_token_at = now
        gaps = self._gaps
        if gaps is None:
            gaps = self._gaps = [0] * _GAP_SLOTS
        gaps[bisect_left(SLO_BUCKETS_S, gap)] += 1
        self._gap_sum += gap

    def stream_ended(self, now: float, meta: Mapping[str, Any] | None) -> None:
        """A stream's last chunk came at ``now``, with its ``meta_info`` (SGLang sends the tokenizer's
        times with the last one only)."""
        self.upstream_end = now
        if self.first_token_at is not None and self.last_token_at is not None:
            self.phases["decode"] = self.last_token_at - self.first_token_at
        if meta:
            for name, value in engine_phases(meta).items():
                self.phases.setdefault(name, value)
            self._retractions(meta)

    def answered(self, now: float, meta: Mapping[str, Any] | None) -> None:
        """A non-streamed answer came whole at ``now``, with its ``meta_info``: its TTFT is the attempt's
        start plus the worker's ``first_token_latency`` when it reports one (and it fits before ``now``)."""
        self.upstream_end = now
        self._attempt_phases()
        if not meta:
            return
        self.phases.update(engine_phases(meta))
        self._retractions(meta)
        latency = _seconds(meta.get("first_token_latency"))
        began = self.attempt_at
        if latency is None or began is None or began + latency > now:
            return
        self.first_token_at = began + latency
        self.ttft_s = self.first_token_at - self.start
        e2e = _seconds(meta.get("e2e_latency"))
        if e2e is not None and e2e >= latency:
            self.phases["decode"] = e2e - latency

    def _retractions(self, meta: Mapping[str, Any]) -> None:
        n = meta.get("num_retractions")
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
            self.retractions = n

    def wrote(self, waited_s: float) -> None:
        """One write to the client waited ``waited_s`` (s)."""
        self.client_write_s += waited_s

    def finish(self) -> None:
        """The request ended: the client's waits become the ``client_write`` phase."""
        if self.client_write_s > 0:
            self.phases["client_write"] = self.client_write_s

    # -- what it comes to --------------------------------------------------------------------------------
    def gap_tally(self) -> tuple[list[int], float] | None:
        """The stream's inter-chunk gaps as bucket counts (:data:`SLO_BUCKETS_S`, ``+Inf`` last) and their
        sum, s; None with fewer than two chunks."""
        return None if self._gaps is None else (self._gaps, self._gap_sum)

    def itl_mean_s(self) -> float | None:
        """Mean gap between a stream's chunks (inter-token latency), s; None with fewer than two."""
        if self._gaps is None:
            return None
        return self._gap_sum / sum(self._gaps)

    def tpot_s(self, completion_tokens: int) -> float | None:
        """Mean time per output token after the first, ``decode / (tokens - 1)``, s; None for fewer than
        two tokens or an unknown decode (the definition of vLLM's and SGLang's serving benchmarks)."""
        decode = self.phases.get("decode")
        if decode is None or completion_tokens < 2:
            return None
        return decode / (completion_tokens - 1)

    def ttft_share(self) -> float | None:
        """The share of the TTFT its named phases explain (:data:`TTFT_PHASES` summed over the TTFT)."""
        if self.ttft_s is None or self.ttft_s <= 0:
            return None
        return sum(self.phases.get(p, 0.0) for p in TTFT_PHASES) / self.ttft_s

    def overhead_s(self, e2e_s: float) -> float:
        """The gateway's own time, s: ``e2e_s`` minus the queue, the retries, the answering attempt's span
        (its start to its answer's end, or to the request's end when the request ended while the worker
        still had it: a client that left, a revoked key, a stream cut at shutdown) and the waits on the
        client; 0 at least."""
        p = self.phases
        worker = 0.0
        if self.attempt_at is not None:
            end = self.upstream_end if self.upstream_end is not None else self.start + e2e_s
            worker = max(0.0, end - self.attempt_at)
        spent = p.get("queue", 0.0) + p.get("retry", 0.0) + worker + self.client_write_s
        return max(0.0, e2e_s - spent)

    def server_timing(self) -> str:
        """The ``Server-Timing`` header value: the phases measured so far and ``ttft`` when known (ms)."""
        p = self.phases
        entries = [f"{name};dur={p[name] * 1000:.3f}" for name in PHASES if name in p]
        if self.ttft_s is not None:
            entries.append(f"ttft;dur={self.ttft_s * 1000:.3f}")
        return ", ".join(entries)

    def phases_ms(self) -> dict[str, float]:
        """The measured phases in ms (3 decimals), in :data:`PHASES` order (the log line's ``phases_ms``)."""
        p = self.phases
        return {name: round(p[name] * 1000, 3) for name in PHASES if name in p}


def parse_server_timing(value: str) -> dict[str, float]:
    """``name -> dur`` (ms) of a ``Server-Timing`` header value (an entry without ``dur`` reads 0); for
    clients and tests.

    Raises:
        ValueError: an entry's name is not an HTTP token, or its ``dur`` not a number.
    """
    out: dict[str, float] = {}
    for entry in value.split(","):
        parts = [p.strip() for p in entry.split(";")]
        name = parts[0]
        if not name or not all(c.isalnum() or c in "!#$%&'*+-.^_`|~" for c in name):
            raise ValueError(f"not a Server-Timing metric name: {name!r}")
        dur = 0.0
        for param in parts[1:]:
            key, _, raw = param.partition("=")
            if key.strip().lower() == "dur":
                dur = float(raw.strip().strip('"'))
        out[name] = dur
    return out


__all__ = ["PHASES", "TTFT_PHASES", "RequestTiming", "engine_phases", "parse_server_timing"]

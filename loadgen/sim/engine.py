"""Virtual-time model of one SGLang worker's scheduler (a simulator: no model runs, only timing and state).

Pure and time-injected: the caller owns the clock, so the same engine is driven by the HTTP server in real
time (:mod:`loadgen.sim.server`) and by a discrete-event fleet simulation in virtual time. Times are
seconds (floats) on the caller's clock; sizes are tokens.

Use::

    engine = SimEngine(profile, seed=0)
    engine.submit(SimRequest(rid="r1", prompt=ids, max_new_tokens=64, priority=0), now=0.0)
    while (t := engine.next_event_time()) is not None:
        for ev in engine.advance(t):  # SimEvent: one per generated token, the last has finish_reason
            ...

Scheduling follows SGLang's default scheduler (``--schedule-policy fcfs --enable-priority-scheduling``,
no ``--enable-mixed-chunk``): each step is *either* a prefill step or a decode step. A profile with
``mixed_chunk`` (SGLang's ``--enable-mixed-chunk``, like TensorRT-LLM's in-flight batching) instead runs
the prefill chunks and the decode tokens in one step whose cost is the decode cost plus the prefill tokens'.

- Prefill step, whenever a waiting request can be admitted or a chunked prefill is unfinished: admit
  waiting requests by (higher ``priority`` first, then arrival) while running requests <
  ``max_running_requests`` and the KV pool holds their uncached prompt plus ``new_token_ratio`` of their
  ``max_new_tokens`` (and the same reserve for every running request), evicting unlocked cache LRU first.
  Prompts are prefilled in chunks of at most ``chunked_prefill_tokens`` tokens per step (chunked prefill,
  as SGLang's ``--chunked-prefill-size``); a request's prefill emits its first token.
- Decode step otherwise: one token for every running request. If the pool cannot hold the new tokens
  even after eviction, the lowest-priority, latest request is retracted to the queue (SGLang's
  ``retract_decode``); it resumes later by prefilling its prompt plus the tokens it had generated.
- Priority preemption: if the best waiting request cannot be admitted (slots or KV), running requests
  with a priority lower by more than ``preemption_threshold`` are retracted, lowest first (SGLang's rule in
  ``schedule_policy.py``, ``preempt_to_schedule``: ``priority_diff > threshold``).
- Prefix cache: a :class:`~loadgen.sim.radix.RadixCache` in the same pool. A request's prompt is matched
  at admission (``cached_tokens``, capped at prompt length − 1 as SGLang does), inserted when its prefill
  ends and locked while it runs; prompt + output are inserted when it finishes.
- Request times (:class:`RequestTimes`, on every :class:`SimEvent`): SGLang's scheduler-side timestamps
  of ``--enable-metrics`` (0.5.23, ``srt/observability/req_time_stats.py``, ``SchedulerReqTimeStats``):
  the floor passed (the waiting queue's entry), the first forward (the start of the step that admitted
  it), the end of its prefill, the time it waited in the queue (the first wait plus every wait after a
  retraction), and its retractions.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from loadgen.sim.profiles import SimProfile
from loadgen.sim.radix import RadixCache, RadixNode
from loadgen.sim.tokens import output_token_id, prompt_key
from policies.classes import PREEMPTION_THRESHOLD

FinishReason = Literal["length", "stop", "abort"]
StepKind = Literal["prefill", "decode", "mixed"]

STEP_HISTORY_S = 10.0
"""How much virtual time of finished steps :attr:`SimEngine.steps` keeps (s)."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    """A generation request.

    Attributes:
        rid: unique request id.
        prompt: prompt token ids (at least one).
        max_new_tokens: most tokens to generate.
        priority: larger runs first (SGLang's default order).
        stop_at: the simulated model "emits EOS" after this many tokens (finish ``stop``); None = never.
        salt: varies the output text (0 = greedy).
    """

    rid: str
    prompt: tuple[int, ...]
    max_new_tokens: int
    priority: int = 0
    stop_at: int | None = None
    salt: int = 0


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """One request's scheduler times, s on the engine's clock (SGLang 0.5.23's ``SchedulerReqTimeStats``
    with ``--enable-metrics``; the field each stands for in brackets).

    Attributes:
        ready_s: the TTFT floor passed: the request is in the waiting queue (``wait_queue_entry_time``, its
            first; SGLang's tokenizer hands it over then: ``api_server_dispatch_finish_time``).
        forward_entry_s: the start of the step that first admitted it (``forward_entry_time``), or None.
        prefill_finished_s: the end of the step that finished its (first) prefill and gave its first
            token (``prefill_finished_time``), or None.
        queue_s: time spent waiting to be admitted, s: the first wait plus the wait after each retraction
            (``queue_duration_s``, reported as ``meta_info.queue_time``).
        retractions: times it was retracted, for KV space or a higher priority (``Req.retraction_count``,
            reported as ``meta_info.num_retractions``).
    """

    ready_s: float
    forward_entry_s: float | None = None
    prefill_finished_s: float | None = None
    queue_s: float = 0.0
    retractions: int = 0


@dataclass(frozen=True, slots=True)
class SimEvent:
    """One generated token of a request (the last one carries ``finish_reason``).

    Attributes:
        time_s: when the step that produced it ended.
        rid: request id.
        token_id: the generated token.
        completion_tokens: tokens generated so far, this one included.
        prompt_tokens: prompt length (tokens).
        cached_tokens: prompt tokens served from the prefix cache at first admission.
        finish_reason: ``length`` / ``stop`` on the last token, else None.
        times: the request's scheduler times as of this token (None where an engine does not report them).
    """

    time_s: float
    rid: str
    token_id: int
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int
    finish_reason: FinishReason | None
    times: RequestTimes | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Gauges in SGLang's terms (``sglang:*`` metrics).

    Attributes:
        num_running_reqs: requests admitted (prefilling or decoding).
        num_queue_reqs: requests waiting (including those still in the TTFT floor).
        num_used_tokens: KV slots held by running requests (tokens).
        token_usage: ``num_used_tokens`` / pool size.
        cache_tokens: tokens in the prefix cache (locked or not).
        cache_hit_rate: cached / all prompt tokens over all admissions so far.
        gen_throughput: generated tokens/s over the last steps (up to 5 s of virtual time).
        prompt_tokens_total, generation_tokens_total, cached_tokens_total: counters (tokens).
        preemptions_total: retractions (KV pressure or priority).
        retracted_requests_total, retracted_input_tokens_total, retracted_output_tokens_total: the
            retractions for KV space during decode only (SGLang's ``retract_decode``, the
            ``sglang:num_retracted_*_total`` counters), with the prompt and output tokens of the retracted.
    """

    num_running_reqs: int
    num_queue_reqs: int
    num_used_tokens: int
    token_usage: float
    cache_tokens: int
    cache_hit_rate: float
    gen_throughput: float
    prompt_tokens_total: int
    generation_tokens_total: int
    cached_tokens_total: int
    preemptions_total: int
    retracted_requests_total: int = 0
    retracted_input_tokens_total: int = 0
    retracted_output_tokens_total: int = 0


class _Req:
    """Mutable scheduler state of one request."""

    __slots__ = (
        "cached",
        "chunk",
        "done",
        "filled",
        "key",
        "node",
        "outputs",
        "own_kv",
        "prefilling",
        "ready_s",
        "req",
        "running",
        "seq",
        "times",
        "waiting_since_s",
    )

    def __init__(self, req: SimRequest, seq: int, ready_s: float) -> None:
        self.req = req
        self.seq = seq
        self.ready_s = ready_s
        self.key = prompt_key(req.prompt)
        self.outputs: list[int] = []
        self.cached: int | None = None  # reported cached_tokens (first admission)
        self.node: RadixNode | None = None  # locked cache node of the matched/inserted prefix
        self.filled = 0  # leading tokens of prompt + outputs whose KV exists (cached prefix included)
        self.own_kv = 0  # KV slots held outside the cache
        self.chunk = 0  # tokens being prefilled in the step in flight
        self.running = False  # admitted (prefilling or decoding)
        self.prefilling = False  # admitted, prefill not finished
        self.done = False
        self.times = RequestTimes(ready_s)  # replaced (never changed) as it moves: events share it
        self.waiting_since_s = ready_s  # its latest entry into the waiting queue

    def fill_target(self) -> tuple[int, ...]:
        return self.req.prompt + tuple(self.outputs)

    def context(self) -> int:
        return len(self.req.prompt) + len(self.outputs)

    def order(self) -> tuple[int, int]:
        return (-self.req.priority, self.seq)

    # request times (RequestTimes): a few per request, none per token
    def entered_forward(self, now: float) -> None:
        """Admitted at ``now`` (the start of a step): its wait since the queue's entry ends."""
        t = self.times
        self.times = RequestTimes(
            t.ready_s,
            now if t.forward_entry_s is None else t.forward_entry_s,
            t.prefill_finished_s,
            t.queue_s + max(0.0, now - self.waiting_since_s),
            t.retractions,
        )

    def prefill_finished(self, now: float) -> None:
        """Its prefill finished at ``now``; only the first one counts (a resume after a retraction's not)."""
        t = self.times
        if t.prefill_finished_s is None:
            self.times = RequestTimes(t.ready_s, t.forward_entry_s, now, t.queue_s, t.retractions)

    def retracted(self, now: float) -> None:
        """Sent back to the waiting queue at ``now``."""
        t = self.times
        self.waiting_since_s = now
        self.times = RequestTimes(
            t.ready_s, t.forward_entry_s, t.prefill_finished_s, t.queue_s, t.retractions + 1
        )


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One forward pass the engine ran, for models of the hardware beneath it (:mod:`loadgen.sim.dcgm`).

    Attributes:
        kind: ``prefill``, ``decode`` or ``mixed``.
        start_s, end_s: its span on the engine's clock (s).
        prefill_ms, decode_ms: its nominal cost (the profile's step model, before slowdowns and jitter)
            split into the prefill tokens' part and the decode part (the step base, the batch and the
            KV reads), ms. A prefill step's base is in ``prefill_ms``.
        prefill_factor, decode_factor: the slowdowns of :class:`SimEngine` applied to each part.
        tokens: tokens the step computed (prefill tokens + decoding sequences, phantom ones included).
    """

    kind: StepKind
    start_s: float
    end_s: float
    prefill_ms: float
    decode_ms: float
    prefill_factor: float
    decode_factor: float
    tokens: int


@dataclass(slots=True)
class _Step:
    kind: StepKind
    start_s: float
    end_s: float
    members: list[_Req]
    record: StepRecord | None = None


class SimEngine:
    """One simulated SGLang worker (see the module docstring).

    Args:
        profile: step-time and capacity parameters.
        seed: seeds the step-duration jitter; equal seeds and inputs give equal events.
        preemption_threshold: a waiting request preempts running ones whose priority is lower by more than
            this (SGLang's ``--priority-scheduling-preemption-threshold``; the launcher's default).
    """

    def __init__(
        self, profile: SimProfile, seed: int = 0, preemption_threshold: int = PREEMPTION_THRESHOLD
    ) -> None:
        self.profile = profile
        self.preemption_threshold = preemption_threshold
        self.slowdown = 1.0  # multiplies step durations (fault injection: "slow")
        # performance knobs (loadgen.sim.knobs): each part of a step slowed apart, phantom decoding
        # sequences riding in every decode step, a share of requests that skip the prefix cache
        self.prefill_slowdown = 1.0
        self.decode_slowdown = 1.0
        self.extra_batch = 0
        self.extra_context_tokens = 0
        self.uncached_share = 0.0
        self._miss_rng = random.Random(seed + 0x5EED)  # apart from the jitter's, which stays as it was
        #: the steps finished in the last :data:`STEP_HISTORY_S` s, oldest first
        self.steps: deque[StepRecord] = deque()
        self.cache = RadixCache()
        self._rng = random.Random(seed)
        self._now = 0.0
        self._seq = 0
        self._reqs: dict[str, _Req] = {}
        self._waiting: list[_Req] = []
        self._running: list[_Req] = []
        self._step: _Step | None = None
        self._recent: deque[tuple[float, int]] = deque()
        self._counters = {"prompt": 0, "generated": 0, "cached": 0, "preempted": 0}
        self._kv_retracted = [0, 0, 0]  # retract_decode: requests, their prompt and output tokens

    # ----- public API -------------------------------------------------------------------------------------
    @property
    def now(self) -> float:
        """The engine's clock: the last time it was advanced to (s)."""
        return self._now

    @property
    def step_in_flight(self) -> StepRecord | None:
        """The step running now (its end may lie ahead of :attr:`now`), or None."""
        return None if self._step is None else self._step.record

    def submit(self, req: SimRequest, now: float) -> None:
        """Queue ``req`` arriving at ``now`` (s); it can be scheduled after the profile's TTFT floor.

        Raises:
            ValueError: empty prompt, ``max_new_tokens`` < 1, duplicate rid, or longer than the context
                length or the KV pool.
        """
        limit = min(self.profile.context_length, self.profile.kv_capacity_tokens)
        if not req.prompt or req.max_new_tokens < 1:
            raise ValueError("a request needs at least one prompt token and max_new_tokens >= 1")
        if len(req.prompt) + req.max_new_tokens > limit:
            raise ValueError(f"prompt + max_new_tokens exceeds {limit} tokens")
        if req.rid in self._reqs:
            raise ValueError(f"duplicate rid {req.rid!r}")
        state = _Req(req, self._seq, max(now, self._now) + self.profile.ttft_floor_ms / 1000)
        self._seq += 1
        self._reqs[req.rid] = state
        self._waiting.append(state)

    def abort(self, rid: str) -> bool:
        """Drop request ``rid`` wherever it is; its KV is freed at once. False if unknown or finished."""
        state = self._reqs.pop(rid, None)
        if state is None:
            return False
        if state in self._waiting:
            self._waiting.remove(state)
        if state.running:
            self._running.remove(state)
            self._release(state, keep=False)
        state.done = True
        return True

    def next_event_time(self) -> float | None:
        """When :meth:`advance` next has something to do (s), or None when idle."""
        if self._step is not None:
            return self._step.end_s
        if not self._waiting and not self._running:
            return None
        return max(self._now, min((r.ready_s for r in self._waiting), default=self._now))

    def advance(self, until: float) -> list[SimEvent]:
        """Run every step that ends by ``until`` (s); returns their tokens in time order."""
        events: list[SimEvent] = []
        while True:
            if self._step is None:
                self._start_step()
                if self._step is None:
                    ready = [r.ready_s for r in self._waiting if r.ready_s > self._now]
                    if ready and min(ready) <= until:
                        self._now = min(ready)
                        continue
                    self._now = max(self._now, until)
                    return events
            if self._step.end_s > until:
                return events
            step, self._step = self._step, None
            self._now = step.end_s
            self._note_step(step)
            events.extend(self._finish_step(step))

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests run, as SGLang does."""
        if self._running or self.cache.locked_tokens:
            return False
        self.cache.reset()
        return True

    def stats(self) -> EngineStats:
        """Current gauges and counters."""
        used = self.cache.locked_tokens + self._own_kv()
        window = [(t, n) for t, n in self._recent if t >= self._now - 5.0]
        span = self._now - window[0][0] if len(window) > 1 else 0.0
        c = self._counters
        return EngineStats(
            num_running_reqs=len(self._running) + (self.extra_batch if self._running else 0),
            num_queue_reqs=len(self._waiting),
            num_used_tokens=used,
            token_usage=used / self.profile.kv_capacity_tokens,
            cache_tokens=self.cache.total_tokens,
            cache_hit_rate=c["cached"] / c["prompt"] if c["prompt"] else 0.0,
            gen_throughput=sum(n for _, n in window[1:]) / span if span > 0 else 0.0,
            prompt_tokens_total=c["prompt"],
            generation_tokens_total=c["generated"],
            cached_tokens_total=c["cached"],
            preemptions_total=c["preempted"],
            retracted_requests_total=self._kv_retracted[0],
            retracted_input_tokens_total=self._kv_retracted[1],
            retracted_output_tokens_total=self._kv_retracted[2],
        )

    # ----- scheduling ---------------------------------------------------------------------------------------
    def _own_kv(self) -> int:
        return sum(r.own_kv for r in self._running) + self._phantom_kv()

    def _phantom_kv(self) -> int:
        """KV slots the phantom sequences hold (:attr:`extra_batch`), while real requests run."""
        return self.extra_batch * self.extra_context_tokens if self._running else 0

    def _free(self) -> int:
        return self.profile.kv_capacity_tokens - self.cache.total_tokens - self._own_kv()

    def _reserve(self, r: _Req) -> int:
        return math.ceil((r.req.max_new_tokens - len(r.outputs)) * self.profile.new_token_ratio)

    def _allocate(self, tokens: int) -> bool:
        """Make ``tokens`` KV slots free, evicting cache; False if even that is not enough."""
        short = tokens - self._free()
        if short > 0:
            self.cache.evict(short)
        return self._free() >= tokens

    def _start_step(self) -> None:
        now = self._now
        members = self._plan_prefill(now)
        prefill_tokens = sum(r.chunk for r in members)
        if members and not self.profile.mixed_chunk:
            self._begin("prefill", now, self.profile.prefill_step_ms(prefill_tokens), members, prefill_tokens)
            return
        decoding = [r for r in self._running if not r.prefilling]
        while decoding and not self._allocate(len(decoding)):
            victim = max(decoding, key=lambda r: (-r.req.priority, r.seq))
            self._retract_for_kv(victim)
            decoding.remove(victim)
        if not decoding and not members:
            return
        for r in decoding:
            r.own_kv += 1
        kv = sum(r.context() for r in decoding)
        batch, kv = self._with_phantoms(len(decoding), kv)
        decode_ms = self.profile.decode_step_ms(batch, kv)
        prefill_ms = self.profile.prefill_ms_per_token * prefill_tokens
        kind: StepKind = "mixed" if members else "decode"
        self._begin(kind, now, prefill_ms, members + decoding, prefill_tokens + batch, decode_ms)

    def _with_phantoms(self, batch: int, kv_tokens: int) -> tuple[int, int]:
        """A decode step's batch and context tokens with the phantom sequences (:attr:`extra_batch`)."""
        if not batch:
            return batch, kv_tokens
        return batch + self.extra_batch, kv_tokens + self.extra_batch * self.extra_context_tokens

    def _begin(
        self,
        kind: StepKind,
        now: float,
        prefill_ms: float,
        members: list[_Req],
        tokens: int,
        decode_ms: float = 0.0,
    ) -> None:
        jitter = 1.0 + self.profile.step_jitter * self._rng.uniform(-1.0, 1.0)
        pf, df = self.prefill_slowdown, self.decode_slowdown
        ms = prefill_ms * pf + decode_ms * df
        end = now + ms * jitter * self.slowdown / 1000
        record = StepRecord(kind, now, end, prefill_ms, decode_ms, pf, df, tokens)
        self._step = _Step(kind, now, end, members, record)

    def _note_step(self, step: _Step) -> None:
        """Keep ``step``'s record in :attr:`steps` (the last :data:`STEP_HISTORY_S` s)."""
        if step.record is not None:
            self.steps.append(step.record)
        while self.steps and self.steps[0].end_s < self._now - STEP_HISTORY_S:
            self.steps.popleft()

    def _plan_prefill(self, now: float) -> list[_Req]:
        budget = self.profile.chunked_prefill_tokens
        members: list[_Req] = []
        for r in self._running:  # an unfinished chunked prefill goes first
            if r.prefilling and budget > 0:
                members.append(self._take_chunk(r, budget))
                budget -= r.chunk
        for r in sorted((w for w in self._waiting if w.ready_s <= now), key=_Req.order):
            if budget <= 0 or not self._admit(r, now):
                break
            members.append(self._take_chunk(r, budget))
            budget -= r.chunk
        return [m for m in members if m.chunk > 0] if members else []

    def _take_chunk(self, r: _Req, budget: int) -> _Req:
        r.chunk = min(len(r.fill_target()) - r.filled, budget)
        if not self._allocate(r.chunk):  # cannot happen after admission's check; keep the state sane
            r.chunk = max(0, self._free())
        r.own_kv += r.chunk
        return r

    def _admit(self, r: _Req, now: float) -> bool:
        """Admit ``r`` (matching its prefix), preempting lower priorities if needed; False to stop."""
        target = r.fill_target()
        probe = () if self._skips_cache(r) else target[: len(target) - 1]
        matched, node = self.cache.match_prefix(probe, now)
        self.cache.lock(node)
        need = len(target) - matched + self._reserve(r)
        while not self._fits(need):
            victims = [
                v for v in self._running if r.req.priority - v.req.priority > self.preemption_threshold
            ]
            if not victims:
                self.cache.unlock(node)
                return False
            self._retract(max(victims, key=lambda v: (-v.req.priority, v.seq)))
        self._waiting.remove(r)
        self._running.append(r)
        r.running, r.prefilling, r.node, r.filled = True, True, node, matched
        r.entered_forward(now)
        if r.cached is None:
            r.cached = matched
            self._counters["prompt"] += len(r.req.prompt)
            self._counters["cached"] += matched
        return True

    def _skips_cache(self, r: _Req) -> bool:
        """Whether ``r``'s first admission misses the prefix cache on purpose (:attr:`uncached_share`:
        a hot-spot of prompts the cache has never seen)."""
        return r.cached is None and self.uncached_share > 0 and self._miss_rng.random() < self.uncached_share

    def _fits(self, need: int) -> bool:
        if len(self._running) >= self.profile.max_running_requests:
            return False
        reserved = sum(self._reserve(v) for v in self._running)
        room = self.profile.kv_capacity_tokens - self.cache.locked_tokens - self._own_kv() - reserved
        return room >= need

    def _retract(self, r: _Req) -> None:
        """Send a running request back to the queue; what it computed stays in the cache, unlocked."""
        self._running.remove(r)
        self._release(r, keep=True)
        r.running, r.prefilling, r.filled, r.chunk = False, False, 0, 0
        self._waiting.append(r)
        self._counters["preempted"] += 1
        r.retracted(self._now)

    def _retract_for_kv(self, r: _Req) -> None:
        """Retract ``r`` for want of KV space during decode (SGLang's ``retract_decode``), counted apart
        from priority preemption as SGLang's ``sglang:num_retracted_*_total`` counters are."""
        counts = self._kv_retracted
        counts[0] += 1
        counts[1] += len(r.req.prompt)
        counts[2] += len(r.outputs)
        self._retract(r)

    def _release(self, r: _Req, keep: bool) -> None:
        if keep and r.filled:
            self.cache.insert(r.fill_target()[: r.filled], self._now)
        if r.node is not None:
            self.cache.unlock(r.node)
            r.node = None
        r.own_kv = 0

    def _finish_step(self, step: _Step) -> list[SimEvent]:
        events: list[SimEvent] = []
        for r in step.members:
            if r.done or not r.running:
                continue  # aborted or retracted during the step
            if r.prefilling:
                r.filled += r.chunk
                r.chunk = 0
                target = r.fill_target()
                if r.filled < len(target):
                    continue
                _, node = self.cache.insert(target, self._now)
                self.cache.lock(node)
                if r.node is not None:
                    self.cache.unlock(r.node)
                r.node, r.own_kv, r.prefilling = node, 0, False
                r.prefill_finished(self._now)
            else:
                r.filled += 1  # the step wrote the KV of the previous token
            events.append(self._emit(r))
        generated = len(events)
        self._counters["generated"] += generated
        self._recent.append((self._now, generated))
        while self._recent and self._recent[0][0] < self._now - 5.0:
            self._recent.popleft()
        return events

    def _emit(self, r: _Req) -> SimEvent:
        token = output_token_id(r.key, len(r.outputs), r.req.salt)
        r.outputs.append(token)
        n = len(r.outputs)
        reason: FinishReason | None = None
        if r.req.stop_at is not None and n >= r.req.stop_at:
            reason = "stop"
        elif n >= r.req.max_new_tokens:
            reason = "length"
        if reason is not None:
            self._finish(r)
        return SimEvent(self._now, r.req.rid, token, n, len(r.req.prompt), r.cached or 0, reason, r.times)

    def _finish(self, r: _Req) -> None:
        self._running.remove(r)
        self.cache.insert(r.fill_target()[: r.filled], self._now)
        if r.node is not None:
            self.cache.unlock(r.node)
            r.node = None
        r.own_kv, r.running, r.done = 0, False, True
        self._reqs.pop(r.req.rid, None)


def token_ids(values: Sequence[int]) -> tuple[int, ...]:
    """Tuple of token ids (for building :class:`SimRequest` from lists)."""
    return tuple(int(v) for v in values)

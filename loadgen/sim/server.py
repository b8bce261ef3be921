"""HTTP face of the simulated SGLang worker: the part of SGLang's API the gateway uses (a simulator).

Routes (SGLang's names and shapes):

- ``POST /generate`` ``{"text" | "input_ids", "sampling_params": {"max_new_tokens" (default 128),
  "temperature", "ignore_eos", "seed", ...}, "stream", "rid", "priority"}``. Non-streamed: ``{"text",
  "meta_info": {"id", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason":
  {"type": "length", "length": N} | {"type": "stop", "matched": ID} | {"type": "abort", "message"},
  "e2e_latency", ...}}``. Streamed: server-sent events ``data: {json}\\n\\n``, one per token, with the
  CUMULATIVE ``text`` and the same ``meta_info`` (``finish_reason`` null until the last), then
  ``data: [DONE]\\n\\n``. Both carry the timing fields SGLang 0.5.23 adds with ``--enable-metrics``
  (``queue_time``, ``forward_entry_time``, ``prefill_finished_time``, ``num_retractions``; the last chunk
  also ``request_received_ts``, ``api_server_dispatch_finish_ts``, ``first_token_latency``, ...), from the
  simulated schedule: :mod:`loadgen.sim.timing`. Errors: ``{"error": {"message"}}`` with 400 (bad input)
  or 500 (fault).
- ``POST /abort_request`` ``{"rid"}``; ``POST /flush_cache`` (400 while requests run);
  ``GET /health``, ``/health_generate``, ``/get_server_info``, ``/server_info``, ``/get_model_info``,
  ``/model_info``, ``/v1/models``, ``/metrics`` (see :mod:`loadgen.sim.metrics`).
- Simulator only: ``GET/POST /sim/fault`` (see :class:`FaultSpec`), ``GET/POST /sim/knobs`` (performance
  degradations, :class:`loadgen.sim.knobs.PerfKnobs`), ``GET /sim/state``. With ``dcgm`` the ``/metrics``
  also carry the DCGM-style GPU gauges the step model implies (:mod:`loadgen.sim.dcgm`, a simulation).

Tokens and text come from :mod:`loadgen.sim.tokens`. Greedy (``temperature`` 0) output depends on the
prompt only; sampled output also on ``seed`` (or the server's seeded counter). The engine runs in
simulated seconds; ``speed`` > 1 runs the simulated clock faster than the wall clock. ``e2e_latency`` and
the latency histograms are simulated seconds. A request whose client disconnects is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from loadgen.sim.dcgm import GPU_FACTS, DcgmGauges
from loadgen.sim.engine import RequestTimes, SimEngine, SimEvent, SimRequest
from loadgen.sim.knobs import DelayLine, PerfKnobs, answer_delay, apply_to_engine
from loadgen.sim.metrics import SimMetrics
from loadgen.sim.profiles import SimProfile
from loadgen.sim.timing import finished_meta, scheduler_meta, sent_meta
from loadgen.sim.tokens import VOCAB_IDS, detokenize, natural_length, prompt_key, tokenize

FaultMode = Literal["none", "crash_mid_stream", "slow", "http_500"]


class FaultSpec(BaseModel):
    """Failure injection, set with ``POST /sim/fault`` or the command line.

    Attributes:
        mode: ``none``; ``crash_mid_stream`` (after ``after_tokens`` tokens a streamed answer's connection
            is dropped without ``[DONE]``; a non-streamed one gets a bare 500; with ``exit_process`` the
            whole process exits at once, code 1); ``slow`` (every step takes ``factor`` times longer);
            ``http_500`` (``/generate`` and ``/health_generate`` answer 500, and ``/health`` too when
            ``fail_health``).
        after_tokens: tokens sent before a crash.
        exit_process: crash by exiting the process (os._exit) instead of dropping one connection.
        factor: slow-down factor of ``slow`` (≥ 1).
        fail_health: ``http_500`` also fails ``/health`` (503).
        count: how many requests the fault hits before it turns itself off; None = until changed.
    """

    mode: FaultMode = "none"
    after_tokens: int = Field(2, ge=0)
    exit_process: bool = False
    factor: float = Field(5.0, ge=1.0)
    fail_health: bool = False
    count: int | None = Field(None, ge=1)


class GenerateBody(BaseModel):
    """The fields of SGLang's ``GenerateReqInput`` the simulator reads (others are ignored)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = None
    priority: int | None = None


@dataclass
class _Live:
    """A request in flight: its event queue and timing (simulated seconds)."""

    rid: str
    prompt_tokens: int
    max_new_tokens: int
    submitted_s: float
    queue: asyncio.Queue[SimEvent | None] = field(default_factory=asyncio.Queue)
    outputs: list[int] = field(default_factory=list)
    last_s: float | None = None
    first_s: float | None = None
    times: RequestTimes | None = None
    streamed: bool = False
    sent_s: float | None = None


class SimServer:
    """One simulated worker: engine, real-time driver, fault state, metrics and the ASGI app.

    Args:
        profile: step-time profile.
        seed: seeds the engine's jitter and the salts of sampled (temperature > 0) requests.
        speed: simulated seconds per wall-clock second (2.0 = twice as fast as the modelled GPU).
        model_name: id served on ``/v1/models`` (default: the profile's model).
        eos_per_token: chance per token that the simulated model stops (finish ``stop``) unless the
            request sets ``ignore_eos``; 0 = always run to ``max_new_tokens``.
        fault: initial failure injection.
        knobs: initial performance degradations (:class:`loadgen.sim.knobs.PerfKnobs`).
        dcgm: export the DCGM-style GPU gauges (:mod:`loadgen.sim.dcgm`; GPU profiles only).
        hostname: their ``Hostname`` label.

    Raises:
        ValueError: ``speed`` <= 0, or ``dcgm`` with a profile that has no GPU facts.
    """

    def __init__(
        self,
        profile: SimProfile,
        seed: int = 0,
        speed: float = 1.0,
        model_name: str | None = None,
        eos_per_token: float = 0.0,
        fault: FaultSpec | None = None,
        knobs: PerfKnobs | None = None,
        dcgm: bool = False,
        hostname: str = "sim",
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        if dcgm and profile.name not in GPU_FACTS:
            raise ValueError(
                f"profile {profile.name} has no GPU: no DCGM gauges (GPU profiles: {sorted(GPU_FACTS)})"
            )
        self.profile = profile
        self.speed = speed
        self.model_name = model_name or profile.model
        self.eos_per_token = eos_per_token
        self.engine = SimEngine(profile, seed=seed)
        self.metrics = SimMetrics(self.model_name)
        self.fault = FaultSpec()
        self.set_fault(fault or FaultSpec())
        self.knobs = knobs or PerfKnobs()
        apply_to_engine(self.engine, profile, self.knobs)
        self.dcgm = (
            DcgmGauges(GPU_FACTS[profile.name], profile.tp, profile.kv_capacity_tokens, hostname)
            if dcgm
            else None
        )
        self._salts = random.Random(seed)
        self.generate_calls = 0  # /generate requests received, faulted ones included
        self._live: dict[str, _Live] = {}
        self._wake: asyncio.Event | None = None
        self._t0 = 0.0
        self._epoch_s = time.time()  # the Unix time of simulated second 0 (set again at startup)
        self.app = Starlette(
            routes=[
                Route("/generate", self.generate, methods=["POST"]),
                Route("/abort_request", self.abort_request, methods=["POST"]),
                Route("/flush_cache", self.flush_cache, methods=["GET", "POST"]),
                Route("/health", self.health),
                Route("/health_generate", self.health_generate),
                Route("/get_server_info", self.server_info),
                Route("/server_info", self.server_info),
                Route("/get_model_info", self.model_info),
                Route("/model_info", self.model_info),
                Route("/v1/models", self.models),
                Route("/metrics", self.metrics_route),
                Route("/sim/fault", self.fault_route, methods=["GET", "POST"]),
                Route("/sim/knobs", self.knobs_route, methods=["GET", "POST"]),
                Route("/sim/state", self.state),
            ],
            lifespan=self._lifespan,
        )

    # ----- clock and driver
    def now(self) -> float:
        """The simulated clock (s since start)."""
        return (asyncio.get_running_loop().time() - self._t0) * self.speed

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: Starlette) -> AsyncIterator[None]:
        self._t0 = asyncio.get_running_loop().time()
        self._epoch_s = time.time()
        self._wake = asyncio.Event()
        task = asyncio.create_task(self._drive())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _drive(self) -> None:
        """Advance the engine in real time and hand each token to its request's queue."""
        assert self._wake is not None
        while True:
            self._wake.clear()
            for event in self.engine.advance(self.now()):
                live = self._live.get(event.rid)
                if live is not None:
                    live.queue.put_nowait(event)
            nxt = self.engine.next_event_time()
            timeout = None if nxt is None else max(0.0, (nxt - self.now()) / self.speed)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ----- faults
    def set_fault(self, spec: FaultSpec) -> None:
        """Switch failure injection to ``spec``."""
        self.fault = spec
        self.engine.slowdown = spec.factor if spec.mode == "slow" else 1.0

    def _hit(self, mode: FaultMode) -> bool:
        """Whether the current fault is ``mode`` and applies to this request (uses up ``count``)."""
        if self.fault.mode != mode:
            return False
        if self.fault.count is not None:
            left = self.fault.count - 1
            self.set_fault(FaultSpec() if left <= 0 else self.fault.model_copy(update={"count": left}))
        return True

    # ----- /generate
    async def generate(self, request: Request) -> Response:
        """SGLang's native ``/generate`` (see the module docstring)."""
        self.generate_calls += 1
        try:
            body = GenerateBody.model_validate(await request.json())
            req = self._build(body)
        except (ValueError, ValidationError) as exc:
            return _error(400, str(exc))
        if self._hit("http_500"):
            return _error(500, "simulated fault: http_500")
        spec = self.fault  # read before _hit, which may switch the fault off
        crash_after = spec.after_tokens if self._hit("crash_mid_stream") else None
        exit_on_crash = spec.exit_process
        live = _Live(req.rid, len(req.prompt), req.max_new_tokens, self.now(), streamed=body.stream)
        self._live[req.rid] = live
        try:
            self.engine.submit(req, live.submitted_s)
        except ValueError as exc:
            del self._live[req.rid]
            return _error(400, str(exc))
        self._poke()
        if body.stream:
            return await self._stream_response(live, crash_after, exit_on_crash)
        try:
            payloads = [p async for p in self._answer(live, crash_after, exit_on_crash)]
        finally:
            self._end(live)
        await answer_delay(self.knobs)
        return JSONResponse(payloads[-1])

    def _build(self, body: GenerateBody) -> SimRequest:
        if body.text is not None and body.input_ids is None:
            ids = tokenize(body.text)
        elif body.input_ids is not None and body.text is None:
            ids = [int(i) for i in body.input_ids]
        else:
            raise ValueError("give exactly one of 'text' (a string) and 'input_ids'")
        if not ids:
            raise ValueError("the prompt has no tokens")
        params = body.sampling_params
        max_new = int(params.get("max_new_tokens", 128))
        temperature = float(params.get("temperature", 1.0))
        if max_new < 1 or temperature < 0:
            raise ValueError("max_new_tokens must be >= 1 and temperature >= 0")
        seed = params.get("seed")
        salt = 0 if temperature == 0 else int(seed) if seed is not None else self._salts.getrandbits(62) + 1
        key = prompt_key(ids)
        stop_at = None if params.get("ignore_eos") else natural_length(key, salt, self.eos_per_token, max_new)
        rid = body.rid or uuid.uuid4().hex
        if rid in self._live:
            raise ValueError(f"request id {rid!r} is already running")
        return SimRequest(rid, tuple(ids), max_new, body.priority or 0, stop_at, salt)

    async def _answer(
        self, live: _Live, crash_after: int | None, exit_on_crash: bool
    ) -> AsyncIterator[dict[str, Any]]:
        """Payloads of ``live``'s answer, one per token (cumulative text), the last one finished."""
        while True:
            event = await live.queue.get()
            if event is None:
                yield self._payload(live, {"type": "abort", "message": "Abort request"})
                return
            now = event.time_s
            live.times = event.times
            if live.last_s is None:
                live.first_s = now
                self.metrics.observe_first_token(now - live.submitted_s)
            else:
                self.metrics.observe_token_gap(now - live.last_s)
            live.last_s = now
            live.outputs.append(event.token_id)
            if crash_after is not None and len(live.outputs) > crash_after:
                if exit_on_crash:
                    os._exit(1)
                raise ConnectionAbortedError("simulated fault: crash_mid_stream")
            reason: dict[str, Any] | None = None
            if event.finish_reason == "length":
                reason = {"type": "length", "length": live.max_new_tokens}
            elif event.finish_reason == "stop":
                reason = {"type": "stop", "matched": event.token_id}
            if reason is not None:
                self.metrics.observe_finished(now - live.submitted_s)
            yield self._payload(live, reason, event.cached_tokens, now)
            if reason is not None:
                return

    def _payload(
        self, live: _Live, reason: dict[str, Any] | None, cached: int = 0, now: float | None = None
    ) -> dict[str, Any]:
        end = self.now() if now is None else now
        meta = {
            "id": live.rid,
            "prompt_tokens": live.prompt_tokens,
            "completion_tokens": len(live.outputs),
            "cached_tokens": cached,
            "finish_reason": reason,
            "e2e_latency": round(end - live.submitted_s, 6),
        }
        meta.update(self._timing_meta(live, reason is not None, end))
        return {"text": detokenize(live.outputs), "meta_info": meta}

    def _timing_meta(self, live: _Live, finished: bool, end: float) -> dict[str, Any]:
        """The ``--enable-metrics`` timing fields of ``live``'s chunk ending at ``end`` (simulated s):
        :mod:`loadgen.sim.timing`."""
        epoch = self._epoch_s
        meta = scheduler_meta(live.times, epoch)
        if finished:
            meta.update(
                finished_meta(live.times, live.submitted_s, live.first_s, end, len(live.outputs), epoch)
            )
        if live.sent_s is None and (finished or live.streamed):  # SGLang: a stream's first, else the last
            live.sent_s = self.now()
            meta.update(sent_meta(live.sent_s, epoch))
        elif finished and live.sent_s is not None:
            meta.update(sent_meta(live.sent_s, epoch))
        return meta

    async def _sse(self, live: _Live, crash_after: int | None, exit_on_crash: bool) -> AsyncIterator[bytes]:
        try:
            async for payload in self._answer(live, crash_after, exit_on_crash):
                yield f"data: {_json(payload)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            self._end(live)

    async def _stream_response(self, live: _Live, crash_after: int | None, exit_on_crash: bool) -> Response:
        """A streamed answer, through the network knobs' delay (its headers and each chunk)."""
        chunks = self._sse(live, crash_after, exit_on_crash)
        knobs = self.knobs
        if not knobs.network_delay_s and not knobs.chunk_delay_s:
            return StreamingResponse(chunks, media_type="text/event-stream")
        line = DelayLine(chunks, knobs)
        try:
            await answer_delay(knobs)
        except BaseException:
            await line.close()
            raise
        return StreamingResponse(line.__aiter__(), media_type="text/event-stream")

    def _end(self, live: _Live) -> None:
        """Forget ``live``; abort it in the engine if it has not finished (client gone, crash)."""
        if self._live.pop(live.rid, None) is not None and self.engine.abort(live.rid):
            self.metrics.observe_aborted()
            self._poke()

    # ----- other SGLang routes
    async def abort_request(self, request: Request) -> Response:
        """``/abort_request {"rid"}``: the request ends with finish_reason ``abort``. Always 200."""
        try:
            rid = str((await request.json())["rid"])
        except (ValueError, KeyError, TypeError):
            return _error(400, 'body must be {"rid": ...}')
        live = self._live.get(rid)
        if self.engine.abort(rid):
            self.metrics.observe_aborted()
            self._poke()
        if live is not None:
            live.queue.put_nowait(None)
        return Response(status_code=200)

    async def flush_cache(self, _: Request) -> Response:
        """Empty the prefix cache; 400 while requests run (as SGLang)."""
        if self.engine.flush_cache():
            return Response("Cache flushed.\n", status_code=200)
        return Response("Cache not flushed: requests are running.\n", status_code=400)

    async def health(self, _: Request) -> Response:
        """Liveness: 200, or 503 under an ``http_500`` fault with ``fail_health``."""
        failing = self.fault.mode == "http_500" and self.fault.fail_health
        return Response(status_code=503 if failing else 200)

    async def health_generate(self, _: Request) -> Response:
        """Readiness: 200, or 500 under an ``http_500`` fault."""
        return Response(status_code=500 if self.fault.mode == "http_500" else 200)

    async def server_info(self, _: Request) -> Response:
        """Server arguments in SGLang's names, plus the simulator's own (``simulator``)."""
        p, stats = self.profile, self.engine.stats()
        return JSONResponse(
            {
                "model_path": p.model,
                "served_model_name": self.model_name,
                "tp_size": p.tp,
                "max_total_num_tokens": p.kv_capacity_tokens,
                "max_running_requests": p.max_running_requests,
                "chunked_prefill_size": p.chunked_prefill_tokens,
                "context_length": p.context_length,
                "enable_mixed_chunk": p.mixed_chunk,
                "enable_priority_scheduling": True,
                "schedule_policy": "fcfs",
                "version": "simulated",
                "internal_states": [{"num_running_reqs": stats.num_running_reqs}],
                "simulator": {"profile": p.name, "hardware": p.hardware, "speed": self.speed},
            }
        )

    async def model_info(self, _: Request) -> Response:
        """``/get_model_info``."""
        return JSONResponse({"model_path": self.profile.model, "tokenizer_path": None, "is_generation": True})

    async def models(self, _: Request) -> Response:
        """OpenAI-style ``/v1/models`` listing the one served model."""
        entry = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "sglang-simulator",
            "root": self.profile.model,
            "max_model_len": self.profile.context_length,
        }
        return JSONResponse({"object": "list", "data": [entry]})

    async def metrics_route(self, _: Request) -> Response:
        """Prometheus text with SGLang's metric names (and the DCGM-style gauges with ``dcgm``)."""
        body = self.metrics.render(self.engine.stats()) + self._dcgm_exposition()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    def _dcgm_exposition(self) -> bytes:
        """The DCGM-style gauges' text now (empty without ``dcgm``)."""
        if self.dcgm is None:
            return b""
        current = self.engine.step_in_flight
        steps = [*self.engine.steps, *([current] if current is not None else [])]
        return self.dcgm.render(steps, self.now())

    def set_knobs(self, knobs: PerfKnobs) -> None:
        """Switch the performance knobs to ``knobs`` (the engine's at once; the network ones for the
        answers that start from now)."""
        self.knobs = knobs
        apply_to_engine(self.engine, self.profile, knobs)
        self._poke()

    async def knobs_route(self, request: Request) -> Response:
        """``GET``: the knobs; ``POST`` a :class:`loadgen.sim.knobs.PerfKnobs` (whole) to change them."""
        if request.method == "POST":
            try:
                self.set_knobs(PerfKnobs.model_validate(await request.json()))
            except (ValueError, ValidationError) as exc:
                return _error(400, str(exc))
        return JSONResponse(self.knobs.model_dump())

    async def fault_route(self, request: Request) -> Response:
        """``GET``: the current fault; ``POST`` a :class:`FaultSpec` to change it."""
        if request.method == "POST":
            try:
                self.set_fault(FaultSpec.model_validate(await request.json()))
            except (ValueError, ValidationError) as exc:
                return _error(400, str(exc))
        return JSONResponse(self.fault.model_dump())

    async def state(self, _: Request) -> Response:
        """Engine gauges, simulated clock and fault (for tests and dashboards)."""
        stats = self.engine.stats()
        return JSONResponse(
            {
                "now_s": self.now(),
                "profile": self.profile.name,
                "fault": self.fault.model_dump(),
                "knobs": self.knobs.model_dump(),
                "live_requests": len(self._live),
                "generate_calls": self.generate_calls,
                "stats": dataclasses.asdict(stats),
                "vocabulary_size": len(VOCAB_IDS),
            }
        )


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _json(payload: dict[str, Any]) -> str:
    return json.dumps(payload, separators=(",", ":"))

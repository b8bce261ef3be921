"""Open-loop HTTP runner: sends a planned scenario to any OpenAI-compatible endpoint and records each request.

Open loop: one dispatcher sleeps until each planned arrival (``time.perf_counter``) and starts the request as
its own task, never waiting for earlier responses. Requests go round-robin over :data:`POOL_SHARDS`
``httpx.AsyncClient`` instances (together ``target.max_connections`` connections): httpcore scans its whole
pool on every request, so one pool of thousands of connections would make the generator CPU-bound. A
streamed body is read to its end so its connection returns to the pool. The dispatcher's lateness (send lag:
actual send minus planned arrival) and the process's CPU time are recorded, so the report shows whether the
load generator kept up (see :class:`RunResult`).

Per request (:class:`RequestRecord`): tenant, class, HTTP status, TTFT (first non-empty content chunk),
inter-token latencies (gaps between content chunks), end-to-end latency, prompt/completion/cached tokens from
``usage`` (``stream_options.include_usage`` for streams; ``usage.prompt_tokens_details.cached_tokens``), and
``Retry-After`` of a 429/503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx

from loadgen.scenario import PlannedRequest, Scenario

POOL_SHARDS = 16
"""HTTP clients the runner spreads requests over (see the module docstring)."""


class MissingKeyError(LookupError):
    """A tenant has no API key (scenario ``api_key``/``api_key_env``, keys file, or ``--api-key``)."""


class ResultsError(ValueError):
    """A results file that cannot be read, or that ``loadgen run`` did not write."""


@dataclass(slots=True)
class RequestRecord:
    """The outcome of one planned request. Times: ``*_s`` seconds from the run's start, ``*_ms`` milliseconds.

    ``status``: HTTP status, 0 for a transport error or timeout (``error`` says which). ``ttft_ms`` is
    ``None`` for non-streamed or failed requests; ``itl_ms`` holds the gaps between content chunks.
    Token counts are the server's ``usage`` (``None`` when it sent none).
    """

    index: int
    tenant: str
    priority_class: str
    session_id: str
    turn: int
    stream: bool
    warmup: bool
    max_tokens: int
    scheduled_s: float
    sent_s: float = 0.0
    status: int = 0
    error: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    retry_after_s: float | None = None

    @property
    def ok(self) -> bool:
        """Served completely (HTTP 200, no error mid-stream)."""
        return self.status == 200 and self.error is None

    @property
    def done_s(self) -> float:
        """When it finished, s from the start (send time for requests without an end)."""
        return self.sent_s + (self.e2e_ms or 0.0) / 1000

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first, ms (streamed, ≥ 2 tokens)."""
        n = self.completion_tokens or (len(self.itl_ms) + 1 if self.ttft_ms is not None else 0)
        if self.ttft_ms is None or self.e2e_ms is None or n < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (n - 1)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RequestRecord:
        """Inverse of :meth:`to_json`."""
        return cls(**d)


@dataclass(slots=True)
class RunResult:
    """A finished run: its records and the load generator's own figures.

    ``wall_s``: from the first planned arrival to the last response. ``cpu_s``: this process's user+system
    CPU time during the run (``resource.getrusage``); ``cpu_s / wall_s`` is the cores it used.
    ``send_lag_ms``: per request, actual send minus planned arrival (ms): large values mean the generator
    fell behind.
    """

    base_url: str
    started_unix: float
    wall_s: float
    cpu_s: float
    records: list[RequestRecord]
    send_lag_ms: list[float]

    def to_json(self, scenario: Scenario) -> dict[str, Any]:
        """The results file's content (scenario, run figures, records)."""
        return {
            "scenario": scenario.model_dump(mode="json"),
            "run": {
                "base_url": self.base_url,
                "started_unix": self.started_unix,
                "wall_s": self.wall_s,
                "cpu_s": self.cpu_s,
                "send_lag_ms": [round(x, 3) for x in self.send_lag_ms],
            },
            "records": [r.to_json() for r in self.records],
        }


def resolve_keys(
    scenario: Scenario, keys_file: Mapping[str, str] | None = None, default_key: str | None = None
) -> dict[str, str]:
    """API key per tenant: ``api_key``, else the keys file, else ``api_key_env``'s variable, else the default.

    Raises:
        MissingKeyError: tenants left without a key (all named).
    """
    keys: dict[str, str] = {}
    missing = []
    for t in scenario.tenants:
        key = t.api_key or (keys_file or {}).get(t.id)
        if key is None and t.api_key_env:
            key = os.environ.get(t.api_key_env)
        key = key or default_key
        if key is None:
            missing.append(t.id)
        else:
            keys[t.id] = key
    if missing:
        raise MissingKeyError(
            f"no API key for tenant(s) {', '.join(missing)}: set api_key or api_key_env in the scenario, "
            "pass --keys FILE (from `loadgen tenants`), or --api-key for all"
        )
    return keys


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _usage(rec: RequestRecord, usage: Mapping[str, Any] | None) -> None:
    if not usage:
        return
    rec.prompt_tokens = usage.get("prompt_tokens")
    rec.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    rec.cached_tokens = details.get("cached_tokens")


async def send_one(
    http: httpx.AsyncClient, scenario: Scenario, req: PlannedRequest, key: str, start: float
) -> RequestRecord:
    """Send one planned request and measure it (``start``: the run's ``perf_counter`` origin)."""
    target = scenario.target
    rec = RequestRecord(
        index=req.index,
        tenant=req.tenant,
        priority_class=req.priority_class,
        session_id=req.session_id,
        turn=req.turn,
        stream=req.stream,
        warmup=req.warmup,
        max_tokens=req.max_tokens,
        scheduled_s=req.arrival_s,
    )
    body = req.body(target.model, scenario.prompts.ignore_eos, target.send_priority)
    headers = {"Authorization": f"Bearer {key}"}
    t0 = time.perf_counter()
    rec.sent_s = t0 - start
    try:
        async with http.stream("POST", target.path, json=body, headers=headers) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                await resp.aread()
                rec.retry_after_s = _retry_after(resp)
                rec.error = resp.text[:200]
            elif req.stream:
                await _read_stream(resp, rec, t0)
            else:
                data = json.loads(await resp.aread())
                _usage(rec, data.get("usage"))
                choices = data.get("choices") or [{}]
                rec.finish_reason = choices[0].get("finish_reason")
    except Exception as err:  # transport, timeout, or a malformed response: recorded, never raised
        rec.error = f"{type(err).__name__}: {err}"[:200]
    rec.e2e_ms = (time.perf_counter() - t0) * 1000
    return rec


async def _read_stream(resp: httpx.Response, rec: RequestRecord, t0: float) -> None:
    last: float | None = None
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True  # read on to the end of the body, so the connection goes back to the pool
            continue
        now = time.perf_counter()
        chunk = json.loads(payload)
        if "error" in chunk and not chunk.get("choices"):
            rec.error = str(chunk["error"])[:200]
            continue
        _usage(rec, chunk.get("usage"))
        for choice in chunk.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                if last is None:
                    rec.ttft_ms = (now - t0) * 1000
                else:
                    rec.itl_ms.append(round((now - last) * 1000, 3))  # µs resolution
                last = now
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]
    if not done and rec.error is None:
        rec.error = "stream ended without [DONE]"


async def run_plan(
    scenario: Scenario,
    plan: list[PlannedRequest],
    keys: Mapping[str, str],
    base_url: str | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    drain_timeout_s: float | None = None,
) -> RunResult:
    """Send ``plan`` open-loop to ``base_url`` (default: the scenario's target) and wait for the responses.

    After the last arrival, requests still running after ``drain_timeout_s`` (default: the target's
    ``timeout_s``) are cancelled and recorded with ``error = "cancelled at drain"``.
    """
    target = scenario.target
    url = (base_url or target.base_url).rstrip("/")
    per_shard = max(1, target.max_connections // POOL_SHARDS)
    limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=min(per_shard, 128))
    timeout = httpx.Timeout(target.timeout_s, connect=min(10.0, target.timeout_s))
    tls = httpx.create_ssl_context()  # one context for all shards (loading CA certificates takes ~20 ms)
    tasks: list[asyncio.Task[RequestRecord]] = []
    lags: list[float] = []
    records: dict[int, RequestRecord] = {}

    def finished(task: asyncio.Task[RequestRecord]) -> None:
        if not task.cancelled() and task.exception() is None:
            rec = task.result()
            records[rec.index] = rec
            if on_done is not None:
                on_done(rec)

    cpu0 = _cpu_s()
    started_unix = time.time()
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, verify=tls)
            )
            for _ in range(POOL_SHARDS)
        ]
        start = time.perf_counter() + 0.05
        for req in plan:
            delay = start + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            lags.append((time.perf_counter() - start - req.arrival_s) * 1000)
            http = clients[req.index % POOL_SHARDS]
            task = asyncio.create_task(send_one(http, scenario, req, keys[req.tenant], start))
            task.add_done_callback(finished)
            tasks.append(task)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s or target.timeout_s)
            for task in pending:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*pending, return_exceptions=True)
        wall = time.perf_counter() - start
    cpu = _cpu_s() - cpu0
    out = []
    for req in plan:
        rec = records.get(req.index)
        if rec is None:
            rec = RequestRecord(
                index=req.index,
                tenant=req.tenant,
                priority_class=req.priority_class,
                session_id=req.session_id,
                turn=req.turn,
                stream=req.stream,
                warmup=req.warmup,
                max_tokens=req.max_tokens,
                scheduled_s=req.arrival_s,
                sent_s=req.arrival_s,
                error="cancelled at drain",
            )
        out.append(rec)
    return RunResult(url, started_unix, wall, cpu, out, lags)


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def save_results(path: Path, scenario: Scenario, result: RunResult) -> None:
    """Write the results JSON (scenario, run figures, records)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(scenario)))


def load_results(path: Path) -> tuple[dict[str, Any], dict[str, Any], list[RequestRecord]]:
    """Read a results JSON: (scenario dict, run dict, records).

    Raises:
        ResultsError: the file is missing, not JSON, or not in the shape :func:`save_results` writes.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ResultsError(f"{path}: cannot read: {exc}") from exc
    try:
        return data["scenario"], data["run"], [RequestRecord.from_json(r) for r in data["records"]]
    except (KeyError, TypeError) as exc:
        raise ResultsError(f"{path}: not a results file written by `loadgen run` ({exc!r})") from exc

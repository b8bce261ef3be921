"""Performance knobs of the simulated worker: degradations to inject, one cause of a tail-latency spike
each, so that ``python -m service diagnose`` can be shown to tell them apart (a simulation).

Set with ``POST /sim/knobs`` (a :class:`PerfKnobs`, whole: fields left out go back to their defaults) or
the command line (``--network-delay-s`` ...); ``GET /sim/knobs`` reads them. Each knob is a cause:

- ``network_delay_s``: every answer's bytes arrive this much later (headers, each chunk, a whole answer):
  the network between gateway and worker.
- ``chunk_delay_s``: a slow link that carries one chunk at a time, this long each: network bandwidth.
- ``prefill_factor``: prefill work takes this many times longer: prefill compute.
- ``decode_factor``: decode work takes this many times longer: decode memory bandwidth.
- ``extra_batch`` and ``extra_context_tokens``: phantom sequences of that context ride in every decode step
  (and hold KV) while real requests run, and count as running: a larger batch, decode memory bandwidth.
- ``uncached_share``: that share of requests miss the prefix cache (a hot-spot of prompts it has never
  seen): prefill compute, the cache hit rate's collapse.
- ``kv_capacity_tokens``: the KV pool shrinks to this many tokens, and ``new_token_ratio`` sets the share
  of each request's ``max_new_tokens`` the scheduler reserves at admission (SGLang's own ratio decays to
  0.1 while nothing is retracted): a small pool and a low ratio admit requests whose outputs later outgrow
  it, and the engine retracts them: preemption (retraction).

The engine-side knobs set :class:`loadgen.sim.engine.SimEngine`'s attributes; the network ones are applied
by the server around each answer (:class:`DelayLine`, :func:`answer_delay`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loadgen.sim.engine import SimEngine
from loadgen.sim.profiles import SimProfile


class PerfKnobs(BaseModel):
    """The knobs (module docstring); the defaults change nothing."""

    model_config = ConfigDict(extra="forbid")

    network_delay_s: float = Field(0.0, ge=0, le=60, description="added one-way delay of every answer, s")
    chunk_delay_s: float = Field(0.0, ge=0, le=10, description="time the link takes per chunk, s")
    prefill_factor: float = Field(1.0, ge=1, le=1000, description="prefill work slowed by this factor")
    decode_factor: float = Field(1.0, ge=1, le=1000, description="decode work slowed by this factor")
    extra_batch: int = Field(0, ge=0, le=100_000, description="phantom sequences in every decode step")
    extra_context_tokens: int = Field(0, ge=0, le=1_000_000, description="context of each phantom, tokens")
    uncached_share: float = Field(0.0, ge=0, le=1, description="share of requests that miss the cache")
    kv_capacity_tokens: int | None = Field(None, ge=1, description="KV pool size, tokens (None: profile's)")
    new_token_ratio: float | None = Field(
        None, ge=0, le=1, description="share of max_new_tokens reserved at admission (None: profile's)"
    )


def apply_to_engine(engine: SimEngine, profile: SimProfile, knobs: PerfKnobs) -> None:
    """Set ``engine``'s knobs from ``knobs`` (``profile``: the worker's own, whose KV pool a
    ``kv_capacity_tokens`` or ``new_token_ratio`` of None restores)."""
    engine.prefill_slowdown = knobs.prefill_factor
    engine.decode_slowdown = knobs.decode_factor
    engine.extra_batch = knobs.extra_batch
    engine.extra_context_tokens = knobs.extra_context_tokens
    engine.uncached_share = knobs.uncached_share
    capacity = knobs.kv_capacity_tokens or profile.kv_capacity_tokens
    ratio = profile.new_token_ratio if knobs.new_token_ratio is None else knobs.new_token_ratio
    if (capacity, ratio) != (engine.profile.kv_capacity_tokens, engine.profile.new_token_ratio):
        engine.profile = dataclasses.replace(
            engine.profile, kv_capacity_tokens=capacity, new_token_ratio=ratio
        )


class DelayLine:
    """``chunks`` as a slow network delivers them: each one ``network_delay_s`` after the worker wrote it,
    and the link carrying one chunk at a time for ``chunk_delay_s`` each (a chunk waits for the one before
    it). A task reads ``chunks`` from construction on, as fast as they come, so the delay does not slow the
    engine and a chunk written while the headers are still on their way keeps its time; an error ``chunks``
    raises is raised in its turn; closing the line closes ``chunks``. Build it inside a running loop."""

    def __init__(self, chunks: AsyncIterator[bytes], knobs: PerfKnobs) -> None:
        self._chunks = chunks
        self._delay, self._per_chunk = knobs.network_delay_s, knobs.chunk_delay_s
        self._loop = asyncio.get_running_loop()
        self._line: asyncio.Queue[tuple[float, bytes | Exception | None]] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        try:
            async for chunk in self._chunks:
                self._line.put_nowait((self._loop.time(), chunk))
        except Exception as exc:  # handed to the reader, which raises it
            self._line.put_nowait((self._loop.time(), exc))
        else:
            self._line.put_nowait((self._loop.time(), None))

    async def __aiter__(self) -> AsyncIterator[bytes]:
        sent_at = 0.0
        try:
            while True:
                wrote_at, item = await self._line.get()
                if item is None:
                    return
                sent_at = max(wrote_at + self._delay, sent_at) + self._per_chunk
                await asyncio.sleep(max(0.0, sent_at - self._loop.time()))
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop reading ``chunks`` and close them (idempotent)."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        aclose = getattr(self._chunks, "aclose", None)
        if aclose is not None:
            await aclose()


async def answer_delay(knobs: PerfKnobs) -> None:
    """Wait as a whole non-streamed answer (one chunk) or a stream's headers would on the slow network."""
    if knobs.network_delay_s or knobs.chunk_delay_s:
        await asyncio.sleep(knobs.network_delay_s + knobs.chunk_delay_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The knobs as command-line options (``--network-delay-s`` ... ``--kv-capacity-tokens``)."""
    group = parser.add_argument_group("performance knobs (loadgen.sim.knobs; also POST /sim/knobs)")
    for name, field in PerfKnobs.model_fields.items():
        kind = int if field.annotation in (int, int | None) else float
        flag = "--" + name.replace("_", "-")
        group.add_argument(flag, type=kind, default=field.default, help=field.description)


def from_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> PerfKnobs:
    """The knobs the parsed ``args`` set; a value out of bounds exits 2 with the bound (argparse's way)."""
    try:
        return PerfKnobs.model_validate({name: getattr(args, name) for name in PerfKnobs.model_fields})
    except ValidationError as exc:
        err = exc.errors()[0]
        parser.error(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}")

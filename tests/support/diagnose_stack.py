"""A gateway in front of three simulated workers whose faults a test injects one at a time, and a load to
read a window of metrics under (``python -m service diagnose``'s tests, issue 28).

The workers run the ``llama-3.1-70b-h100-tp8`` profile at speed 1 (a streamed 16-token answer takes about
0.2 s: the engine's times dwarf the gateway's own in a test process) with the simulated DCGM gauges; the
gateway reaches Redis through a :class:`tests.support.fault_proxy.FaultProxy` (the quota store's latency
is a knob too), takes one quota call per request (no leases), and keeps fixed windows of
:data:`WINDOW` requests per worker, so that a load of more clients than the windows hold queues in the
gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from loadgen.sim.knobs import PerfKnobs
from loadgen.sim.profiles import get_profile
from service.diagnose.sources import ScrapedWindow, scrape_window
from tests.conftest import ADMIN_TOKEN
from tests.support.fault_proxy import FaultProxy
from tests.support.prometheus import SimStack
from tests.support.prometheus_live import Load, running

T = TypeVar("T")

PROFILE = dataclasses.replace(get_profile("llama-3.1-70b-h100-tp8"), mixed_chunk=False)
"""Llama-3.1-70B on 8 H100s with SGLang's default scheduler (prefill and decode in separate steps)."""
WINDOW = 3
"""Fixed concurrency window per worker, requests: :data:`CLIENTS` fill two thirds of the windows."""

CLIENTS = 6
"""Clients of the normal load (closed loop)."""

SYSTEM = "You are a terse assistant of the radixgate test suite. " * 160
"""A shared system prompt (about 1,600 tokens): the prefix cache serves it after a worker's first request."""


def body(i: int, max_tokens: int = 16, question_tokens: int = 200, system: bool = True) -> dict[str, Any]:
    """The ``i``-th request of the load: the shared system prompt (unless not ``system``) and a question of
    its own (about ``question_tokens`` tokens the cache has not seen), streamed."""
    question = " ".join(f"w{i}x{j}" for j in range(question_tokens))
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    messages.append({"role": "user", "content": f"{question}?"})
    return {
        "model": SimStack.MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


class DiagnoseStack:
    """The stack (module docstring); a context manager.

    Attributes:
        stack: the gateway and its simulated workers. redis: the proxy in front of Redis. key: an API key
        of a tenant with quotas (every request calls Redis).
    """

    def __init__(self, redis_url: str, model_dir: Path, workers: int = 3) -> None:
        self.redis = FaultProxy(redis_url)
        self._workers = workers
        self._model_dir = model_dir
        self._stack = contextlib.ExitStack()
        self.key = ""

    def __enter__(self) -> DiagnoseStack:
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.redis)
            self.stack = stack.enter_context(
                SimStack(
                    self.redis.url,
                    self._model_dir,
                    workers=self._workers,
                    profile=PROFILE,
                    sim={"dcgm": True},
                    redis={"url": self.redis.url, "key_prefix": "diagnose:", "quota_lease_s": 0},
                    observability={
                        "engine_scrape_s": 0.25,
                        "loop_lag_interval_s": 0.05,
                        "log_level": "WARNING",
                    },
                    scheduler={"window_mode": "fixed", "window_initial": WINDOW},
                    routing={"policy": "least_load"},
                    upstream={"breaker_cooldown_s": 0.5},
                )
            )
            with httpx.Client(base_url=self.stack.url, timeout=30) as http:
                limits = {"requests_per_min": 1_000_000, "tokens_per_min": 100_000_000}
                self.key = self.stack.new_key(http, "standard", limits)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def worker_urls(self) -> list[str]:
        """The simulated workers' base URLs."""
        return [s.url for s in self.stack.worker_servers]

    def knobs(self, index: int | None = None, **values: Any) -> None:
        """Set the performance knobs of worker ``index`` (None: every worker) to ``values`` (the rest to
        their defaults)."""
        sims = self.stack.sims if index is None else [self.stack.sims[index]]
        for sim in sims:
            sim.set_knobs(PerfKnobs(**values))

    def wait_healthy(self, timeout_s: float = 15.0) -> None:
        """Wait until every worker is back in rotation with a closed breaker (after a fault)."""
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        deadline = time.monotonic() + timeout_s
        while True:
            workers = httpx.get(f"{self.stack.url}/admin/workers", headers=admin, timeout=10).json()["data"]
            if all(w["healthy"] and w["breaker"] == "closed" for w in workers):
                return
            assert time.monotonic() < deadline, f"workers still out of rotation: {workers}"
            time.sleep(0.1)

    def load(
        self,
        concurrency: int = CLIENTS,
        max_tokens: int = 16,
        question_tokens: int = 200,
        system: bool = True,
    ) -> Load:
        """A closed-loop streamed load of ``concurrency`` clients (not started; requests: :func:`body`)."""
        return Load(
            self.stack.url, self.key, lambda i: body(i, max_tokens, question_tokens, system), concurrency
        )

    def run(
        self,
        job: Callable[[], Awaitable[T]],
        concurrency: int = CLIENTS,
        max_tokens: int = 16,
        question_tokens: int = 200,
        warm_s: float = 0.3,
        system: bool = True,
    ) -> T:
        """Run a load of ``concurrency`` clients (``max_tokens``, ``question_tokens`` and ``system`` each,
        see :func:`body`) and, after ``warm_s``, await ``job`` under it; its result."""

        async def later() -> T:
            await asyncio.sleep(warm_s)
            return await job()

        with running(self.load(concurrency, max_tokens, question_tokens, system)):
            return asyncio.run(later())

    def window(self, seconds: float, concurrency: int = CLIENTS, interval_s: float = 0.25) -> ScrapedWindow:
        """A window of ``seconds`` under the normal load, scraped every ``interval_s``."""

        async def scrape() -> ScrapedWindow:
            async with httpx.AsyncClient(timeout=10) as http:
                return await scrape_window(self.stack.url, self.worker_urls, seconds, interval_s, http)

        return self.run(scrape, concurrency)


@contextlib.contextmanager
def diagnose_stack(redis_url: str, model_dir: Path) -> Iterator[DiagnoseStack]:
    """A :class:`DiagnoseStack`, entered."""
    with DiagnoseStack(redis_url, model_dir) as stack:
        yield stack

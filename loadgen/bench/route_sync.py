"""``python -m loadgen bench-route-sync``: what the router replica sync costs a gateway replica's CPU.

Every replica inserts every other replica's dispatches into its prefix tree
(:meth:`policies.cache_aware.CacheAwarePolicy.observe_peer_route`, fed by
:mod:`service.workers.route_sync`), so with N replicas a replica's tree work grows from its own rate to the
fleet's. Measured here, in process CPU time, on chat prompts of about 1,400 characters behind one of 20
system prompts spread over 20 workers:

- the baseline, in the same run: the insert a replica already does for its own dispatch
  (:meth:`~policies.cache_aware.CacheAwarePolicy.commit`);
- a peer route's insert;
- the wire format's encode and decode per route (orjson, batches of 50 as one event-loop turn gives).

The delay from one replica's publish to the other's router on a real Redis is printed by
``tests/service/workers/test_route_sync.py`` (it needs a redis-server).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Annotated

import orjson
import typer
from rich.console import Console

from policies.cache_aware import CacheAwarePolicy

_WORDS = ("alpha", "beta", "gamma", "delta", "billing", "question", "answer", "tenant", "worker", "cache")


def _prompts(n: int, seed: int = 1) -> list[str]:
    """``n`` chat prompts: one of 20 system prompts, then 200 random words (about 1,400 characters)."""
    rng = random.Random(seed)
    return [
        f"<|im_start|>system\nYou are assistant number {i % 20}.<|im_end|>\n<|im_start|>user\n"
        + " ".join(rng.choice(_WORDS) for _ in range(200))
        for i in range(n)
    ]


def _cpu_us_per(n: int, work: list[str], step: Callable[[int, str], None]) -> float:
    start = time.process_time()
    for i, prompt in enumerate(work):
        step(i, prompt)
    return (time.process_time() - start) / n * 1e6


def measure(routes: int = 20_000) -> dict[str, float]:
    """CPU microseconds per route: ``own_commit_us`` (baseline), ``peer_insert_us``, ``wire_us``; and
    ``peer_over_own`` (their ratio)."""
    prompts = _prompts(routes)
    urls = [f"http://w{i}" for i in range(20)]
    own, peer = CacheAwarePolicy(), CacheAwarePolicy()
    own_us = _cpu_us_per(routes, prompts, lambda i, p: own.commit(urls[i % 20], p, i * 1e-3))
    peer_us = _cpu_us_per(routes, prompts, lambda i, p: peer.observe_peer_route(urls[i % 20], p, i * 1e-3))
    routed = [["m", urls[i % 20], p] for i, p in enumerate(prompts)]
    batches = [routed[k : k + 50] for k in range(0, routes, 50)]
    start = time.process_time()
    for batch in batches:
        orjson.loads(orjson.dumps({"r": "replica", "routes": batch}))
    wire_us = (time.process_time() - start) / routes * 1e6
    return {
        "routes": routes,
        "prompt_chars": sum(map(len, prompts)) / routes,
        "own_commit_us": own_us,
        "peer_insert_us": peer_us,
        "peer_over_own": peer_us / own_us if own_us > 0 else float("nan"),
        "wire_us": wire_us,
    }


def bench_route_sync(
    routes: Annotated[int, typer.Option(min=100, max=1_000_000, help="Routes to insert.")] = 20_000,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Measure the CPU a replica spends on other replicas' routes (the router replica sync)."""
    m = measure(routes)
    if as_json:
        print(json.dumps(m))
        return
    console = Console()
    console.print(
        f"{m['routes']:,} routes of {m['prompt_chars']:,.0f} characters, CPU per route: "
        f"own commit (baseline) {m['own_commit_us']:.1f} us, peer insert {m['peer_insert_us']:.1f} us "
        f"({m['peer_over_own']:.2f}x), wire encode+decode {m['wire_us']:.2f} us"
    )
    per_1000 = (m["peer_insert_us"] + m["wire_us"]) * 1000 / 1e6
    console.print(f"a replica learning 1,000 routes/s spends {per_1000:.1%} of a core on them")


__all__ = ["bench_route_sync", "measure"]

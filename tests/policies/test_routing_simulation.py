"""A small routing simulation: 4 shared system prompts x 200 user questions over 4 workers.

Each simulated worker has an LRU prefix cache of limited size (a single-tenant RadixTree evicted to its
capacity after every request, like SGLang's RadixAttention cache at a coarse level). The hit rate is cached
prompt characters / all prompt characters. Cache-aware routing keeps each system prompt on one worker, so
the caches hold it; round robin sends every system prompt everywhere and the small caches thrash.
Run with ``-s`` to see the table.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass

import pytest

from policies.radix_tree import RadixTree
from policies.routing import RouterName, WorkerView, make_router

WORKERS = [f"http://gpu-{i}:30000" for i in range(4)]
CACHE_CHARS = 3_000  # per worker: one system prompt (~2,000 chars) plus some questions
CONCURRENCY = 8  # a worker's load = its requests among the last 8 routed


def _words(rng: random.Random, n: int) -> str:
    vocab = ["cache", "token", "route", "worker", "prompt", "tenant", "quota", "policy", "stream", "model"]
    return " ".join(rng.choice(vocab) + str(rng.randint(0, 99)) for _ in range(n))


def workload(seed: int = 0) -> list[tuple[int, str]]:
    """800 (system prompt index, rendered prompt) pairs in random order."""
    rng = random.Random(seed)
    systems = [
        f"<|im_start|>system\nYou are assistant #{s}. {_words(rng, 250)}<|im_end|>\n" for s in range(4)
    ]
    requests = [
        (s, systems[s] + f"<|im_start|>user\n{_words(rng, 20)}?<|im_end|>\n<|im_start|>assistant\n")
        for s in range(4)
        for _ in range(200)
    ]
    rng.shuffle(requests)
    return requests


@dataclass(frozen=True)
class SimResult:
    hit_rate: float  # cached prompt chars / prompt chars
    stickiness: float  # mean over system prompts of the share of its requests on its top worker
    reasons: dict[str, int]


def simulate(name: RouterName, cache_chars: int = CACHE_CHARS, seed: int = 0) -> SimResult:
    router = make_router(name)
    engines = {url: RadixTree[str]() for url in WORKERS}
    recent: deque[str] = deque(maxlen=CONCURRENCY)
    placed: dict[int, Counter[str]] = {s: Counter() for s in range(4)}
    reasons: Counter[str] = Counter()
    cached = total = 0
    for step, (system, prompt) in enumerate(workload(seed)):
        load = Counter(recent)
        views = [WorkerView(url, True, load[url], load[url] * 600) for url in WORKERS]
        d = router.choose(views, prompt, now=step * 0.05)
        assert d is not None
        engine = engines[d.url]
        hit = engine.prefix_match_per_worker(prompt).get("engine", 0)
        engine.insert(prompt, "engine", float(step))
        engine.evict(cache_chars)
        cached += hit
        total += len(prompt)
        recent.append(d.url)
        placed[system][d.url] += 1
        reasons[d.reason] += 1
    stickiness = sum(max(c.values()) / sum(c.values()) for c in placed.values()) / len(placed)
    return SimResult(cached / total, stickiness, dict(reasons))


@pytest.fixture(scope="module")
def results() -> dict[str, SimResult]:
    out = {name: simulate(name) for name in ("round_robin", "least_load", "consistent_hash", "cache_aware")}
    print(f"\n{'policy':<16} {'hit rate':>9} {'stickiness':>11}  reasons")
    for name, r in out.items():
        print(f"{name:<16} {r.hit_rate:>9.3f} {r.stickiness:>11.3f}  {r.reasons}")
    return out


def test_cache_aware_keeps_each_system_prompt_on_one_worker(results: dict[str, SimResult]) -> None:
    ca = results["cache_aware"]
    assert ca.stickiness >= 0.95
    assert ca.hit_rate >= 0.8
    assert ca.reasons.get("cache_miss", 0) <= 8  # about one cold miss per system prompt
    assert ca.reasons.get("imbalance", 0) == 0  # loads of <= 8 never trip SGLang's abs threshold 64


def test_round_robin_spreads_them_and_thrashes(results: dict[str, SimResult]) -> None:
    rr = results["round_robin"]
    assert rr.stickiness <= 0.35  # every system prompt on all 4 workers
    assert rr.hit_rate <= 0.5
    assert results["cache_aware"].hit_rate >= rr.hit_rate + 0.3


def test_with_unbounded_caches_round_robin_only_pays_cold_misses() -> None:
    rr = simulate("round_robin", cache_chars=10**9)
    ca = simulate("cache_aware", cache_chars=10**9)
    print(f"\nunbounded caches: round_robin {rr.hit_rate:.3f}, cache_aware {ca.hit_rate:.3f}")
    assert ca.hit_rate >= rr.hit_rate

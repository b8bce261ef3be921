"""Consistent hashing: determinism, ~1/N movement on add/remove, failover, bounded loads."""

from __future__ import annotations

import random

import pytest

from policies.consistent_hash import ConsistentHash, ConsistentHashConfig, stable_hash
from policies.route_types import WorkerView

KEYS = [f"session-{i}" for i in range(5_000)]
PURE = ConsistentHashConfig(load_factor=None)


def pool(n: int, down: tuple[int, ...] = ()) -> list[WorkerView]:
    return [WorkerView(f"http://gpu-{i}:30000", i not in down) for i in range(n)]


def assign(router: ConsistentHash, workers: list[WorkerView], keys: list[str]) -> dict[str, str]:
    out = {}
    for key in keys:
        d = router.choose(workers, "", now=0.0, session_id=key)
        assert d is not None and d.reason == "hash"
        out[key] = d.url
    return out


def test_stable_hash_is_process_independent() -> None:
    # fixed value: BLAKE2b-64 of "abc", the same in every process and replica (unlike hash())
    assert stable_hash("abc") == int.from_bytes(bytes.fromhex("d8bb14d833d59559"), "big")


def test_deterministic_and_order_independent() -> None:
    a = assign(ConsistentHash(PURE), pool(4), KEYS[:500])
    b = assign(ConsistentHash(PURE), list(reversed(pool(4))), KEYS[:500])
    assert a == b


def test_spread_is_roughly_even() -> None:
    counts: dict[str, int] = {}
    for url in assign(ConsistentHash(PURE), pool(4), KEYS).values():
        counts[url] = counts.get(url, 0) + 1
    assert len(counts) == 4
    # 160 virtual nodes: each worker within +-25 % of the fair share
    assert all(0.75 * 1250 <= c <= 1.25 * 1250 for c in counts.values()), counts


@pytest.mark.parametrize("n", [4, 8])
def test_adding_a_worker_moves_about_one_in_n_plus_one(n: int) -> None:
    router = ConsistentHash(PURE)
    before = assign(router, pool(n), KEYS)
    after = assign(router, pool(n + 1), KEYS)
    moved = [k for k in KEYS if before[k] != after[k]]
    new_url = pool(n + 1)[-1].url
    assert all(after[k] == new_url for k in moved)  # keys only move to the new worker
    assert len(moved) / len(KEYS) == pytest.approx(1 / (n + 1), abs=0.06)


@pytest.mark.parametrize("n", [4, 8])
def test_removing_a_worker_moves_only_its_keys(n: int) -> None:
    router = ConsistentHash(PURE)
    before = assign(router, pool(n), KEYS)
    gone = pool(n)[1].url
    after = assign(router, pool(n, down=(1,)), KEYS)  # unhealthy == removed for routing
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(before[k] == gone for k in moved)
    assert {k for k in KEYS if before[k] == gone} == set(moved)
    assert len(moved) / len(KEYS) == pytest.approx(1 / n, abs=0.06)
    # it comes back: the same keys return
    assert assign(router, pool(n), KEYS) == before


def test_exclude_fails_over_and_none_when_empty() -> None:
    router = ConsistentHash(PURE)
    first = router.choose(pool(3), "", 0.0, session_id="s")
    assert first is not None
    second = router.choose(pool(3), "", 0.0, exclude=(first.url,), session_id="s")
    assert second is not None and second.url != first.url
    assert router.choose(pool(2, down=(0, 1)), "", 0.0, session_id="s") is None


def test_prompt_prefix_is_the_key_without_session() -> None:
    router = ConsistentHash(ConsistentHashConfig(prefix_chars=32, load_factor=None))
    rng = random.Random(1)
    system = "You are a helpful assistant.".ljust(32, ".")
    urls = {
        router.choose(pool(8), system + "".join(rng.choices("xyz", k=20)), 0.0).url  # type: ignore[union-attr]
        for _ in range(50)
    }
    assert len(urls) == 1  # same first 32 chars -> same worker
    assert router.key_for("abc", "sess") == "sess"


def test_bounded_loads_skip_a_full_worker() -> None:
    router = ConsistentHash()  # load_factor 1.25
    idle = pool(4)
    home = router.choose(idle, "", 0.0, session_id="s")
    assert home is not None
    busy = [WorkerView(w.url, True, 9 if w.url == home.url else 1) for w in idle]
    # total 12 -> capacity ceil(1.25 * 13 / 4) = 5; home has 9 -> skipped
    d = router.choose(busy, "", 0.0, session_id="s")
    assert d is not None and d.url != home.url
    # without the bound the key stays home
    pure = ConsistentHash(PURE).choose(busy, "", 0.0, session_id="s")
    assert pure is not None and pure.url == home.url


def test_ring_cache_is_bounded_and_remove_worker_drops_rings() -> None:
    router = ConsistentHash(PURE)
    for n in range(1, 20):
        router.choose(pool(n), "", 0.0, session_id="s")
    assert len(router._rings) <= 8
    router.remove_worker(pool(19)[0].url)
    assert not router._rings


@pytest.mark.parametrize("kwargs", [{"virtual_nodes": 0}, {"prefix_chars": 0}, {"load_factor": 1.0}])
def test_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ConsistentHashConfig(**kwargs)  # type: ignore[arg-type]

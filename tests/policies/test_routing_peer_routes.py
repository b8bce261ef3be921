"""Router replica sync in the cache-aware policy: other replicas' routes in this replica's tree.

A peer's route makes its prefix a hit here; a miss counts every replica's routes while the request would
start at once on every worker, and only this replica's own once some worker is full for it; peer routes
are not remembered for the engine's feedback; the other policies ignore them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import get_args

import pytest

from policies.admission_core import AdmissionCore
from policies.admission_types import AdmissionRequest, CoreConfig, Dispatch
from policies.routing import CacheAwareConfig, CacheAwarePolicy, RouterName, WorkerView, make_router

SYS = "<|im_start|>system\nYou are a careful assistant for ACME's billing questions.<|im_end|>\n"
Q1 = SYS + "<|im_start|>user\nWhy was I charged twice in March?<|im_end|>\n<|im_start|>assistant\n"
Q2 = SYS + "<|im_start|>user\nHow do I update my card?<|im_end|>\n<|im_start|>assistant\n"


def views(*full: bool) -> list[WorkerView]:
    """Idle workers w0..wn; ``full[i]``: the request would wait for a slot on wi."""
    return [WorkerView(f"w{i}", True, 0, 0, f) for i, f in enumerate(full)]


def test_a_prefix_another_replica_placed_is_a_hit_here() -> None:
    policy = CacheAwarePolicy()
    before = policy.choose(views(False, False, False), Q2, now=0.0, commit=False)
    assert before is not None and before.reason == "cache_miss"
    policy.observe_peer_route("w2", Q1, 1.0)  # another replica sent the billing prompt to w2
    d = policy.choose(views(False, False, False), Q2, now=2.0)
    assert d is not None and (d.url, d.reason) == ("w2", "cache_hit")
    assert d.matched_chars >= len(SYS)


@pytest.mark.parametrize(
    ("full", "expected"),
    [
        # room everywhere: every replica's routes count; w0 got the peers' work, w1 this replica's
        ((False, False, False), "w2"),
        # w2 would make this request wait: this replica's own routes decide among them; w1 holds its own
        # and w0 only the peers', so w0, the emptiest of its own, is not skipped for being busy elsewhere
        ((False, False, True), "w0"),
        ((True, False, False), "w0"),
    ],
)
def test_a_miss_counts_every_replicas_routes_only_while_nothing_is_full(
    full: tuple[bool, ...], expected: str
) -> None:
    policy = CacheAwarePolicy()
    policy.observe_peer_route("w0", "peer prompt " * 40, 0.0)  # 480 characters from another replica
    policy.observe_peer_route("w2", "x" * 10, 0.0)  # 10 from another replica
    policy.commit("w1", "own prompt " * 10, 0.0)  # 110 of this replica's own
    d = policy.choose(views(*full), "a question nobody asked before", now=1.0, commit=False)
    assert d is not None and (d.url, d.reason) == (expected, "cache_miss")


def test_one_replica_decides_the_same_whatever_is_full() -> None:
    """Without peer routes the own and the whole tree are one: the miss is the smallest tree either way."""
    for full in [(False, False, False), (True, False, False), (False, True, True)]:
        policy = CacheAwarePolicy()
        policy.commit("w0", "a" * 300, 0.0)
        policy.commit("w1", "b" * 100, 0.0)
        policy.commit("w2", "c" * 200, 0.0)
        d = policy.choose(views(*full), "zzz", now=1.0, commit=False)
        assert d is not None and d.url == "w1"


def test_peer_routes_are_not_remembered_for_feedback() -> None:
    policy = CacheAwarePolicy()
    policy.commit("w0", Q1, 0.0)
    policy.observe_peer_route("w0", Q2, 0.0)
    # a shortfall on the peer's prompt is not this replica's prediction: ignored, the tree kept
    for _ in range(5):
        assert policy.observe_cached_tokens("w0", Q2, 0, 40) is False
    assert policy.prefix_matches(Q2).get("w0", 0) > 0


def test_eviction_shrinks_the_peers_share_in_proportion() -> None:
    policy = CacheAwarePolicy(CacheAwareConfig(max_tree_chars_per_worker=100, eviction_interval_s=1.0))
    policy.maybe_evict(0.0)
    policy.observe_peer_route("w0", "p" * 150, 0.0)  # over the cap, under the slack (2x)
    policy.commit("w0", "o" * 50, 0.5)
    assert policy.tree.size_of("w0") == 200
    assert policy.maybe_evict(2.0)  # the older peer leaf goes: 50 left
    assert policy.tree.size_of("w0") == 50
    # the peers' 150 of 200 shrink to 150 x 50 / 200 = 37: w0's own is counted 13 (an estimate: the tree
    # does not know whose leaf went), never below 0
    d = policy.choose(views(True, True), "q", now=3.0, commit=False)  # own sizes: w0 13, w1 0
    assert d is not None and d.url == "w1"
    policy.remove_worker("w0")
    assert policy.tree.size_of("w0") == 0


def test_an_empty_peer_prompt_is_ignored() -> None:
    policy = CacheAwarePolicy()
    policy.observe_peer_route("w0", "", 0.0)
    assert policy.tree.sizes() == {}


@pytest.mark.parametrize("name", [n for n in get_args(RouterName) if n != "cache_aware"])
def test_the_other_policies_ignore_peer_routes(name: RouterName) -> None:
    router = make_router(name)
    ws = views(False, False)
    first = router.choose(ws, Q1, now=0.0, session_id="s", commit=False)
    router.observe_peer_route("w1", Q1, 0.0)
    again = router.choose(ws, Q1, now=0.0, session_id="s", commit=False)
    assert first is not None and again is not None
    assert router.prefix_matches(Q1) == {}


def _request(rid: str, prompt: str) -> AdmissionRequest:
    return AdmissionRequest(rid, "t", "standard", prompt, 50, 20, 0.0)


def test_the_core_learns_peer_routes_for_workers_it_knows_only() -> None:
    core = AdmissionCore(replace(CoreConfig(), slo_admission=False))
    for url in ("w0", "w1", "w2"):
        core.add_worker(url)
    core.observe_peer_route("w-gone", Q1, 0.0)  # a worker this replica does not know: not in its tree
    core.observe_peer_route("w2", Q1, 0.0)
    (d,) = core.arrive(_request("r1", Q2), 1.0)
    assert isinstance(d, Dispatch) and (d.worker, d.route.reason) == ("w2", "cache_hit")
    assert core.router.prefix_matches(Q1).keys() == {"w2"}

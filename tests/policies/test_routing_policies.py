"""Routing policies behind the common interface: decision table, multi-turn, feedback, factory."""

from __future__ import annotations

from typing import get_args

import pytest

from policies.routing import (
    ROUTE_REASONS,
    CacheAwareConfig,
    CacheAwarePolicy,
    ConsistentHash,
    LeastLoadRouter,
    RoundRobinRouter,
    RouteDecision,
    RouterName,
    WorkerView,
    is_imbalanced,
    make_router,
)

SYS = "<|im_start|>system\nYou are a careful assistant for ACME's billing questions.<|im_end|>\n"
Q1 = SYS + "<|im_start|>user\nWhy was I charged twice in March?<|im_end|>\n<|im_start|>assistant\n"
Q2 = SYS + "<|im_start|>user\nHow do I update my card?<|im_end|>\n<|im_start|>assistant\n"
OTHER = "<|im_start|>system\nYou translate German to French.<|im_end|>\n<|im_start|>user\nHallo<|im_end|>\n"


def views(*loads: int, unhealthy: tuple[str, ...] = ()) -> list[WorkerView]:
    """Workers w0..wn with the given in-flight request counts."""
    return [WorkerView(f"w{i}", f"w{i}" not in unhealthy, n, n * 100) for i, n in enumerate(loads)]


# ---- legacy helpers keep working ---------------------------------------------------------------------


def test_is_imbalanced_table() -> None:
    # SGLang: max - min > abs AND max > min * rel
    assert is_imbalanced([0, 65], 64, 1.5)
    assert not is_imbalanced([0, 64], 64, 1.5)  # abs not exceeded
    assert not is_imbalanced([200, 280], 64, 1.5)  # 280 <= 300: rel not exceeded
    assert is_imbalanced([100, 300], 64, 1.5)
    assert not is_imbalanced([1000], 64, 1.5)
    assert not is_imbalanced([], 64, 1.5)


# ---- cache-aware decision table ----------------------------------------------------------------------

SMALL = CacheAwareConfig(balance_abs_threshold=4, balance_rel_threshold=1.5)

# (id, history as (prompt, worker), loads, unhealthy, exclude, prompt, expected url, reason)
Row = tuple[
    str, list[tuple[str, str]], tuple[int, ...], tuple[str, ...], tuple[str, ...], str, str | None, str | None
]
CACHE_AWARE_TABLE: list[Row] = [
    ("empty tree: miss to first smallest", [], (0, 0, 0), (), (), Q1, "w0", "cache_miss"),
    ("hit on the worker holding the prefix", [(Q1, "w2")], (0, 0, 0), (), (), Q2, "w2", "cache_hit"),
    ("exact repeat is a hit", [(Q1, "w1")], (1, 1, 1), (), (), Q1, "w1", "cache_hit"),
    ("low match is a miss to smallest tree", [(Q1, "w0")], (0, 0, 0), (), (), OTHER, "w1", "cache_miss"),
    (
        "miss goes to the empty tree, busier or not",
        [(Q1, "w0"), (OTHER, "w1")],
        (0, 0, 3),
        (),
        (),
        "zzz",
        "w2",
        "cache_miss",
    ),
    ("imbalance beats the cache", [(Q1, "w0")], (10, 2, 3), (), (), Q2, "w1", "imbalance"),
    ("imbalance needs the relative test too", [(Q1, "w0")], (30, 25, 24), (), (), Q2, "w0", "cache_hit"),
    ("unhealthy holder: next best is a miss", [(Q1, "w0")], (0, 0, 0), ("w0",), (), Q2, "w1", "cache_miss"),
    (
        "excluded holder: the other holder hits",
        [(Q1, "w0"), (Q1, "w2")],
        (0, 0, 0),
        (),
        ("w0",),
        Q2,
        "w2",
        "cache_hit",
    ),
    ("tied holders: least loaded", [(Q1, "w0"), (Q1, "w1")], (2, 1, 0), (), (), Q2, "w1", "cache_hit"),
    ("unhealthy worker's load ignored", [(Q1, "w0")], (0, 0, 90), ("w2",), (), Q2, "w0", "cache_hit"),
    ("no eligible worker", [(Q1, "w0")], (0, 0), ("w0",), ("w1",), Q2, None, None),
    ("empty prompt is a miss", [(Q1, "w0")], (0, 0, 0), (), (), "", "w1", "cache_miss"),
]


@pytest.mark.parametrize(
    ("history", "loads", "unhealthy", "exclude", "prompt", "url", "reason"),
    [row[1:] for row in CACHE_AWARE_TABLE],
    ids=[row[0] for row in CACHE_AWARE_TABLE],
)
def test_cache_aware_decision_table(
    history: list[tuple[str, str]],
    loads: tuple[int, ...],
    unhealthy: tuple[str, ...],
    exclude: tuple[str, ...],
    prompt: str,
    url: str | None,
    reason: str | None,
) -> None:
    policy = CacheAwarePolicy(SMALL)
    for i, (text, worker) in enumerate(history):
        policy.tree.insert(text, worker, float(i))
    decision = policy.choose(views(*loads, unhealthy=unhealthy), prompt, now=100.0, exclude=exclude)
    if url is None:
        assert decision is None
        return
    assert decision is not None
    assert (decision.url, decision.reason) == (url, reason)
    expected = policy.tree.prefix_match_per_worker(prompt).get(url, 0) if prompt else 0
    assert decision.matched_chars <= expected  # the tree now also holds this prompt for the pick
    assert 0.0 <= decision.match_rate <= 1.0
    assert policy.tree.prefix_match_per_worker(prompt or "x").get(url, 0) == len(prompt)  # inserted


def test_cache_hit_reports_predicted_match() -> None:
    policy = CacheAwarePolicy()
    policy.choose(views(0, 0), Q1, now=0.0)
    d = policy.choose(views(0, 0), Q2, now=1.0)
    assert d is not None and d.reason == "cache_hit"
    shared = len(SYS) + len("<|im_start|>user\n")
    assert d.matched_chars == shared
    assert d.match_rate == pytest.approx(shared / len(Q2))


def test_imbalance_still_inserts_for_the_least_loaded() -> None:
    policy = CacheAwarePolicy(SMALL)
    policy.tree.insert(Q1, "w0", 0.0)
    d = policy.choose(views(20, 0), Q2, now=1.0)
    assert d == RouteDecision("w1", "imbalance", 0, 0.0)
    assert policy.tree.prefix_match_per_worker(Q2)["w1"] == len(Q2)


def test_threshold_is_strict() -> None:
    policy = CacheAwarePolicy(CacheAwareConfig(cache_threshold=0.5))
    policy.tree.insert("a" * 50 + "b" * 50, "w1", 0.0)
    d = policy.choose(views(0, 0), "a" * 50 + "c" * 50, now=1.0)  # match rate exactly 0.5
    assert d is not None and (d.url, d.reason) == ("w0", "cache_miss")


def test_miss_policy_smallest_tree_vs_least_load() -> None:
    for miss_policy, expected in [("smallest_tree", "w1"), ("least_load", "w0")]:
        policy = CacheAwarePolicy(CacheAwareConfig(miss_policy=miss_policy))  # type: ignore[arg-type]
        policy.tree.insert(OTHER, "w0", 0.0)
        d = policy.choose(views(0, 1, 2), Q1, now=1.0)  # w0: idle, big tree; w1, w2: empty trees
        assert d is not None and (d.url, d.reason) == (expected, "cache_miss")


def test_multi_turn_conversation_sticks_while_load_allows() -> None:
    policy = CacheAwarePolicy(SMALL)
    ws = views(0, 0, 0, 0)
    prompt = SYS
    chosen = []
    for turn in range(8):
        prompt += f"<|im_start|>user\nquestion {turn}?<|im_end|>\n<|im_start|>assistant\n"
        d = policy.choose(ws, prompt, now=float(turn))
        assert d is not None
        chosen.append(d.url)
        prompt += f"answer {turn}<|im_end|>\n"
        # other tenants' traffic lands elsewhere meanwhile
        policy.choose(ws, f"unrelated prompt number {turn} " * 5, now=float(turn) + 0.5)
    assert len(set(chosen)) == 1
    # the sticky worker gets overloaded: the next turn is rebalanced, and then the new worker sticks
    sticky = chosen[0]
    loaded = [WorkerView(w.url, True, 20 if w.url == sticky else 0) for w in ws]
    prompt += "<|im_start|>user\nand now?<|im_end|>\n<|im_start|>assistant\n"
    d = policy.choose(loaded, prompt, now=10.0)
    assert d is not None and d.reason == "imbalance" and d.url != sticky
    prompt += "ok<|im_end|>\n<|im_start|>user\nthanks<|im_end|>\n"
    d2 = policy.choose(views(0, 0, 0, 0), prompt, now=11.0)
    assert d2 is not None and d2.reason == "cache_hit" and d2.url in {sticky, d.url}


# ---- eviction and feedback ---------------------------------------------------------------------------


def test_periodic_and_slack_eviction_bound_the_tree() -> None:
    cfg = CacheAwareConfig(max_tree_chars_per_worker=1_000, eviction_interval_s=10.0)
    policy = CacheAwarePolicy(cfg)
    ws = views(0, 0)
    for i in range(2_000):
        policy.choose(ws, f"prompt {i:05d} " + "x" * 50, now=i * 0.001)  # < 10 s: only slack evictions
        assert all(policy.tree.size_of(w.url) <= 2 * 1_000 for w in ws)
    assert policy.maybe_evict(now=20.0)
    assert all(policy.tree.size_of(w.url) <= 1_000 for w in ws)
    assert not policy.maybe_evict(now=25.0)
    policy.tree.check_invariants()


def test_restarted_worker_loses_its_tree_after_repeated_shortfalls() -> None:
    policy = CacheAwarePolicy()
    ws = views(0, 0)
    first = policy.choose(ws, Q1, now=0.0)
    assert first is not None and first.url == "w0"
    # a confirmed prediction keeps everything
    d = policy.choose(ws, Q2, now=1.0)
    assert d is not None and d.reason == "cache_hit" and d.url == "w0"
    assert not policy.observe_cached_tokens("w0", Q2, engine_cached_tokens=20, prompt_tokens=30)
    # w0 restarts: three hits in a row report ~nothing cached
    dropped = []
    for i in range(3):
        prompt = Q1 + f"follow-up {i}"
        d = policy.choose(ws, prompt, now=2.0 + i)
        assert d is not None and d.url == "w0" and d.reason == "cache_hit"
        dropped.append(policy.observe_cached_tokens("w0", prompt, engine_cached_tokens=0, prompt_tokens=30))
    assert dropped == [False, False, True]
    assert policy.tree.size_of("w0") == 0
    # w0 no longer attracts the system prompt by a stale tree: a miss goes to the smallest tree (w0 again,
    # empty now) and is reported as a miss, not a hit
    d = policy.choose(ws, Q2, now=10.0)
    assert d is not None and d.reason == "cache_miss" and d.matched_chars == 0


def test_feedback_ignores_unknown_or_weak_predictions() -> None:
    policy = CacheAwarePolicy(CacheAwareConfig(stale_reports=1))
    assert not policy.observe_cached_tokens("w0", Q1, 0, 30)  # never routed: no prediction
    policy.choose(views(0), Q1, now=0.0)  # predicted 0 chars: no evidence either way
    assert not policy.observe_cached_tokens("w0", Q1, 0, 30)
    assert not policy.observe_cached_tokens("w0", Q1, 0, 0, predicted_chars=len(Q1))  # no tokens
    assert policy.observe_cached_tokens("w0", Q1, 0, 30, predicted_chars=len(Q1))  # explicit prediction
    assert policy.tree.size_of("w0") == 0


def test_shortfall_streak_resets_on_a_good_report() -> None:
    policy = CacheAwarePolicy(CacheAwareConfig(stale_reports=2))
    policy.tree.insert(Q1, "w0", 0.0)
    n = len(Q1)
    assert not policy.observe_cached_tokens("w0", Q1, 0, 30, predicted_chars=n)
    assert not policy.observe_cached_tokens("w0", Q1, 25, 30, predicted_chars=n)
    assert not policy.observe_cached_tokens("w0", Q1, 0, 30, predicted_chars=n)
    assert policy.observe_cached_tokens("w0", Q1, 0, 30, predicted_chars=n)


def test_remove_worker_forgets_it() -> None:
    policy = CacheAwarePolicy()
    policy.choose(views(0, 0), Q1, now=0.0)
    policy.remove_worker("w0")
    assert "w0" not in policy.tree.workers()
    d = policy.choose(views(0, 0), Q2, now=1.0)
    assert d is not None and d.reason == "cache_miss"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"cache_threshold": 1.5},
        {"balance_rel_threshold": 0.5},
        {"balance_abs_threshold": -1},
        {"eviction_interval_s": 0},
        {"eviction_slack": 0.5},
        {"miss_policy": "random"},
        {"stale_reports": 0},
        {"stale_min_predicted_rate": 0.0},
    ],
)
def test_cache_aware_config_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        CacheAwareConfig(**kwargs)  # type: ignore[arg-type]


# ---- the common interface ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", get_args(RouterName))
def test_factory_common_interface(name: RouterName) -> None:
    router = make_router(name)
    assert router.name == name
    ws = views(0, 3, 1, unhealthy=("w2",))
    d = router.choose(ws, Q1, now=0.0, session_id="s1")
    assert d is not None and d.url in {"w0", "w1"} and d.reason in ROUTE_REASONS
    assert router.choose(ws, Q1, now=1.0, exclude=("w0", "w1")) is None
    assert router.choose([], Q1, now=1.0) is None
    router.remove_worker("w0")
    assert router.observe_cached_tokens("w1", Q1, 0, 10) is False


def test_factory_rejects_unknown_name() -> None:
    with pytest.raises(ValueError):
        make_router("random")  # type: ignore[arg-type]


def test_simple_routers() -> None:
    rr = RoundRobinRouter()
    ws = views(5, 0, 1)
    assert [rr.choose(ws, "", 0.0).url for _ in range(4)] == ["w0", "w1", "w2", "w0"]  # type: ignore[union-attr]
    ll = LeastLoadRouter()
    assert ll.choose(ws, "", 0.0) == RouteDecision("w1", "least_load")
    assert ll.choose(ws, "", 0.0, exclude=("w1",)) == RouteDecision("w2", "least_load")
    assert isinstance(make_router("consistent_hash"), ConsistentHash)

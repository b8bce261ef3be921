"""The shared approximate radix tree: insert, match, split, evict, remove, bounded memory."""

from __future__ import annotations

import random

import pytest

from policies.radix_tree import PrefixMatch, RadixTree, common_prefix_len


@pytest.mark.parametrize(
    ("a", "start", "b", "expected"),
    [
        ("hello world", 0, "hello", 5),
        ("hello world", 6, "world!", 5),
        ("hello", 0, "help", 3),
        ("abc", 0, "xyz", 0),
        ("", 0, "abc", 0),
        ("abc", 3, "abc", 0),
        ("a" * 1000 + "b", 0, "a" * 1000 + "c", 1000),
        ((1, 2, 3, 4), 1, (2, 3, 9), 2),
    ],
)
def test_common_prefix_len(a: str, start: int, b: str, expected: int) -> None:
    assert common_prefix_len(a, start, b) == expected


def test_empty_tree_matches_nothing() -> None:
    tree: RadixTree[str] = RadixTree()
    assert tree.match("anything") == PrefixMatch(0, frozenset())
    assert tree.prefix_match_per_worker("anything") == {}
    assert tree.size_of("w1") == 0
    tree.check_invariants()


def test_insert_and_match_single_worker() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert("hello world", "w1", now=1.0)
    assert tree.size_of("w1") == 11
    assert tree.match("hello world, again") == PrefixMatch(11, frozenset({"w1"}))
    assert tree.match("help") == PrefixMatch(3, frozenset({"w1"}))  # partial edge counts
    assert tree.match("xyz") == PrefixMatch(0, frozenset())
    tree.check_invariants()


def test_insert_is_idempotent_for_sizes() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert("hello", "w1", 1.0)
    tree.insert("hello", "w1", 2.0)
    tree.insert("hell", "w1", 3.0)
    assert tree.size_of("w1") == 5
    tree.check_invariants()


# (inserts as (text, worker), query, expected per-worker match, expected sizes)
SPLIT_TABLE = [
    (
        [("apple", "w1"), ("apricot", "w2")],
        "apricots",
        {"w1": 2, "w2": 7},
        {"w1": 5, "w2": 7},
    ),
    (
        [("apple", "w1"), ("apple pie", "w2")],
        "apple pie!",
        {"w1": 5, "w2": 9},
        {"w1": 5, "w2": 9},
    ),
    (
        [("apple pie", "w1"), ("apple", "w2")],
        "apple tart",
        {"w1": 6, "w2": 5},
        {"w1": 9, "w2": 5},
    ),
    (
        [("abc", "w1"), ("abd", "w1"), ("xyz", "w2")],
        "abd",
        {"w1": 3},
        {"w1": 4, "w2": 3},
    ),
    (
        [("system: be nice. user: hi", "w1"), ("system: be nice. user: bye", "w2")],
        "system: be nice. user: hello",
        {"w1": 24, "w2": 23},
        {"w1": 25, "w2": 26},
    ),
]


@pytest.mark.parametrize(("inserts", "query", "per_worker", "sizes"), SPLIT_TABLE)
def test_split_and_per_worker_match(
    inserts: list[tuple[str, str]], query: str, per_worker: dict[str, int], sizes: dict[str, int]
) -> None:
    tree: RadixTree[str] = RadixTree()
    for i, (text, worker) in enumerate(inserts):
        tree.insert(text, worker, float(i))
    assert tree.prefix_match_per_worker(query) == per_worker
    assert tree.sizes() == sizes
    best = max(per_worker.values())
    assert tree.match(query) == PrefixMatch(best, frozenset(w for w, m in per_worker.items() if m == best))
    tree.check_invariants()


def test_token_id_keys() -> None:
    tree: RadixTree[tuple[int, ...]] = RadixTree(())
    tree.insert((1, 2, 3, 4), "w1", 0.0)
    tree.insert((1, 2, 9), "w2", 0.0)
    assert tree.prefix_match_per_worker((1, 2, 3, 7)) == {"w1": 3, "w2": 2}
    assert tree.sizes() == {"w1": 4, "w2": 3}
    tree.check_invariants()


def test_empty_insert_registers_worker() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert("", "w1", 0.0)
    assert tree.workers() == ["w1"]
    assert tree.size_of("w1") == 0
    tree.check_invariants()


def test_remove_worker_prunes_only_its_nodes() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert("shared prefix A", "w1", 0.0)
    tree.insert("shared prefix B", "w2", 0.0)
    tree.insert("only w1 here", "w1", 0.0)
    tree.remove_worker("w1")
    assert tree.workers() == ["w2"]
    assert tree.prefix_match_per_worker("shared prefix A") == {"w2": 14}
    assert tree.match("only w1 here") == PrefixMatch(0, frozenset())
    assert tree.total_chars() == len("shared prefix B")
    tree.check_invariants()
    tree.remove_worker("unknown")  # no-op
    tree.remove_worker("w2")
    assert tree.node_count == 1
    tree.check_invariants()


def test_evict_is_lru_by_leaf() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert("sys: rules. q: old question", "w1", 1.0)
    tree.insert("sys: rules. q: newer question", "w1", 2.0)
    tree.insert("sys: rules. q: newest question", "w1", 3.0)
    before = tree.size_of("w1")
    # cap forcing exactly the oldest leaf out
    old_leaf = len("old question")
    evicted = tree.evict(before - old_leaf)
    assert evicted == 1
    assert tree.size_of("w1") == before - old_leaf
    assert tree.prefix_match_per_worker("sys: rules. q: old question") == {"w1": len("sys: rules. q: ")}
    assert tree.prefix_match_per_worker("sys: rules. q: newest question") == {"w1": 30}
    tree.check_invariants()


def test_evict_walks_up_to_parents_and_keeps_other_workers() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert("abcdef", "w1", 1.0)
    tree.insert("abcxyz", "w1", 2.0)
    tree.insert("zz", "w2", 0.0)  # older than everything of w1, but w2 is under the cap
    evicted = tree.evict(2)
    assert evicted == 3  # "def", "xyz", then their parent "abc" once it became w1's leaf
    assert tree.sizes() == {"w1": 0, "w2": 2}
    assert tree.match("abcdef") == PrefixMatch(0, frozenset())
    assert tree.node_count == 2
    tree.check_invariants()


def test_evict_zero_cap_empties_every_worker() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert("abcdef", "w1", 1.0)
    tree.insert("abcdef", "w2", 5.0)
    tree.evict(0)
    assert tree.sizes() == {"w1": 0, "w2": 0}
    assert tree.node_count == 1
    tree.check_invariants()


def test_evict_only_touches_workers_over_the_cap() -> None:
    tree: RadixTree[str] = RadixTree()
    tree.insert("a" * 100, "big", 1.0)
    tree.insert("b" * 100, "big", 2.0)
    tree.insert("a" * 100, "small", 0.5)
    tree.evict(150)
    assert tree.size_of("big") == 100
    assert tree.prefix_match_per_worker("b" * 100) == {"big": 100}  # the newer one survived
    assert tree.size_of("small") == 100
    assert tree.prefix_match_per_worker("a" * 100) == {"small": 100}
    tree.check_invariants()


def test_evict_rejects_negative_cap() -> None:
    with pytest.raises(ValueError):
        RadixTree[str]().evict(-1)


def test_memory_stays_bounded_under_100k_random_inserts() -> None:
    rng = random.Random(7)
    tree: RadixTree[str] = RadixTree()
    workers = [f"w{i}" for i in range(4)]
    prefixes = ["".join(rng.choices("abcdefgh", k=40)) for _ in range(20)]
    cap = 5_000
    peak_nodes = 0
    for i in range(100_000):
        text = rng.choice(prefixes) + "".join(rng.choices("abcdefghij", k=rng.randint(1, 60)))
        worker = rng.choice(workers)
        tree.insert(text, worker, float(i))
        if tree.size_of(worker) > 2 * cap:  # what CacheAwarePolicy does between periodic evictions
            tree.evict(cap)
        peak_nodes = max(peak_nodes, tree.node_count)
    for worker in workers:
        assert tree.size_of(worker) <= 2 * cap
    # every stored character belongs to some worker, so the tree holds at most workers x 2 x cap of them
    assert tree.total_chars() <= len(workers) * 2 * cap
    assert peak_nodes <= len(workers) * 2 * cap
    tree.check_invariants()

"""The simulated radix cache's eviction heap (loadgen.sim.radix) evicts exactly what a heap rebuilt over every
leaf at each eviction evicts (SGLang's way, and this module's before the planner experiment's long runs)."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

from loadgen.sim.radix import RadixCache, RadixNode


class RebuiltHeapCache(RadixCache):
    """The reference: each eviction walks the tree and heaps every unlocked leaf (the former code)."""

    def __init__(self) -> None:
        super().__init__()
        self._tie = itertools.count()

    def _leaves(self) -> list[RadixNode]:
        leaves: list[RadixNode] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                leaves.append(node)
        return leaves

    def evict(self, num_tokens: int) -> int:
        heap = [(leaf.last_access_s, next(self._tie), leaf) for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None or leaf.lock_ref > 0:
                continue
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            self._total -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_s, next(self._tie), parent))
        return freed


def contents(cache: RadixCache) -> list[tuple[tuple[int, ...], int, float]]:
    """Every node as (its tokens from the root, lock count, last access), sorted."""
    out = []
    stack: list[tuple[RadixNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        path = prefix + node.key
        if node is not cache.root:
            out.append((path, node.lock_ref, node.last_access_s))
        stack.extend((c, path) for c in node.children.values())
    return sorted(out)


@pytest.mark.parametrize("seed", range(12))
def test_evictions_match_a_heap_rebuilt_over_every_leaf(seed: int) -> None:
    rng = random.Random(seed)
    fast, slow = RadixCache(), RebuiltHeapCache()
    held: list[tuple[RadixNode, RadixNode]] = []
    now = 0.0
    evicted = 0
    for _ in range(1500):
        if rng.random() < 0.5:
            now += rng.choice((0.0, 0.0, 0.5, 1.0))  # many operations at the same time: ties
        seq = [rng.randrange(3) for _ in range(rng.randint(1, 4))] + [rng.randrange(50) for _ in range(3)]
        op = rng.random()
        if op < 0.35:
            assert fast.insert(seq, now)[0] == slow.insert(seq, now)[0]
        elif op < 0.55:
            (m1, n1), (m2, n2) = fast.match_prefix(seq, now), slow.match_prefix(seq, now)
            assert m1 == m2
            if rng.random() < 0.6:
                fast.lock(n1)
                slow.lock(n2)
                held.append((n1, n2))
        elif op < 0.75 and held:
            n1, n2 = held.pop(rng.randrange(len(held)))
            fast.unlock(n1)
            slow.unlock(n2)
        else:
            want = rng.randint(1, 12)
            got = fast.evict(want)
            assert got == slow.evict(want)
            evicted += got
        assert contents(fast) == contents(slow)
        assert fast.total_tokens == slow.total_tokens and fast.locked_tokens == slow.locked_tokens
    assert evicted > 0


def test_the_heap_stays_bounded_when_nothing_is_evicted() -> None:
    cache = RadixCache()
    for i in range(20000):
        cache.insert([i % 7, i], float(i))
        cache.match_prefix([i % 7, i], float(i) + 0.5)
    assert len(cache._heap) < 3 * 20000 // 2  # compacted: one live entry per leaf, plus slack

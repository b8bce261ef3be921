"""Approximate radix tree of prompt prefixes, shared by all workers (pure: time is passed in).

The gateway cannot see a worker's KV cache, so it keeps its own guess of it: every prompt it sends to a
worker is inserted into one compressed trie, and each node remembers which workers it was sent to and when
(last access time, the caller's clock, seconds as a float). A later prompt's longest matched prefix per
worker estimates how much of it that worker still has cached.

Algorithm: the multi-tenant approximate tree of SGLang's router (sgl-project/sglang,
``sgl-router/src/tree.rs``, now ``sgl-model-gateway``): one tree for all workers ("tenants" there), edges
hold strings, children keyed by their first element, a per-node map ``worker -> last access time``, a
per-worker count of stored characters, and LRU eviction of a worker's *leaves* (nodes of that worker with no
child of that worker) until its count is under a cap. Invariant kept by every operation: a worker present on
a node is present on all its ancestors, so its matched length along a path is the depth of the deepest node
carrying it.

Keys are the rendered prompt text (``str``, matched per character, as SGLang does to avoid tokenising in the
router) or token ids (``tuple[int, ...]``); one tree holds one key type.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", str, tuple[int, ...])


class _Node(Generic[K]):
    """One edge of the compressed trie: ``key`` is the edge label (never empty, except at the root)."""

    __slots__ = ("access", "children", "key", "parent")

    def __init__(self, key: K, parent: _Node[K] | None) -> None:
        self.key: K = key
        self.parent: _Node[K] | None = parent
        self.children: dict[Hashable, _Node[K]] = {}
        self.access: dict[str, float] = {}


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Result of :meth:`RadixTree.match`.

    Attributes:
        matched: length (characters or tokens) of the longest prefix of the query held by any worker.
        workers: the workers holding that longest prefix (empty when ``matched`` is 0).
    """

    matched: int
    workers: frozenset[str]


def common_prefix_len(a: K, a_start: int, b: K) -> int:
    """Length of the common prefix of ``a[a_start:]`` and ``b``.

    Binary search over slice equality, so the element comparisons run in C (``O(n log n)`` copying in the
    worst case, ``O(n)`` when ``b`` matches entirely, which is the common case on a trie walk).
    """
    hi = min(len(a) - a_start, len(b))
    if a[a_start : a_start + hi] == b[:hi]:
        return hi
    lo = 0  # a[a_start:a_start+lo] == b[:lo] holds; the prefix of length hi does not match
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[a_start : a_start + mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixTree(Generic[K]):
    """Shared approximate prefix tree over all workers; see the module docstring for the algorithm.

    Args:
        empty: the empty key of the tree's key type, ``""`` (default) for text or ``()`` for token ids.

    Sizes are counted in key elements (characters or tokens): a worker's size is the total length of the
    edges it is present on, like SGLang's ``tenant_char_count``. Times are the caller's clock in seconds.
    Not thread-safe (the gateway is one asyncio loop).
    """

    def __init__(self, empty: K = "") -> None:  # type: ignore[assignment]
        self._empty: K = empty
        self._root: _Node[K] = _Node(empty, None)
        self._sizes: dict[str, int] = {}
        self._nodes = 1

    # ---- queries -------------------------------------------------------------------------------------

    def workers(self) -> list[str]:
        """Workers known to the tree (inserted and not removed), in first-seen order."""
        return list(self._sizes)

    def size_of(self, worker: str) -> int:
        """Characters (or tokens) stored for ``worker``; 0 for an unknown worker."""
        return self._sizes.get(worker, 0)

    def sizes(self) -> dict[str, int]:
        """A copy of ``worker -> stored characters`` for every known worker."""
        return dict(self._sizes)

    @property
    def node_count(self) -> int:
        """Number of nodes including the root (a measure of the tree's memory)."""
        return self._nodes

    def total_chars(self) -> int:
        """Total length of all edge labels (the characters the tree really stores)."""
        return sum(len(n.key) for n in self._iter_nodes())

    def _walk(self, text: K) -> Iterator[tuple[_Node[K], int]]:
        """Nodes along ``text``'s path with the matched length after each (partial last node included)."""
        node, idx, n = self._root, 0, len(text)
        while idx < n:
            child = node.children.get(text[idx])
            if child is None:
                return
            shared = common_prefix_len(text, idx, child.key)
            idx += shared
            yield child, idx
            if shared < len(child.key):
                return
            node = child

    def match(self, text: K) -> PrefixMatch:
        """Longest prefix of ``text`` present in the tree and the workers holding all of it.

        Read-only (unlike SGLang's ``prefix_match`` it does not refresh access times; the router's
        :meth:`insert` of the routed prompt does). ``O(len(text))``.
        """
        best = PrefixMatch(0, frozenset())
        for node, matched in self._walk(text):
            if node.access:
                best = PrefixMatch(matched, frozenset(node.access))
        return best

    def prefix_match_per_worker(self, text: K) -> dict[str, int]:
        """``worker -> matched length`` of ``text`` for every worker holding at least one element of it.

        Workers with no match are absent. ``O(len(text) + path length x workers)``.
        """
        out: dict[str, int] = {}
        for node, matched in self._walk(text):
            for worker in node.access:
                out[worker] = matched
        return out

    # ---- updates -------------------------------------------------------------------------------------

    def insert(self, text: K, worker: str, now: float) -> None:
        """Record that ``text`` was sent to ``worker`` at time ``now`` (seconds, caller's clock).

        Every node on the path gets ``worker`` with access time ``now`` (the root too, so an empty ``text``
        registers the worker with size 0); a partially matched edge is split; the unmatched rest becomes a
        new leaf. The worker's size grows by the length of the edges it was not yet on.
        """
        root = self._root
        root.access[worker] = now
        self._sizes.setdefault(worker, 0)
        node, idx, n = root, 0, len(text)
        while idx < n:
            first = text[idx]
            child = node.children.get(first)
            if child is None:
                leaf: _Node[K] = _Node(text[idx:], node)
                node.children[first] = leaf
                self._nodes += 1
                leaf.access[worker] = now
                self._sizes[worker] += n - idx
                return
            shared = common_prefix_len(text, idx, child.key)
            if shared < len(child.key):
                child = self._split(child, shared)
            if worker not in child.access:
                self._sizes[worker] += len(child.key)
            child.access[worker] = now
            idx += shared
            node = child

    def _split(self, child: _Node[K], at: int) -> _Node[K]:
        """Cut ``child``'s edge at ``at`` (0 < at < len); return the new upper node (it keeps the workers)."""
        parent = child.parent
        assert parent is not None and 0 < at < len(child.key)
        upper: _Node[K] = _Node(child.key[:at], parent)
        upper.access = dict(child.access)
        parent.children[child.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        self._nodes += 1
        return upper

    def _detach_if_empty(self, node: _Node[K]) -> None:
        if node is not self._root and not node.access and not node.children:
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            node.parent = None
            self._nodes -= 1

    def _iter_nodes(self) -> Iterator[_Node[K]]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    @staticmethod
    def _is_leaf_of(node: _Node[K], worker: str) -> bool:
        return worker in node.access and not any(worker in c.access for c in node.children.values())

    def remove_worker(self, worker: str) -> None:
        """Forget ``worker`` entirely (it left the pool or lost its cache); prunes nodes nobody holds.

        ``O(nodes)``. A no-op for an unknown worker.
        """
        if worker not in self._sizes:
            return
        # post-order so children are detached before their parents are examined
        order = list(self._iter_nodes())
        for node in reversed(order):
            node.access.pop(worker, None)
            self._detach_if_empty(node)
        del self._sizes[worker]

    def evict(self, max_size_per_worker: int) -> int:
        """Evict least recently used leaves of every worker whose size exceeds ``max_size_per_worker``.

        SGLang's ``evict_tenant_by_size``: one min-heap of ``(last access, worker, node)`` over each worker's
        leaves; pop the oldest, drop the worker from that node (a node nobody holds is removed), and push the
        parent when it becomes that worker's leaf, until every worker is at most ``max_size_per_worker``.
        Ties in access time are broken by tree traversal order. ``O(nodes x workers + evicted log nodes)``.

        Returns:
            number of ``(worker, node)`` entries evicted.

        Raises:
            ValueError: ``max_size_per_worker`` is negative.
        """
        if max_size_per_worker < 0:
            raise ValueError("max_size_per_worker must be >= 0")
        over = {w for w, s in self._sizes.items() if s > max_size_per_worker}
        if not over:
            return 0
        tie = itertools.count()
        heap: list[tuple[float, int, str, _Node[K]]] = []
        for node in self._iter_nodes():
            if node is self._root:
                continue
            for worker in over.intersection(node.access):
                if self._is_leaf_of(node, worker):
                    heap.append((node.access[worker], next(tie), worker, node))
        heapq.heapify(heap)
        evicted = 0
        while heap:
            _, _, worker, node = heapq.heappop(heap)
            if self._sizes[worker] <= max_size_per_worker or worker not in node.access:
                continue
            del node.access[worker]
            self._sizes[worker] -= len(node.key)
            evicted += 1
            parent = node.parent
            self._detach_if_empty(node)
            if parent is not None and parent is not self._root and self._is_leaf_of(parent, worker):
                heapq.heappush(heap, (parent.access[worker], next(tie), worker, parent))
        return evicted

    def check_invariants(self) -> None:
        """Assert the structural invariants (for tests): sizes match, workers on ancestors, no empty nodes.

        Raises:
            AssertionError: an invariant does not hold.
        """
        sizes: dict[str, int] = dict.fromkeys(self._sizes, 0)
        count = 0
        for node in self._iter_nodes():
            count += 1
            if node is self._root:
                continue
            assert node.key, "empty edge label"
            assert node.access or node.children, "node held by nobody and without children"
            assert node.parent is not None and node.parent.children[node.key[0]] is node
            for worker in node.access:
                assert node.parent is self._root or worker in node.parent.access, "worker missing on ancestor"
                sizes[worker] += len(node.key)
        assert sizes == self._sizes, f"sizes {self._sizes} != recomputed {sizes}"
        assert count == self._nodes, f"node count {self._nodes} != {count}"

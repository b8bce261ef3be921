"""Radix prefix cache over token ids for the simulated SGLang worker (a model of RadixAttention's tree).

Like SGLang's ``RadixCache`` (page size 1): a compressed trie whose edges are runs of token ids; every node
holds the KV of its edge (one KV slot per token). Running requests *lock* the path of their prompt so it
cannot be evicted; unlocked leaves are evicted least-recently-used first when the engine needs room.
Sizes are in tokens (one token = one KV slot). Time stamps are the engine's virtual seconds.

Source of the behaviour: SGLang ``python/sglang/srt/mem_cache/radix_cache.py`` (match_prefix, insert,
inc/dec_lock_ref, evict by LRU over leaves) and the RadixAttention paper (Zheng et al., 2024, §3).

Eviction order: least recently used first; leaves touched at the same time in the order of a depth-first
walk that takes each node's newest child first; a parent that an eviction leaves childless goes after
every leaf of its time that was evictable when the eviction began. SGLang (and this module until the
fleet's planner experiment, whose hour-long runs keep every worker's cache full) builds a heap over every
leaf at each eviction, which costs a walk of the whole tree per engine step once the cache is full; the
same order is kept here in one heap across evictions: every change that makes a node an unlocked leaf,
or touches one, pushes an entry, and an eviction skips the entries that no longer hold (the node gained a
child, was locked, touched again or evicted). ``tests/loadgen/test_sim_radix.py`` checks that both give
the same evictions on random operations.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class RadixNode:
    """One edge of the tree: ``key`` is the run of token ids from the parent to this node.

    Attributes:
        key: token ids of the edge (empty only for the root).
        children: child nodes keyed by the first token id of their edge.
        parent: parent node (None for the root).
        lock_ref: how many running requests hold this node (locked nodes are never evicted).
        last_access_s: last match or insert touching this node (virtual seconds), for LRU.
        stamp: when its first token became a key of its parent's children (a split node keeps it): a
            newer sibling comes first in the eviction order's depth-first walk.
        entry: its newest entry in the eviction heap (0: none).
    """

    key: tuple[int, ...] = ()
    children: dict[int, RadixNode] = field(default_factory=dict)
    parent: RadixNode | None = None
    lock_ref: int = 0
    last_access_s: float = 0.0
    stamp: int = 0
    entry: int = 0


def _path(node: RadixNode) -> list[RadixNode]:
    """``node`` and its ancestors, root first."""
    out = []
    current: RadixNode | None = node
    while current is not None:
        out.append(current)
        current = current.parent
    out.reverse()
    return out


def _walk_before(a: RadixNode, b: RadixNode) -> bool:
    """Whether a depth-first walk that takes the newest child first reaches ``a`` before ``b``."""
    if a is b:
        return False
    pa, pb = _path(a), _path(b)
    for x, y in zip(pa, pb, strict=False):
        if x is not y:
            return x.stamp > y.stamp
    return len(pa) < len(pb)  # an ancestor before its descendants


class _Entry:
    """A node in the eviction heap: by time, then (``late`` 0) the walk's order, or (``late`` 1: pushed
    during the eviction under way) after those, in push order."""

    __slots__ = ("id", "late", "node", "seq", "time")

    def __init__(self, time: float, late: int, seq: int, node: RadixNode, id: int) -> None:
        self.time, self.late, self.seq, self.node, self.id = time, late, seq, node, id

    def __lt__(self, other: _Entry) -> bool:
        if self.time != other.time:
            return self.time < other.time
        if self.late != other.late:
            return self.late < other.late
        if self.late:
            return self.seq < other.seq
        return _walk_before(self.node, other.node)


class RadixCache:
    """Token-level prefix cache with lock counts and LRU eviction of unlocked leaves.

    The cache itself does not enforce a capacity: the engine owns the KV budget (tokens) and calls
    :meth:`evict` when it needs room, exactly as SGLang's scheduler does.
    """

    def __init__(self) -> None:
        self.root = RadixNode()
        self.root.lock_ref = 1  # the root is never evicted
        self._total = 0
        self._locked = 0
        self._stamps = itertools.count(1)
        self._ids = itertools.count(1)
        self._heap: list[_Entry] = []
        self._compact_at = 1024

    @property
    def total_tokens(self) -> int:
        """Tokens held by the tree (locked and evictable)."""
        return self._total

    @property
    def evictable_tokens(self) -> int:
        """Tokens in nodes no running request holds."""
        return self._total - self._locked

    @property
    def locked_tokens(self) -> int:
        """Tokens in nodes held by at least one running request."""
        return self._locked

    def match_prefix(self, tokens: Sequence[int], now_s: float) -> tuple[int, RadixNode]:
        """Longest cached prefix of ``tokens``: (its length in tokens, the node where it ends).

        A match that ends inside an edge splits that edge so the returned node covers exactly the match.
        Touches every node on the path (LRU).
        """
        node = self.root
        node.last_access_s = now_s
        matched = 0
        while matched < len(tokens):
            child = node.children.get(tokens[matched])
            if child is None:
                break
            common = _common_length(child.key, tokens, matched)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access_s = now_s
            node = child
            matched += common
            if common == 0:
                break
        if not node.children:
            self._offer(node)  # a leaf touched: its place in the eviction order moves
        return matched, node

    def insert(self, tokens: Sequence[int], now_s: float) -> tuple[int, RadixNode]:
        """Insert ``tokens``; returns (how many tokens were already cached, the node where they end)."""
        matched, node = self.match_prefix(tokens, now_s)
        if matched < len(tokens):
            new = RadixNode(
                key=tuple(tokens[matched:]), parent=node, last_access_s=now_s, stamp=next(self._stamps)
            )
            node.children[new.key[0]] = new
            self._total += len(new.key)
            node = new
            self._offer(node)
        return matched, node

    def lock(self, node: RadixNode) -> None:
        """A request holds the path root→``node``: none of it may be evicted until :meth:`unlock`."""
        current: RadixNode | None = node
        while current is not None and current is not self.root:
            if current.lock_ref == 0:
                self._locked += len(current.key)
            current.lock_ref += 1
            current = current.parent

    def unlock(self, node: RadixNode) -> None:
        """Release a hold taken with :meth:`lock`."""
        current: RadixNode | None = node
        while current is not None and current is not self.root:
            current.lock_ref -= 1
            if current.lock_ref == 0:
                self._locked -= len(current.key)
                if not current.children:
                    self._offer(current)
            current = current.parent

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves, least recently used first, until ``num_tokens`` are freed.

        Returns the tokens actually freed (less than asked when everything left is locked).
        """
        heap = self._heap
        freed = 0
        late: list[RadixNode] = []
        while freed < num_tokens and heap:
            entry = heapq.heappop(heap)
            leaf = entry.node
            if entry.id != leaf.entry or not self._evictable(leaf):
                continue  # stale: touched again, locked, gained a child or gone since it was pushed
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            leaf.entry = 0
            freed += len(leaf.key)
            self._total -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                parent.entry = next(self._ids)
                heapq.heappush(heap, _Entry(parent.last_access_s, 1, parent.entry, parent, parent.entry))
                late.append(parent)
        for node in late:  # from now on in the walk's order among the leaves of their time
            if self._evictable(node):
                self._offer(node)
        return freed

    def _evictable(self, node: RadixNode) -> bool:
        """Whether ``node`` is an unlocked leaf in the tree."""
        parent = node.parent
        return (
            parent is not None
            and node.lock_ref == 0
            and not node.children
            and parent.children.get(node.key[0]) is node
        )

    def _offer(self, node: RadixNode) -> None:
        """``node`` is an unlocked leaf (or may be): its entry in the eviction order, replacing older ones."""
        if node is self.root or node.lock_ref > 0:
            return
        node.entry = next(self._ids)
        heapq.heappush(self._heap, _Entry(node.last_access_s, 0, 0, node, node.entry))
        if len(self._heap) > self._compact_at:
            self._heap = [e for e in self._heap if e.id == e.node.entry and self._evictable(e.node)]
            heapq.heapify(self._heap)
            self._compact_at = 2 * len(self._heap) + 1024

    def reset(self) -> None:
        """Drop everything (``/flush_cache``); only valid when nothing is locked."""
        self.root = RadixNode()
        self.root.lock_ref = 1
        self._total = 0
        self._locked = 0
        self._heap = []
        self._compact_at = 1024

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Split ``child``'s edge after ``at`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = RadixNode(
            key=child.key[:at],
            parent=parent,
            lock_ref=child.lock_ref,
            last_access_s=child.last_access_s,
            stamp=child.stamp,  # it takes the child's place among its siblings
        )
        parent.children[upper.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        child.stamp = next(self._stamps)
        upper.children[child.key[0]] = child
        return upper


def _common_length(key: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    limit = min(len(key), len(tokens) - start)
    i = 0
    while i < limit and key[i] == tokens[start + i]:
        i += 1
    return i

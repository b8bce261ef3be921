"""Radix prefix cache over token ids for the simulated SGLang worker (a model of RadixAttention's tree).

Like SGLang's ``RadixCache`` (page size 1): a compressed trie whose edges are runs of token ids; every node
holds the KV of its edge (one KV slot per token). Running requests *lock* the path of their prompt so it
cannot be evicted; unlocked leaves are evicted least-recently-used first when the engine needs room.
Sizes are in tokens (one token = one KV slot). Time stamps are the engine's virtual seconds.

Source of the behaviour: SGLang ``python/sglang/srt/mem_cache/radix_cache.py`` (match_prefix, insert,
inc/dec_lock_ref, evict by LRU over leaves) and the RadixAttention paper (Zheng et al., 2024, §3).
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
    """

    key: tuple[int, ...] = ()
    children: dict[int, RadixNode] = field(default_factory=dict)
    parent: RadixNode | None = None
    lock_ref: int = 0
    last_access_s: float = 0.0


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
        self._tie = itertools.count()

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
        return matched, node

    def insert(self, tokens: Sequence[int], now_s: float) -> tuple[int, RadixNode]:
        """Insert ``tokens``; returns (how many tokens were already cached, the node where they end)."""
        matched, node = self.match_prefix(tokens, now_s)
        if matched < len(tokens):
            new = RadixNode(key=tuple(tokens[matched:]), parent=node, last_access_s=now_s)
            node.children[new.key[0]] = new
            self._total += len(new.key)
            node = new
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
            current = current.parent

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves, least recently used first, until ``num_tokens`` are freed.

        Returns the tokens actually freed (less than asked when everything left is locked).
        """
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

    def reset(self) -> None:
        """Drop everything (``/flush_cache``); only valid when nothing is locked."""
        self.root = RadixNode()
        self.root.lock_ref = 1
        self._total = 0
        self._locked = 0

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Split ``child``'s edge after ``at`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = RadixNode(
            key=child.key[:at], parent=parent, lock_ref=child.lock_ref, last_access_s=child.last_access_s
        )
        parent.children[upper.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

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


def _common_length(key: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    limit = min(len(key), len(tokens) - start)
    i = 0
    while i < limit and key[i] == tokens[start + i]:
        i += 1
    return i

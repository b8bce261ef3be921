"""Cache-aware routing: prefix affinity while load is balanced, least load when it is not (pure).

Algorithm and defaults: the ``cache_aware`` policy of SGLang's router (sgl-project/sglang,
``sgl-router/src/policies/cache_aware.rs``, now ``sgl-model-gateway``; defaults of its launcher and CLI,
``--cache-threshold 0.3 --balance-abs-threshold 64 --balance-rel-threshold 1.5 --eviction-interval 120
--max-tree-size 67108864``). For each request:

1. Load is *imbalanced* when ``max_load - min_load > balance_abs_threshold`` AND
   ``max_load > min_load x balance_rel_threshold`` (load = in-flight requests). Then the least loaded
   worker is chosen (reason ``imbalance``) and the prompt is still inserted into the tree for it.
2. Otherwise the worker with the longest prefix match in the shared :class:`~policies.radix_tree.RadixTree`
   is found. If ``matched / len(prompt) > cache_threshold`` it is chosen (``cache_hit``), else the worker
   with the smallest tree (most free cache) is chosen (``cache_miss``). The prompt is inserted for the
   chosen worker with the caller's time.
3. Every ``eviction_interval_s`` the tree is evicted (LRU leaves) down to ``max_tree_chars_per_worker``
   characters per worker.

Differences from SGLang, and why:
- Loads and matches consider only eligible workers (healthy, not excluded). SGLang takes min/max load over
  all workers and the match's first tenant even if unhealthy (then falls back to the first healthy one);
  here a retry that excludes the hit worker gets the next-best holder of the prefix instead.
- Ties among workers holding the longest match go to the least loaded (SGLang: arbitrary map order).
- Besides the periodic eviction, a worker whose tree exceeds ``eviction_slack x`` the cap is evicted at
  once, so memory stays bounded however fast requests come (SGLang only evicts on its timer).
- Feedback: :meth:`CacheAwarePolicy.observe_cached_tokens` drops a worker's tree when the engine keeps
  reporting far fewer cached tokens than the tree predicted (restarted worker), so a stale tree stops
  attracting traffic. SGLang's router has no such feedback; thresholds are project choices.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from policies.radix_tree import RadixTree
from policies.route_types import RouteDecision, WorkerView, candidates, load_key

_PREDICTION_MEMO = 4096  # project choice: decisions remembered for feedback (more than any in-flight set)


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """Settings of :class:`CacheAwarePolicy`. Defaults are SGLang router's CLI defaults unless noted.

    Attributes:
        cache_threshold: minimum match rate (matched chars / prompt chars, strictly greater) for a cache
            hit; SGLang ``--cache-threshold`` 0.3.
        balance: use SGLang's load-balance branch (step 1 of the module docstring). The gateway's admission
            core turns it off: it weighs a miss's prefill against the wait for the warm worker itself
            (:mod:`policies.admission_core`), where this branch sends a request to the least loaded
            worker whatever its prefill costs there.
        balance_abs_threshold: in-flight requests difference ``max - min`` above which load may be
            imbalanced; SGLang ``--balance-abs-threshold`` 64.
        balance_rel_threshold: ratio ``max > min x rel`` that must also hold; SGLang
            ``--balance-rel-threshold`` 1.5.
        max_tree_chars_per_worker: characters kept per worker after an eviction; SGLang ``--max-tree-size``
            2**26 (its tree counts characters per tenant).
        eviction_interval_s: seconds between periodic evictions; SGLang ``--eviction-interval`` 120.
        eviction_slack: project choice, 2.0: evict at once when a worker exceeds ``slack x`` the cap, so
            memory is bounded by ``slack x cap`` per worker between timer evictions; amortised cost O(1).
        miss_policy: where a miss goes. ``"smallest_tree"`` (default): SGLang router's
            ``get_smallest_tenant`` (documented behaviour), ties by load; ``"least_load"``: newer
            sgl-model-gateway code picks the least loaded worker, ties by tree size.
        stale_min_predicted_rate: project choice, 0.5: feedback only counts when the tree predicted at
            least this fraction of the prompt cached on the worker.
        stale_max_observed_fraction: project choice, 0.1: a report is a *shortfall* when the engine's cached
            fraction is below this fraction of the predicted rate (e.g. < 5 % cached where 50 % predicted).
        stale_reports: project choice, 3: consecutive shortfalls of one worker that drop its tree. More than
            one, because two concurrent requests sharing a new prefix can both miss the engine's cache.

    Raises:
        ValueError: a value out of range.
    """

    cache_threshold: float = 0.3
    balance: bool = True
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_chars_per_worker: int = 2**26
    eviction_interval_s: float = 120.0
    eviction_slack: float = 2.0
    miss_policy: Literal["smallest_tree", "least_load"] = "smallest_tree"
    stale_min_predicted_rate: float = 0.5
    stale_max_observed_fraction: float = 0.1
    stale_reports: int = 3

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")
        if self.max_tree_chars_per_worker < 0 or self.eviction_interval_s <= 0 or self.eviction_slack < 1.0:
            raise ValueError("max_tree_chars_per_worker >= 0, eviction_interval_s > 0, eviction_slack >= 1")
        if self.miss_policy not in ("smallest_tree", "least_load"):
            raise ValueError(f"unknown miss_policy {self.miss_policy!r}")
        predicted_ok = 0.0 < self.stale_min_predicted_rate <= 1.0
        if not (predicted_ok and 0.0 <= self.stale_max_observed_fraction <= 1.0):
            raise ValueError("stale_min_predicted_rate in (0, 1], stale_max_observed_fraction in [0, 1]")
        if self.stale_reports < 1:
            raise ValueError("stale_reports must be >= 1")


def is_imbalanced(loads: Sequence[int], abs_threshold: int, rel_threshold: float) -> bool:
    """SGLang router's imbalance test: ``max - min > abs_threshold and max > min x rel_threshold``.

    False for fewer than two loads. Loads are in-flight request counts.
    """
    if len(loads) < 2:
        return False
    hi, lo = max(loads), min(loads)
    return hi - lo > abs_threshold and hi > lo * rel_threshold


class CacheAwarePolicy:
    """SGLang router's cache-aware policy over one shared prefix tree; see the module docstring.

    Holds mutable state (the tree, the eviction time, feedback counters); ``choose`` mutates it. The
    caller's clock (seconds) drives LRU order and the eviction interval.
    """

    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()
        self.tree: RadixTree[str] = RadixTree()
        self._peer_chars: dict[str, int] = {}  # worker -> characters of its tree other replicas' routes added
        self._last_eviction: float | None = None
        self._predicted: OrderedDict[tuple[str, int, int], int] = OrderedDict()
        self._shortfalls: dict[str, int] = {}

    # ---- routing -------------------------------------------------------------------------------------

    def _size(self, url: str, own: bool) -> int:
        """``url``'s tree size, characters: all of it, or (``own``) without what other replicas' routes
        added (:meth:`observe_peer_route`)."""
        size = self.tree.size_of(url)
        return max(0, size - self._peer_chars.get(url, 0)) if own else size

    def _miss_key(self, w: WorkerView, own: bool) -> tuple[int, int, int]:
        size = self._size(w.url, own)
        if self.config.miss_policy == "smallest_tree":
            return (size, w.in_flight, w.in_flight_tokens)
        return (w.in_flight, w.in_flight_tokens, size)

    def choose(
        self,
        workers: Sequence[WorkerView],
        prompt: str,
        now: float,
        exclude: Collection[str] = (),
        session_id: str | None = None,
        commit: bool = True,
    ) -> RouteDecision | None:
        """Route ``prompt`` (rendered text) at time ``now`` (seconds); None when no worker is eligible.

        ``session_id`` is ignored (multi-turn affinity comes from the prompt of turn n+1 extending turn n).
        Side effects when ``commit``: inserts ``prompt`` for the chosen worker (:meth:`commit`); may evict
        (periodically or over the slack).
        """
        eligible = candidates(workers, exclude)
        if not eligible:
            return None
        self.maybe_evict(now)
        cfg = self.config
        per_worker = self.tree.prefix_match_per_worker(prompt) if prompt else {}
        loads = [w.in_flight for w in eligible]
        if cfg.balance and is_imbalanced(loads, cfg.balance_abs_threshold, cfg.balance_rel_threshold):
            pick = min(eligible, key=load_key)
            reason: Literal["imbalance", "cache_hit", "cache_miss"] = "imbalance"
        else:
            best = max(per_worker.get(w.url, 0) for w in eligible)
            if prompt and best / len(prompt) > cfg.cache_threshold:
                pick = min((w for w in eligible if per_worker.get(w.url, 0) == best), key=load_key)
                reason = "cache_hit"
            else:
                # every replica's routes while this replica has room everywhere (a worker's arrivals spaced
                # as one gateway's round robin spaces them); its own only once a window here is full, where
                # its queues must stay balanced over its own shares of the windows
                own = any(w.full for w in eligible)
                pick = min(eligible, key=lambda w: self._miss_key(w, own))
                reason = "cache_miss"
        matched = per_worker.get(pick.url, 0)
        if commit:
            self.commit(pick.url, prompt, now, matched)
        return RouteDecision(pick.url, reason, matched, matched / len(prompt) if prompt else 0.0)

    def commit(self, url: str, prompt: str, now: float, matched: int | None = None) -> None:
        """Insert ``prompt`` for ``url`` at ``now`` (s) and remember the prediction for feedback.

        ``matched``: the characters predicted cached on ``url`` (looked up when None).
        """
        if matched is None:
            matched = self.tree.prefix_match_per_worker(prompt).get(url, 0) if prompt else 0
        self._insert(url, prompt, now)
        self._remember(url, prompt, matched)

    def observe_peer_route(self, url: str, prompt: str, now: float) -> None:
        """Insert ``prompt`` for ``url`` at ``now`` (s): another gateway replica sent it there.

        Router replica sync (NVIDIA Dynamo's KV router shares its replicas' routing decisions the same way,
        ``--router-replica-sync``): with every replica's dispatches in its tree, a replica sees where
        the others placed a prefix (a hit instead of a second copy) and how much each worker was given
        (the smallest tree counts every replica's misses, so their round robins no longer interleave).
        No prediction is remembered: the feedback belongs to the replica that gets the engine's answer.
        An empty ``prompt`` is ignored.
        """
        if prompt:
            before = self.tree.size_of(url)
            self.tree.insert(prompt, url, now)
            added = self.tree.size_of(url) - before
            if added:
                self._peer_chars[url] = self._peer_chars.get(url, 0) + added
            self._evict_over_slack(url)

    def _insert(self, url: str, prompt: str, now: float) -> None:
        self.tree.insert(prompt, url, now)
        self._evict_over_slack(url)

    def _evict_over_slack(self, url: str) -> None:
        cfg = self.config
        if self.tree.size_of(url) > cfg.eviction_slack * cfg.max_tree_chars_per_worker:
            self._evict()

    def _evict(self) -> None:
        """LRU eviction down to the cap; other replicas' share of each tree shrinks in proportion."""
        before = self.tree.sizes()
        self.tree.evict(self.config.max_tree_chars_per_worker)
        for url, chars in list(self._peer_chars.items()):
            old = before.get(url, 0)
            self._peer_chars[url] = chars * self.tree.size_of(url) // old if old else 0

    def prefix_matches(self, prompt: str) -> dict[str, int]:
        """Characters of ``prompt`` the tree predicts each worker holds (workers with a match only)."""
        return self.tree.prefix_match_per_worker(prompt) if prompt else {}

    def maybe_evict(self, now: float) -> bool:
        """Run the periodic LRU eviction if ``eviction_interval_s`` passed since the last one (seconds).

        The first call only starts the interval. Returns True when an eviction ran.
        """
        if self._last_eviction is None:
            self._last_eviction = now
            return False
        if now - self._last_eviction < self.config.eviction_interval_s:
            return False
        self._last_eviction = now
        self._evict()
        return True

    # ---- feedback ------------------------------------------------------------------------------------

    def _remember(self, url: str, prompt: str, matched: int) -> None:
        key = (url, len(prompt), hash(prompt))
        self._predicted[key] = matched
        self._predicted.move_to_end(key)
        while len(self._predicted) > _PREDICTION_MEMO:
            self._predicted.popitem(last=False)

    def remove_worker(self, url: str) -> None:
        """Forget ``url``: its tree entries (pruning nodes only it held) and its feedback counter."""
        self.tree.remove_worker(url)
        self._shortfalls.pop(url, None)
        self._peer_chars.pop(url, None)

    def observe_cached_tokens(
        self,
        worker: str,
        prompt_text: str,
        engine_cached_tokens: int,
        prompt_tokens: int,
        predicted_chars: int | None = None,
    ) -> bool:
        """Compare the engine's cached prompt tokens with the tree's prediction for this request.

        Args:
            worker: URL the request ran on.
            prompt_text: the prompt as routed (same text as given to :meth:`choose`).
            engine_cached_tokens: ``usage.prompt_tokens_details.cached_tokens`` reported by SGLang.
            prompt_tokens: the prompt's token count.
            predicted_chars: the decision's ``matched_chars``; when None it is looked up among the last
                4096 decisions by (worker, prompt), and the report is ignored if not found.

        A report where the tree predicted at least ``stale_min_predicted_rate`` of the prompt but the engine
        had less than ``stale_max_observed_fraction`` of that cached is a shortfall; ``stale_reports``
        consecutive shortfalls drop the worker's whole tree (it lost its cache, e.g. restarted). A report
        that confirms the prediction resets the count. Rates compare characters with tokens, which is fine
        for the coarse test intended.

        Returns:
            True when the worker's tree was dropped.
        """
        if predicted_chars is None:
            predicted_chars = self._predicted.pop((worker, len(prompt_text), hash(prompt_text)), None)
        if predicted_chars is None or not prompt_text or prompt_tokens <= 0:
            return False
        cfg = self.config
        predicted_rate = min(1.0, predicted_chars / len(prompt_text))
        if predicted_rate < cfg.stale_min_predicted_rate:
            return False
        observed_rate = min(1.0, max(0, engine_cached_tokens) / prompt_tokens)
        if observed_rate >= predicted_rate * cfg.stale_max_observed_fraction:
            self._shortfalls[worker] = 0
            return False
        count = self._shortfalls.get(worker, 0) + 1
        if count < cfg.stale_reports:
            self._shortfalls[worker] = count
            return False
        self.tree.remove_worker(worker)
        self._shortfalls[worker] = 0
        self._peer_chars.pop(worker, None)
        return True

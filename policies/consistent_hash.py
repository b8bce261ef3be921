"""Consistent hashing of a session id or the prompt's leading block onto workers (pure).

Algorithm: a hash ring with virtual nodes (Karger et al., "Consistent Hashing and Random Trees", STOC 1997;
virtual nodes per server as in libketama, 160 points per server). Adding or removing one of N workers moves
only about 1/N of the keys. Optionally with bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent
Hashing with Bounded Loads", SODA 2018): a worker whose in-flight count would exceed
``ceil(load_factor x average)`` is skipped clockwise, like the ``prefix_hash`` policy of SGLang's model
gateway (``--prefix-hash-load-factor`` 1.25, ``--prefix-token-count`` 256).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from policies.route_types import RouteDecision, WorkerView, candidates

_MAX_CACHED_RINGS = 8  # project choice: pool membership changes rarely; a few recent rings suffice


def stable_hash(key: str) -> int:
    """64-bit hash of ``key`` that is the same in every process (BLAKE2b, RFC 7693), unlike ``hash()``.

    Gateway replicas must agree on the ring, so Python's salted ``hash`` is not usable here.
    """
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")


@dataclass(frozen=True, slots=True)
class ConsistentHashConfig:
    """Settings of :class:`ConsistentHash`.

    Attributes:
        virtual_nodes: ring points per worker; default 160, libketama's points per server.
        prefix_chars: characters of the prompt hashed when no session id is given; default 1024 = the 256
            tokens of SGLang model gateway's ``prefix_hash`` (``--prefix-token-count`` 256) at ~4 characters
            per token (OpenAI's rule of thumb for English text).
        load_factor: bounded-loads factor ``c`` (a worker is full at ``ceil(c x (total+1)/n)`` in-flight
            requests); default 1.25, SGLang model gateway's ``--prefix-hash-load-factor`` and the value
            studied by Mirrokni et al. None disables the bound (pure consistent hashing).

    Raises:
        ValueError: ``virtual_nodes`` < 1, ``prefix_chars`` < 1 or ``load_factor`` <= 1.
    """

    virtual_nodes: int = 160
    prefix_chars: int = 1024
    load_factor: float | None = 1.25

    def __post_init__(self) -> None:
        if self.virtual_nodes < 1:
            raise ValueError("virtual_nodes must be >= 1")
        if self.prefix_chars < 1:
            raise ValueError("prefix_chars must be >= 1")
        if self.load_factor is not None and self.load_factor <= 1.0:
            raise ValueError("load_factor must be > 1 (or None)")


class ConsistentHash:
    """Hash-ring router; key = ``session_id`` if given, else the first ``prefix_chars`` of the prompt.

    The ring is built over the *eligible* workers (healthy, not excluded), which is the same as walking
    clockwise past ineligible ones on the full ring; rings are cached per worker set. Reason is always
    ``"hash"``; ``matched_chars`` is 0 (no prefix tree). ``now`` is unused.
    """

    name = "consistent_hash"

    def __init__(self, config: ConsistentHashConfig | None = None) -> None:
        self.config = config or ConsistentHashConfig()
        self._rings: dict[tuple[str, ...], tuple[list[int], list[str]]] = {}

    def _ring(self, urls: tuple[str, ...]) -> tuple[list[int], list[str]]:
        ring = self._rings.get(urls)
        if ring is None:
            points = sorted(
                (stable_hash(f"{url}#{i}"), url) for url in urls for i in range(self.config.virtual_nodes)
            )
            ring = ([h for h, _ in points], [u for _, u in points])
            if len(self._rings) >= _MAX_CACHED_RINGS:
                del self._rings[next(iter(self._rings))]
            self._rings[urls] = ring
        return ring

    def key_for(self, prompt: str, session_id: str | None = None) -> str:
        """The string that is hashed: the session id, else the prompt's first ``prefix_chars`` characters."""
        return session_id if session_id is not None else prompt[: self.config.prefix_chars]

    def choose(
        self,
        workers: Sequence[WorkerView],
        prompt: str,
        now: float,
        exclude: Collection[str] = (),
        session_id: str | None = None,
        commit: bool = True,
    ) -> RouteDecision | None:
        """The first eligible worker clockwise from the key's hash (skipping full ones under bounded loads).

        ``now`` (seconds) is accepted for the common interface and unused. None when no worker is eligible.
        """
        eligible = candidates(workers, exclude)
        if not eligible:
            return None
        by_url = {w.url: w for w in eligible}
        hashes, owners = self._ring(tuple(sorted(by_url)))
        start = bisect.bisect(hashes, stable_hash(self.key_for(prompt, session_id)))
        lf = self.config.load_factor
        if lf is None:
            return RouteDecision(owners[start % len(owners)], "hash")
        total = sum(w.in_flight for w in eligible)
        capacity = math.ceil(lf * (total + 1) / len(eligible))
        # some worker is always below capacity: min load <= total/n < (total+1)/n <= capacity
        for step in range(len(owners)):
            url = owners[(start + step) % len(owners)]
            if by_url[url].in_flight < capacity:
                return RouteDecision(url, "hash")
        raise AssertionError("unreachable: no worker below the bounded-load capacity")

    def commit(self, url: str, prompt: str, now: float, matched: int | None = None) -> None:
        """Nothing to record: the ring is a function of the worker set."""

    def observe_peer_route(self, url: str, prompt: str, now: float) -> None:
        """Nothing to record: every replica computes the same ring."""

    def prefix_matches(self, prompt: str) -> dict[str, int]:
        """No tree: no predicted matches."""
        return {}

    def remove_worker(self, url: str) -> None:
        """Drop cached rings containing ``url`` (rings are rebuilt from the next snapshot anyway)."""
        for urls in [u for u in self._rings if url in u]:
            del self._rings[urls]

    def observe_cached_tokens(
        self,
        worker: str,
        prompt_text: str,
        engine_cached_tokens: int,
        prompt_tokens: int,
        predicted_chars: int | None = None,
    ) -> bool:
        """No feedback is used by hashing; always False."""
        return False

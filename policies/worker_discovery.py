"""Following a DNS name's records with a worker set: which workers to add, drain and remove (pure).

A discovered worker is registered while its record is there. When the record goes, the worker is drained
at once (no new requests, its streams finish) and removed ``remove_after_s`` later, unless the record comes
back first (then it is active again). Kubernetes' headless Services publish one record per *ready* pod, so a
pod that fails readiness or is terminating disappears from the answer before it stops: draining on
disappearance is what lets a worker leave without a lost stream (issue 29). Time is injected (s, any
monotonic clock).
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DiscoveryPlan:
    """What to do after one lookup.

    Attributes:
        add: URLs found that discovery has not registered yet, or registered as draining (register them
            active).
        drain: active URLs registered by discovery whose record is gone (mark draining, from ``now`` on).
        remove: URLs gone for at least ``remove_after_s`` (unregister them).
        gone_since: every discovered URL whose record is gone -> when it was first seen gone (s).
    """

    add: frozenset[str] = frozenset()
    drain: frozenset[str] = frozenset()
    remove: frozenset[str] = frozenset()
    gone_since: Mapping[str, float] = field(default_factory=dict)


def plan_discovery(
    found: Set[str],
    discovered: Mapping[str, bool],
    gone_since: Mapping[str, float],
    now: float,
    remove_after_s: float,
) -> DiscoveryPlan:
    """The changes that make the registered discovered workers follow one lookup.

    Args:
        found: worker URLs of the records in this answer.
        discovered: URLs registered by discovery so far -> whether each is draining (read from the shared
            registry, so a replica that starts late, or that never saw a record go, still reactivates a
            worker whose record came back).
        gone_since: from the previous plan: URL -> when its record was first seen gone, s.
        now: the time of this lookup, s.
        remove_after_s: how long a gone worker stays registered, draining, before removal, s.
    """
    add = frozenset(found - discovered.keys()) | frozenset(url for url in found if discovered.get(url, False))
    gone = {url: gone_since.get(url, now) for url in discovered.keys() - found}
    drain = frozenset(url for url in gone if not discovered[url])
    remove = frozenset(url for url, since in gone.items() if now - since >= remove_after_s)
    return DiscoveryPlan(
        add=add,
        drain=drain - remove,
        remove=remove,
        gone_since={url: since for url, since in gone.items() if url not in remove},
    )


__all__ = ["DiscoveryPlan", "plan_discovery"]

"""Each gateway replica's share of a worker's window (pure).

Every gateway replica runs its own admission core, and each core would fill a worker's whole window (the
engine's ``max_running_requests``): N replicas would offer a worker N times what it runs, the excess
waiting in the engine's queue where no class, fairness or deadline applies. With ``N`` live replicas, the
one at position ``i`` of their ids in sorted order takes ``floor(W / N)`` slots, plus one when
``i < W mod N`` (at least 1): the shares add up to ``W`` exactly when ``W >= N`` (``ceil(W / N)`` each
would offer up to ``N - 1`` more than ``W``), and to ``N`` otherwise (every replica keeps one slot, so
none of them starves).

The gateway (``service/workers/replicas.py``, its live replicas from Redis heartbeats) and the fleet
simulation (``loadgen/fleet/replicas.py``, N admission cores in virtual time) both call
:func:`window_share`, so what the simulation shows is the gateway's split.
"""

from __future__ import annotations

from collections.abc import Collection


def window_share(window: int, replicas: Collection[str], me: str) -> int:
    """``me``'s part of a ``window`` (requests) split over the ``replicas`` (their ids), >= 1.

    A replica missing from ``replicas`` counts as one more (it is about to appear among them). A
    ``window`` below 1 (an engine that reported none) gives each replica 1.
    """
    ids = sorted(set(replicas) | {me})
    n, i = len(ids), ids.index(me)
    return max(1, window // n + (1 if i < window % n else 0))


__all__ = ["window_share"]

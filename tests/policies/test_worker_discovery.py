"""plan_discovery: a DNS answer against the workers discovery registered (table-driven)."""

from __future__ import annotations

import pytest

from policies.worker_discovery import DiscoveryPlan, plan_discovery

A, B, C = "http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"


@pytest.mark.parametrize(
    ("found", "discovered", "gone_since", "now", "expected"),
    [
        # first answer: every record registered
        ({A, B}, {}, {}, 0.0, DiscoveryPlan(add=frozenset({A, B}))),
        # same answer again: nothing to do
        ({A, B}, {A: False, B: False}, {}, 10.0, DiscoveryPlan()),
        # B's record gone: drained now, remembered since when
        ({A}, {A: False, B: False}, {}, 10.0, DiscoveryPlan(drain=frozenset({B}), gone_since={B: 10.0})),
        # still gone, not yet remove_after_s (60 s): nothing new (already draining)
        ({A}, {A: False, B: True}, {B: 10.0}, 69.0, DiscoveryPlan(gone_since={B: 10.0})),
        # gone for remove_after_s: removed
        ({A}, {A: False, B: True}, {B: 10.0}, 70.0, DiscoveryPlan(remove=frozenset({B}))),
        # back before removal: active again, forgotten as gone
        ({A, B}, {A: False, B: True}, {B: 10.0}, 30.0, DiscoveryPlan(add=frozenset({B}))),
        # a replica that never saw B go (started later) still reactivates it: the registry says draining
        ({A, B}, {A: False, B: True}, {}, 30.0, DiscoveryPlan(add=frozenset({B}))),
        # a replica that starts while B is draining counts its time gone from its own first look
        ({A}, {A: False, B: True}, {}, 30.0, DiscoveryPlan(gone_since={B: 30.0})),
        # an empty answer (NXDOMAIN or no records) drains everything; a new record is added meanwhile
        (
            {C},
            {A: False, B: False},
            {},
            5.0,
            DiscoveryPlan(add=frozenset({C}), drain=frozenset({A, B}), gone_since={A: 5.0, B: 5.0}),
        ),
    ],
)
def test_plan_discovery(
    found: set[str],
    discovered: dict[str, bool],
    gone_since: dict[str, float],
    now: float,
    expected: DiscoveryPlan,
) -> None:
    assert plan_discovery(found, discovered, gone_since, now, remove_after_s=60.0) == expected


def test_remove_after_zero_removes_on_the_first_miss() -> None:
    plan = plan_discovery({A}, {A: False, B: False}, {}, 1.0, remove_after_s=0.0)
    assert plan == DiscoveryPlan(remove=frozenset({B}))

"""The local buckets of ``redis.on_outage = open`` (policies/outage_buckets.py), on tables."""

from __future__ import annotations

import math

import pytest

from policies.outage_buckets import LocalWant, OutageBuckets, concurrency_share, replica_share
from policies.token_bucket import BucketLimit


@pytest.mark.parametrize(
    ("rate", "capacity", "replicas", "share"),
    [
        (60, 60, 1, (60, 60)),
        (60, 60, 3, (20, 20)),
        (600, 90, 4, (150, 22.5)),
        (60, 60, 0, (60, 60)),  # no replica known (never beat): itself
        (60, 60, -2, (60, 60)),
    ],
)
def test_replica_share_divides_rate_and_burst(
    rate: float, capacity: float, replicas: int, share: tuple[float, float]
) -> None:
    limit = replica_share(rate, capacity, replicas)
    assert (limit.rate_per_min, limit.capacity) == pytest.approx(share)


@pytest.mark.parametrize(
    ("cap", "replicas", "share"), [(10, 1, 10), (10, 3, 3), (2, 3, 0), (1, 1, 1), (5, 0, 5)]
)
def test_concurrency_share_rounds_down(cap: int, replicas: int, share: int) -> None:
    assert concurrency_share(cap, replicas) == share


def requests(tenant: str, replicas: int, rpm: float = 60, burst: float = 60) -> LocalWant:
    return LocalWant((tenant, "requests"), replica_share(rpm, burst, replicas), 1)


# (replicas, RPM, burst, times at which one request each comes (ms), expected admissions)
ADMISSIONS = [
    # 60 RPM over 3 replicas: 20 burst, then one every 3 s
    (3, 60, 60, [0] * 25, 20),
    (3, 60, 60, [0] * 20 + [2_999], 20),
    (3, 60, 60, [0] * 20 + [3_000], 21),
    (3, 60, 60, [0] * 20 + [3_000, 3_001, 6_000], 22),
    # one replica: the whole limit
    (1, 60, 60, [0] * 70, 60),
    # 6 RPM, burst 30 over 3: 10 at once, the next only after 30 s
    (3, 6, 30, [0] * 15 + [29_999], 10),
    (3, 6, 30, [0] * 15 + [30_000], 11),
    # a minute at one request per 100 ms: burst/N plus rate/N x 1 min
    (4, 120, 40, [i * 100 for i in range(601)], 10 + 30),
]


@pytest.mark.parametrize(("replicas", "rpm", "burst", "times", "admitted"), ADMISSIONS)
def test_admissions_per_replica_are_the_share_of_the_limit(
    replicas: int, rpm: float, burst: float, times: list[int], admitted: int
) -> None:
    buckets = OutageBuckets(10)
    want = requests("t", replicas, rpm, burst)
    assert sum(buckets.take([want], t).allowed for t in times) == admitted


def test_n_replicas_together_admit_at_most_the_rate_plus_one_burst() -> None:
    """Each replica its own buckets (no Redis): over a minute at 10 requests/s offered to each of 3
    replicas, a 60 RPM / 60 burst tenant gets 3 x (20 + 20) = 120 = rate x 1 min + burst, not 3 x 120."""
    replicas = [OutageBuckets(10) for _ in range(3)]
    admitted = 0
    for t in range(0, 60_001, 100):
        for buckets in replicas:
            admitted += buckets.take([requests("t", 3)], t).allowed
    assert admitted == 3 * (20 + 20)


def test_all_or_nothing_and_the_first_short_is_named() -> None:
    buckets = OutageBuckets(10)
    req = LocalWant("req", BucketLimit(60, 10), 1)
    tok = LocalWant("tok", BucketLimit(600, 100), 60)
    assert buckets.take([req, tok], 0).allowed
    refused = buckets.take([req, tok], 0)  # 9 requests left, 40 tokens: short of tokens
    assert (refused.allowed, refused.limiting, refused.never) == (False, 1, False)
    assert refused.wait_ms == pytest.approx(2_000)  # 20 tokens at 10/s
    assert refused.levels == pytest.approx((9, 40))  # the request bucket was not debited
    small = buckets.take([req, LocalWant("tok", BucketLimit(600, 100), 40)], 0)
    assert small.allowed and small.levels == pytest.approx((8, 0))


def test_a_cost_above_the_share_can_never_pass_here() -> None:
    buckets = OutageBuckets(10)
    share = replica_share(600, 300, 3)  # 100 tokens of burst here
    refused = buckets.take([LocalWant("tok", share, 150)], 0)
    assert (refused.allowed, refused.never, refused.limiting) == (False, True, 0)
    assert math.isinf(refused.wait_ms)


def test_give_back_refunds_and_charges_within_the_capacity() -> None:
    buckets = OutageBuckets(10)
    tok = LocalWant("tok", BucketLimit(60, 100), 80)
    buckets.take([tok], 0)  # 20 left
    buckets.give_back([tok._replace(cost=50)], 0)  # the request used 30 of its 80
    assert buckets.take([tok._replace(cost=70)], 0).allowed
    buckets.give_back([tok._replace(cost=-500)], 0)  # an overrun: floored at minus the capacity
    assert buckets.take([tok._replace(cost=0.5)], 0).levels == pytest.approx((-100,))
    buckets.give_back([LocalWant("unknown", BucketLimit(60, 100), 5)], 0)
    assert len(buckets) == 1  # a bucket not held is not created by a refund


def test_a_smaller_share_caps_the_level_and_a_dropped_bucket_comes_back_full() -> None:
    buckets = OutageBuckets(2)
    assert buckets.take([requests("a", 1)], 0).levels == pytest.approx((59,))
    # a third replica appeared: the share is 20, the level capped there
    assert buckets.take([requests("a", 3)], 0).levels == pytest.approx((19,))
    buckets.take([requests("b", 1)], 0)
    buckets.take([requests("c", 1)], 0)  # "a" was the least recently used: dropped
    assert len(buckets) == 2
    assert buckets.take([requests("a", 3)], 0).levels == pytest.approx((19,))


def test_time_going_backwards_refills_nothing() -> None:
    buckets = OutageBuckets(2)
    want = requests("t", 3)
    for _ in range(20):
        assert buckets.take([want], 10_000).allowed
    assert not buckets.take([want], 5_000).allowed
    assert buckets.take([want], 13_000).allowed


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        OutageBuckets(0)

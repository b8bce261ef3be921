"""Each simulator profile reproduces its cited anchor figures (virtual time, closed loop or burst)."""

from __future__ import annotations

import pytest

from loadgen.sim.calibrate import check_anchor, run_closed_loop
from loadgen.sim.profiles import PROFILES, get_profile

CASES = [(name, i) for name, p in PROFILES.items() for i in range(len(p.anchors))]


@pytest.mark.parametrize(("name", "index"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_profile_reproduces_its_anchor(name: str, index: int) -> None:
    profile = PROFILES[name]
    anchor = profile.anchors[index]
    value, error = check_anchor(profile, anchor)
    assert abs(error) <= anchor.tolerance, (
        f"{name} {anchor.metric} c={anchor.concurrency}: sim {value:.3f} vs published {anchor.value} "
        f"({error:+.1%}, tolerance ±{anchor.tolerance:.0%}); source: {anchor.source}"
    )


def test_every_profile_cites_its_anchors_and_the_required_profiles_exist() -> None:
    assert {"llama-3.1-8b-h100", "llama-3.1-70b-h100-tp8", "smollm2-135m-cpu2"} <= set(PROFILES)
    for profile in PROFILES.values():
        assert len(profile.anchors) >= 3 and profile.notes
        assert all(a.source and 0 < a.tolerance <= 0.2 for a in profile.anchors)


def test_throughput_rises_with_concurrency_as_the_profile_says() -> None:
    profile = get_profile("llama-3.1-8b-h100")
    rates = [run_closed_loop(profile, c, 200, 100, rounds=2).output_tok_s for c in (1, 8, 64)]
    assert rates[0] < rates[1] < rates[2]
    assert rates[2] > 20 * rates[0]  # memory-bound decode: batching is almost free per token


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match=r"llama-3\.1-8b-h100"):
        get_profile("nope")

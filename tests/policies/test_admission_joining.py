"""The admission core when the fleet changes under load (policies.admission_core): a joining worker starts
from a measured peer's estimates, and a request that would be found late the moment it is dispatched is
placed where it is on time instead of being admitted and expired 0 ms later."""

from __future__ import annotations

from policies.admission_core import AdmissionCore
from policies.admission_types import Dispatch, Expire
from tests.policies.test_admission_core import W1, W2, core, req

W3 = "http://w3"


def teach(c: AdmissionCore, url: str, t: float, base_s: float, per_token_s: float) -> float:
    """Serve one request at a time on ``url`` (the others ineligible meanwhile) whose engine TTFT is
    ``base_s + per_token_s x prompt tokens``; returns the time after."""
    others = [u for u in c.worker_urls if u != url]
    for other in others:
        c.set_eligible(other, False, t)
    for n in range(90):
        tokens = (100, 1000, 2000)[n % 3]
        rid = f"teach-{url}-{n}"
        c.arrive(req(rid, "standard", tenant="teach", at=t, prompt=f"teach {n}", tokens=tokens), t)
        ttft = base_s + per_token_s * tokens
        c.first_token(rid, t + ttft)
        c.finish(rid, t + ttft + 0.01, ok=True, prompt_tokens=tokens, cached_tokens=0)
        t += ttft + 0.02
    for other in others:
        c.set_eligible(other, True, t)
    return t


def test_a_joining_worker_starts_from_the_peer_measured_most() -> None:
    c = core(window=8, workers=(W1, W2))
    t = teach(c, W1, 0.0, base_s=0.05, per_token_s=1e-4)
    c.add_worker(W3)
    snaps = {s.url: s for s in c.snapshot(t)}
    assert snaps[W1].ttft_base_s is not None and snaps[W1].prefill_s_per_token is not None
    assert (snaps[W3].ttft_base_s, snaps[W3].prefill_s_per_token, snaps[W3].capacity_rps) == (
        snaps[W1].ttft_base_s,
        snaps[W1].prefill_s_per_token,
        snaps[W1].capacity_rps,
    )
    assert snaps[W2].ttft_base_s is None  # W2 itself joined before anything was measured
    # a copy: what W3 measures is its own, W1's stay
    end = teach(c, W3, t, base_s=0.5, per_token_s=1e-3)
    after = {s.url: s for s in c.snapshot(end)}
    w1, w3 = after[W1], after[W3]
    assert w1.idle_ttft_s is not None and w3.idle_ttft_s is not None
    assert w1.capacity_rps is not None and w3.capacity_rps is not None
    assert w3.idle_ttft_s > 2 * w1.idle_ttft_s and w3.capacity_rps < w1.capacity_rps / 2


def test_a_core_with_nothing_measured_gives_a_joining_worker_nothing() -> None:
    c = core(window=8)
    c.add_worker(W2)
    assert {s.url: s.ttft_base_s for s in c.snapshot(0.0)} == {W1: None, W2: None}


def test_a_request_admitted_on_time_is_dispatched_not_expired_by_the_dispatch_margin() -> None:
    c = core(window=8, workers=(W1, W2))
    t = teach(c, W1, 0.0, base_s=0.05, per_token_s=3e-4)
    t = teach(c, W2, t, base_s=0.05, per_token_s=3e-4)
    # W1: three 1,000-token prefills in flight (no first token yet): 3,000 tokens of backlog
    c.set_eligible(W2, False, t)
    for k in range(3):
        c.arrive(req(f"w1-{k}", "standard", at=t, prompt=f"backlog {k}", tokens=1000), t)
    c.set_eligible(W2, True, t)
    c.set_eligible(W1, False, t)
    for k in range(4):  # W2: more in flight, prefills done
        c.arrive(req(f"w2-{k}", "standard", at=t, prompt=f"decoding {k}", tokens=1000), t)
        c.first_token(f"w2-{k}", t + 0.01)
    c.set_eligible(W1, True, t + 0.01)
    now = t + 0.02
    # least load picks W1 (3 < 4): its engine TTFT is predicted at 0.41 s behind the backlog, within the
    # 0.5 s goal (admitted) but not over the 25% dispatch margin, which judges requests that waited
    out = c.arrive(req("i", "interactive", at=now, prompt="a fresh question", tokens=1000), now)
    assert not [d for d in out if isinstance(d, Expire)]
    assert [(d.rid, d.worker) for d in out if isinstance(d, Dispatch)] == [("i", W1)]

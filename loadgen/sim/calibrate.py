"""Closed-loop benchmarks of a simulated worker in virtual time (how profiles are checked against anchors).

:func:`run_closed_loop` mimics the tools behind the cited figures (genai-perf / AIPerf, SGLang's
``bench_serving`` with a fixed concurrency): ``concurrency`` clients each send a request of
``input_tokens`` distinct (never cached) prompt tokens and ``max_new_tokens = output_tokens``, and send
the next as soon as one finishes. Runs in virtual time: thousands of simulated seconds take well under a
second of CPU.

Command line: ``python -m loadgen.sim.calibrate`` prints every profile's anchors next to the simulation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadgen.sim.engine import SimEngine, SimRequest
from loadgen.sim.profiles import Anchor, SimProfile


@dataclass(frozen=True, slots=True)
class ClosedLoopResult:
    """What one closed-loop run measured.

    Attributes:
        ttft_ms: mean time to first token over measured requests (ms).
        itl_ms: mean inter-token latency, (latency − TTFT) / (tokens − 1) averaged over requests (ms).
        e2e_s: mean request latency (s).
        output_tok_s: output tokens per second of the whole run.
        requests: requests measured.
    """

    ttft_ms: float
    itl_ms: float
    e2e_s: float
    output_tok_s: float
    requests: int

    def metric(self, name: str) -> float:
        """The value of an :class:`~loadgen.sim.profiles.Anchor` metric name."""
        return float(getattr(self, name))


def run_closed_loop(
    profile: SimProfile,
    concurrency: int,
    input_tokens: int,
    output_tokens: int,
    rounds: int = 4,
    seed: int = 0,
    warmup: bool = True,
) -> ClosedLoopResult:
    """Run ``concurrency`` closed-loop clients for ``rounds`` requests each (see the module docstring).

    With ``warmup`` the first round (all clients starting at once) is left out of the latency means;
    throughput counts every token over the whole run.
    """
    engine = SimEngine(profile, seed=seed)
    rng = random.Random(seed)
    sent: dict[str, tuple[float, int]] = {}  # rid -> (start s, round)
    first: dict[str, float] = {}
    done: list[tuple[float, float, float]] = []  # (start, first token, end)
    counter = 0

    def send(now: float, round_no: int) -> None:
        nonlocal counter
        rid = f"c{counter}"
        counter += 1
        prompt = tuple(rng.randrange(1, 2**31) for _ in range(input_tokens))
        engine.submit(SimRequest(rid=rid, prompt=prompt, max_new_tokens=output_tokens), now)
        sent[rid] = (now, round_no)

    for _ in range(concurrency):
        send(0.0, 0)
    tokens = 0
    end = 0.0
    while (t := engine.next_event_time()) is not None:
        for ev in engine.advance(t):
            tokens += 1
            first.setdefault(ev.rid, ev.time_s)
            if ev.finish_reason is None:
                continue
            start, round_no = sent.pop(ev.rid)
            end = ev.time_s
            if round_no > 0 or not warmup:
                done.append((start, first[ev.rid], ev.time_s))
            if round_no + 1 < rounds:
                send(ev.time_s, round_no + 1)
    n = max(len(done), 1)
    itl = sum((e - f) / max(output_tokens - 1, 1) for _, f, e in done) / n
    return ClosedLoopResult(
        ttft_ms=1000 * sum(f - s for s, f, _ in done) / n,
        itl_ms=1000 * itl,
        e2e_s=sum(e - s for s, _, e in done) / n,
        output_tok_s=tokens / end if end > 0 else 0.0,
        requests=len(done),
    )


def run_burst(
    profile: SimProfile, concurrency: int, input_tokens: int, output_tokens: int, seed: int = 0
) -> ClosedLoopResult:
    """``concurrency`` requests sent at once to an idle engine; every request is measured."""
    return run_closed_loop(
        profile, concurrency, input_tokens, output_tokens, rounds=1, seed=seed, warmup=False
    )


def check_anchor(profile: SimProfile, anchor: Anchor) -> tuple[float, float]:
    """Simulate ``anchor``'s benchmark shape; returns (simulated value, relative error)."""
    if anchor.burst:
        result = run_burst(profile, anchor.concurrency, anchor.input_tokens, anchor.output_tokens)
    else:
        rounds = 6 if anchor.concurrency <= 10 else 3
        result = run_closed_loop(
            profile, anchor.concurrency, anchor.input_tokens, anchor.output_tokens, rounds
        )
    value = result.metric(anchor.metric)
    return value, (value - anchor.value) / anchor.value


def main() -> None:
    """Print each profile's anchors beside the simulated values."""
    from loadgen.sim.profiles import PROFILES

    for profile in PROFILES.values():
        print(f"{profile.name}: {profile.model} on {profile.hardware}")
        for anchor in profile.anchors:
            value, err = check_anchor(profile, anchor)
            flag = "ok " if abs(err) <= anchor.tolerance else "OFF"
            print(
                f"  {flag} c={anchor.concurrency:<4} {anchor.input_tokens}/{anchor.output_tokens} "
                f"{anchor.metric:<13} published {anchor.value:>9.2f} sim {value:>9.2f} "
                f"({err:+.1%}, tol ±{anchor.tolerance:.0%})"
            )


if __name__ == "__main__":
    main()

"""The live run of issue 28: a gateway in front of three simulated workers, watched by a real Prometheus and
Alertmanager (:mod:`tests.support.prometheus_live`), driven through light load, an overload, its end and a
worker's death. The live tests assert on what it records; ``python -m tests.support.live_scenario --out
docs/img`` runs it once and renders the dashboards' panels over it (the docs' ``ops-*.png``).

Phases (wall-clock seconds on this machine; the rules run at :data:`FACTOR`, 5 m -> 5 s):

1. ``light``: 3 clients (2 interactive, 1 batch) for :data:`LIGHT_S`; a quota-limited tenant sends a request
   every :data:`LIMITED_EVERY_S` and gets 413s (every 4th asks more than its token burst) and 429s (past its
   request burst of 2). No alert should fire.
2. ``overload``: 24 interactive and 16 batch clients against workers with a fixed window of 4 requests each,
   until RadixgateShedRateHigh (band interactive) and RadixgateTTFTBudgetBurnFast (class batch) have both
   reached the webhook (at most :data:`ALERT_TIMEOUT_S`). Admission control sheds (503) the interactive
   requests it predicts late, so the interactive answers it serves keep their goal; batch serves late
   answers (``serve_late``), so it is batch whose TTFT budget burns.
3. ``recovery``: from the moment the clients are told to stop (each finishes the request it has under way:
   batch ones may wait in the queue for seconds), until both alerts are resolved at the webhook.
4. ``kill``: 2 interactive clients; worker 2 drops its next three streams mid-way (the simulator's
   ``crash_mid_stream`` fault: the gateway retries them elsewhere) and is stopped once it has (at least
   :data:`CRASH_S` later);
   until RadixgateWorkerUnhealthy for it fires, then :data:`HOLD_S` more.

Classes: interactive and standard as shipped (500 ms, 2 s); batch's goal is 1 s instead of 30 s (a 30 s goal
would need answers 30 s late to miss it), its queue wait 8 s. The workers run at ``speed`` 0.05 (20 times
slower than the modelled H100) so that a few dozen clients overload them on two shared CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.model_stub import write_stub_model
from tests.support.prometheus import SimStack
from tests.support.prometheus_live import FACTOR, LivePrometheus, Load, Notified, Webhook
from tests.support.servers import redis_server

CLASSES = {
    "interactive": {"rank": 2, "sglang_priority": 10, "ttft_goal_ms": 500, "max_queue_len": 1000},
    "standard": {"rank": 1, "sglang_priority": 5, "ttft_goal_ms": 2000},
    "batch": {
        "rank": 0,
        "sglang_priority": 0,
        "ttft_goal_ms": 1000,
        "serve_late": True,
        "queue_wait_budget_ms": 8000,
    },
}
"""The gateway's priority classes in the live run (see the module docstring)."""

SPEED = 0.05
WINDOW = 4
LIGHT_S = 6.0
ALERT_TIMEOUT_S = 60.0
HOLD_S = 2.0
LIMITED_EVERY_S = 0.5
"""Pause between the quota-limited tenant's requests in the light phase, s."""
KILLED = 2
"""Index of the worker the kill phase stops."""
CRASH_S = 1.5
"""How long the worker drops its streams (SimServer's ``crash_mid_stream`` fault) before it is stopped, at
least: it is stopped once it has dropped all three (up to :data:`CRASH_WAIT_S`). Stopped after 1.5 s
alone, on a clean-clone CI run the gateway had sent it nothing in that time, and the dashboards' upstream
error and retry panels had no data."""
CRASH_WAIT_S = 20.0
"""The longest the kill phase waits for the worker to have dropped its three streams, s."""


@dataclass
class Timeline:
    """What a run did and saw.

    Attributes:
        phases: name -> (start, end), ``time.time()`` s. statuses: phase -> the HTTP statuses its clients got
        (``limited``: the quota-limited tenant's). killed: the stopped worker's URL. workers: every worker's
        URL. seen: name -> the notification the run waited for (None if it did not come in time).
    """

    phases: dict[str, tuple[float, float]] = field(default_factory=dict)
    statuses: dict[str, Counter[int]] = field(default_factory=dict)
    killed: str = ""
    workers: list[str] = field(default_factory=list)
    seen: dict[str, Notified | None] = field(default_factory=dict)

    @property
    def span(self) -> tuple[float, float]:
        """First phase's start, last phase's end."""
        return min(s for s, _ in self.phases.values()), max(e for _, e in self.phases.values())


def _bodies(stack: SimStack, priority: str) -> Any:
    return lambda i: stack.chat(
        f"question {i} {priority} " * 8, max_tokens=16, stream=True, priority=priority
    )


def _loads(stack: SimStack, key: str, interactive: int, batch: int) -> list[Load]:
    loads = [Load(stack.url, key, _bodies(stack, "interactive"), interactive)]
    if batch:
        loads.append(Load(stack.url, key, _bodies(stack, "batch"), batch))
    return [load.start() for load in loads]


def _stop(loads: list[Load]) -> Counter[int]:
    total: Counter[int] = Counter()
    for load in loads:
        total.update(load.stop())
    return total


def run(stack: SimStack, hook: Webhook) -> Timeline:
    """The four phases against ``stack`` (watched by a LivePrometheus posting to ``hook``)."""
    timeline = Timeline(workers=[s.url for s in stack.worker_servers])
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        key = stack.new_key(http)
        limited = stack.new_key(
            http,
            quotas={"requests_per_min": 6, "request_burst": 2, "tokens_per_min": 6000, "token_burst": 400},
        )

        start = time.time()
        loads = _loads(stack, key, interactive=2, batch=1)
        auth = {"Authorization": f"Bearer {limited}"}
        limited_statuses: Counter[int] = Counter()
        timeline.statuses["limited"] = limited_statuses
        deadline = start + LIGHT_S
        for i in itertools.count():
            # every 4th asks for more tokens than its burst (413), the rest pass until the request burst is
            # spent (429 after): spread over the phase, so that the refusal counters rise between scrapes
            body = stack.chat("too long", max_tokens=1000) if i % 4 == 0 else stack.chat(f"hello {i}")
            limited_statuses[http.post("/v1/chat/completions", json=body, headers=auth).status_code] += 1
            if time.time() + LIMITED_EVERY_S > deadline:
                break
            time.sleep(LIMITED_EVERY_S)
        time.sleep(max(0.0, deadline - time.time()))
        timeline.statuses["light"] = _stop(loads)
        timeline.phases["light"] = (start, time.time())

        start = time.time()
        loads = _loads(stack, key, interactive=24, batch=16)
        waits = {
            "shed": ("RadixgateShedRateHigh", {"band": "interactive"}),
            "ttft_burn": ("RadixgateTTFTBudgetBurnFast", {"class": "batch"}),
        }
        for name, (alert, labels) in waits.items():
            left = ALERT_TIMEOUT_S - (time.time() - start)
            timeline.seen[name] = hook.wait_for(alert, "firing", left, since=start, **labels)
        stopped = time.time()
        timeline.phases["overload"] = (start, stopped)
        timeline.statuses["overload"] = _stop(loads)

        start = stopped
        for name, (alert, labels) in waits.items():
            left = ALERT_TIMEOUT_S - (time.time() - start)
            timeline.seen[f"{name}_resolved"] = hook.wait_for(alert, "resolved", left, since=start, **labels)
        timeline.phases["recovery"] = (start, time.time())

        start = time.time()
        loads = _loads(stack, key, interactive=2, batch=0)
        timeline.killed = stack.worker_servers[KILLED].url
        crash = {"mode": "crash_mid_stream", "after_tokens": 2, "count": 3}
        httpx.post(f"{timeline.killed}/sim/fault", json=crash).raise_for_status()
        time.sleep(CRASH_S)
        deadline = time.time() + CRASH_WAIT_S
        while time.time() < deadline:  # the fault turns itself off once its count is used up
            if httpx.get(f"{timeline.killed}/sim/fault").json()["mode"] != "crash_mid_stream":
                break
            time.sleep(0.1)
        stack.kill_worker(KILLED)
        timeline.seen["unhealthy"] = hook.wait_for(
            "RadixgateWorkerUnhealthy", "firing", ALERT_TIMEOUT_S, since=start, worker=timeline.killed
        )
        time.sleep(HOLD_S)
        timeline.statuses["kill"] = _stop(loads)
        timeline.phases["kill"] = (start, time.time())
    return timeline


@contextlib.contextmanager
def live(
    workdir: Path, redis_url: str, model_dir: Path
) -> Iterator[tuple[SimStack, LivePrometheus, Webhook]]:
    """The stack of the live run (three workers, :data:`SPEED`, fixed windows of :data:`WINDOW`), its
    Prometheus and Alertmanager, and the webhook they post to."""
    settings: dict[str, Any] = {
        "observability": {"log_level": "WARNING"},
        "scheduler": {"window_mode": "fixed", "window_initial": WINDOW},
        "priority_classes": CLASSES,
    }
    with (
        Webhook() as hook,
        SimStack(redis_url, model_dir, workers=3, speed=SPEED, **settings) as stack,
        LivePrometheus(workdir, stack.url, [s.url for s in stack.worker_servers], hook.url) as prom,
    ):
        yield stack, prom, hook


def main(argv: list[str] | None = None) -> int:
    """Run the live scenario once and render every dashboard over it into ``--out``."""
    from service.observability.dashboards.plot import render_all

    parser = argparse.ArgumentParser(prog="python -m tests.support.live_scenario", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("docs/img"), help="folder of the ops-*.png")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with (
            redis_server(work) as redis_url,
            live(work / "prom", redis_url, write_stub_model(work / "m")) as env,
        ):
            stack, prom, hook = env
            timeline = run(stack, hook)
            time.sleep(2)
            start, end = timeline.span
            for name, (s, e) in timeline.phases.items():
                print(f"{name}: {s - start:.1f}-{e - start:.1f} s {dict(timeline.statuses.get(name, {}))}")
            for name, seen in timeline.seen.items():
                print(f"{name}: {'-' if seen is None else f'{seen.at - start:.1f} s'}")
            marks = {name: s - start for name, (s, _) in timeline.phases.items()}
            for path in render_all(prom.url, start, end + 2, args.out, FACTOR, marks):
                print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``make up-sim`` (scripts/up_sim.py): compose.yaml's sim topology as local processes really serves here:
Redis, 2 gateway processes on one port, simulated workers (and Prometheus, installed by ``make setup``), a
streamed chat and plain chats all answered 200, every worker registered and healthy, everything stopped after.
About 8 s."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.paths import REPO


def test_up_sim_starts_the_topology_serves_and_stops() -> None:
    run = subprocess.run(
        [sys.executable, "scripts/up_sim.py", "--port", "0", "--workers", "2", "--requests", "6"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "status 200" in run.stdout
    assert "statuses {200: 6}" in run.stdout
    workers = re.findall(r"model=sim-llama-3.1-8b healthy=(\w+)", run.stdout)
    assert workers == ["True", "True"]
    log = (REPO / ".run" / "sim" / "gateway.log").read_text()
    assert log.count("gateway_ready") >= 2  # two gateway processes served

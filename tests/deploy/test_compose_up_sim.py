"""``make up-sim`` (scripts/up_sim.py): compose.yaml's sim topology as local processes really serves here:
Redis, 2 gateway processes on one port, simulated workers (and Prometheus, installed by ``make setup``), a
streamed chat and plain chats all answered 200, every worker registered and healthy, everything stopped after
(about 8 s); its Prometheus loads and evaluates the rules compose's does (about 20 s)."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import redis
import yaml

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


def rule_groups() -> set[str]:
    """The group names of the rule files compose's Prometheus loads (deploy/compose/prometheus.yml)."""
    compose = yaml.safe_load((REPO / "deploy" / "compose" / "prometheus.yml").read_text())
    rules = REPO / "deploy" / "prometheus"
    return {
        group["name"]
        for name in compose["rule_files"]
        for group in yaml.safe_load((rules / name).read_text())["groups"]
    }


def runbook_variables(out: list[str]) -> dict[str, str]:
    """The ``export NAME=value`` lines a kept stack prints for docs/runbook.md, as a map."""
    found = (re.fullmatch(r"\s*export (\w+)=(\S+).*\n?", line) for line in out)
    return {m.group(1): m.group(2) for m in found if m}


def ready(prom: str) -> bool:
    """Prometheus at ``prom`` answers ``/-/ready`` with 200."""
    try:
        return httpx.get(f"{prom}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_up_sim_prometheus_loads_the_rules_compose_loads() -> None:
    """Its Prometheus loaded no rule files: the runbook's recording-rule queries answered nothing there and
    no alert could fire. It lists every group of deploy/prometheus/rules now, evaluates them, and a
    recording rule the runbook queries has the workers' series. The lines it prints for the runbook's
    variables (random ports) reach the stack. About 20-40 s."""
    # this checkout's loadgen, not an installed one (a script's sys.path starts at scripts/)
    env = os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "scripts/up_sim.py", "--keep", "--port", "0", "--workers", "2", "--requests", "2"]
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()], daemon=True)
    reader.start()
    out: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while not any("Ctrl-C stops it" in line for line in out):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(out)
            with contextlib.suppress(queue.Empty):
                out.append(lines.get(timeout=1))
        (prom,) = re.findall(r"Prometheus (http://127\.0\.0\.1:\d+)", "".join(out))
        exported = runbook_variables(out)
        deadline = time.monotonic() + 60
        while not ready(prom):
            assert time.monotonic() < deadline, "Prometheus not ready in 60 s"
            time.sleep(0.5)
        # the rule files are loaded with the configuration, before Prometheus is ready
        groups = httpx.get(f"{prom}/api/v1/rules", timeout=5).json()["data"]["groups"]
        assert {group["name"] for group in groups} == rule_groups()
        # every rule evaluated once (the SLO ratios' group every 30 s, its first turn at an offset within
        # it), and the workers' health recorded
        deadline = time.monotonic() + 120
        while True:
            groups = httpx.get(f"{prom}/api/v1/rules", timeout=5).json()["data"]["groups"]
            rules = [rule for group in groups for rule in group["rules"]]
            healthy = httpx.get(
                f"{prom}/api/v1/query", params={"query": "worker:radixgate_worker_healthy:min"}, timeout=5
            ).json()["data"]["result"]
            if all(rule["health"] != "unknown" for rule in rules) and len(healthy) == 2:
                break
            assert time.monotonic() < deadline, (groups, healthy)
            time.sleep(1)
        # the lines it prints for docs/runbook.md reach this stack: the runbook's commands work as written
        assert sorted(exported) == ["GW", "PROM", "RADIXGATE_ADMIN_TOKEN", "RADIXGATE_REDIS__URL", "WORKER"]
        assert exported["PROM"] == prom
        admin = {"Authorization": f"Bearer {exported['RADIXGATE_ADMIN_TOKEN']}"}
        workers = httpx.get(f"{exported['GW']}/admin/workers", headers=admin, timeout=5).json()["data"]
        assert exported["WORKER"] in {w["url"] for w in workers}
        assert httpx.get(f"{exported['WORKER']}/health", timeout=5).status_code == 200
        with redis.Redis.from_url(exported["RADIXGATE_REDIS__URL"]) as store:
            assert store.ping()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert {rule["type"] for rule in rules} == {"recording", "alerting"}
    assert [rule for rule in rules if rule["health"] != "ok"] == []
    assert {sample["value"][1] for sample in healthy} == {"1"}  # both simulated workers healthy

"""The alert rules' unit tests (deploy/prometheus/tests/*.yml) under ``promtool test rules`` (issue 28): they
pass, every alert has a case where it fires and a case where it stays silent, and a broken rule makes them
fail."""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from tests.support.prometheus import PROM, RULE_TESTS, alerts, run_tool, tool


def cases() -> list[dict[str, Any]]:
    """Every ``alert_rule_test`` entry of the unit-test files."""
    return [
        case
        for path in RULE_TESTS
        for test in yaml.safe_load(path.read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    ]


def test_rule_unit_tests_pass() -> None:
    out = run_tool(tool("promtool"), "test", "rules", *RULE_TESTS, cwd=PROM / "tests")
    assert out.count("SUCCESS") == len(RULE_TESTS), out


def test_every_alert_fires_in_one_case_and_stays_silent_in_another() -> None:
    names = {rule["alert"] for rule in alerts()}
    firing = Counter(c["alertname"] for c in cases() if c.get("exp_alerts"))
    silent = Counter(c["alertname"] for c in cases() if not c.get("exp_alerts"))
    assert {n for n in names if not firing[n]} == set(), "alerts with no firing case"
    assert {n for n in names if not silent[n]} == set(), "alerts with no silent case"
    # no case names an alert that does not exist (promtool only finds no alert of that name: silent)
    assert set(firing) | set(silent) <= names
    # every test file loads the shipped rules, not copies
    shipped = ["../rules/recording.yml", "../rules/alerts.yml"]
    for path in RULE_TESTS:
        assert yaml.safe_load(path.read_text())["rule_files"] == shipped, path.name


def test_a_rule_that_fires_too_late_fails_its_unit_test(tmp_path: Path) -> None:
    """The unit tests can fail: with RadixgateWorkerUnhealthy's ``for`` raised from 1m to 10m the firing case
    at 5 min finds no alert."""
    shutil.copytree(PROM / "rules", tmp_path / "rules")
    shutil.copytree(PROM / "tests", tmp_path / "tests")
    alerts_file = tmp_path / "rules" / "alerts.yml"
    text = alerts_file.read_text()
    marker = "worker:radixgate_worker_healthy:max == 0\n        for: 1m"
    assert text.count(marker) == 1
    alerts_file.write_text(text.replace(marker, marker.replace("1m", "10m")))
    proc = subprocess.run(
        [tool("promtool"), "test", "rules", "workers.yml"],
        capture_output=True,
        text=True,
        cwd=tmp_path / "tests",
        timeout=60,
    )
    assert proc.returncode != 0
    assert "RadixgateWorkerUnhealthy" in proc.stdout + proc.stderr

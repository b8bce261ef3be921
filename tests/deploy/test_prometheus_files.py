"""deploy/prometheus/ as the real binaries read it (issue 28): ``promtool check config`` (which checks the
rule files it names too), ``promtool check rules`` and ``amtool check-config``. Debian's ``prometheus`` and
``prometheus-alertmanager`` packages give the tools; scripts/setup_gateway.sh installs them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.support.prometheus import PROM, RULE_FILES, alerts, run_tool, tool


def test_prometheus_config_is_valid() -> None:
    out = run_tool(tool("promtool"), "check", "config", PROM / "prometheus.yml")
    assert "is valid prometheus config file syntax" in out
    # it named and checked both rule files
    for rules in RULE_FILES:
        assert f"Checking {rules.relative_to(PROM)}" in out or f"Checking {rules}" in out, out


def test_scrape_config_discovers_gateways_and_workers_from_files() -> None:
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"radixgate", "sglang"}
    for job in jobs.values():
        (sd,) = job["file_sd_configs"]
        matched = [p for pattern in sd["files"] for p in PROM.glob(pattern)]
        assert matched, f"job {job['job_name']}: no target file matches {sd['files']}"
        for target_file in matched:
            groups = yaml.safe_load(target_file.read_text())
            assert all(group["targets"] for group in groups)
    assert {Path(f) for f in config["rule_files"]} == {p.relative_to(PROM) for p in RULE_FILES}


def test_rule_files_are_valid() -> None:
    out = run_tool(tool("promtool"), "check", "rules", *RULE_FILES)
    assert out.count("SUCCESS") == len(RULE_FILES), out


def test_rule_checker_catches_a_bad_expression(tmp_path: Path) -> None:
    """The check above can fail: a rule with a broken expression is refused."""
    bad = tmp_path / "bad.yml"
    bad.write_text("groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: rate(x[5m]) >\n")
    proc = subprocess.run([tool("promtool"), "check", "rules", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0


def test_every_alert_has_severity_summary_and_runbook() -> None:
    assert alerts()
    for rule in alerts():
        assert rule["labels"]["severity"] in {"page", "warning"}, rule["alert"]
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], rule["alert"]
        assert annotations["runbook_url"] == f"docs/runbook.md#{rule['alert'].lower()}"


def test_alertmanager_config_is_valid() -> None:
    out = run_tool(tool("amtool"), "check-config", PROM / "alertmanager.yml")
    assert "SUCCESS" in out
    config = yaml.safe_load((PROM / "alertmanager.yml").read_text())
    receivers = {r["name"]: r for r in config["receivers"]}
    assert config["route"]["receiver"] in receivers
    assert all(r["webhook_configs"] for r in receivers.values())

"""The fleet experiments' headlines on reduced-scale versions of the same scenarios (seconds each).

Full scale: ``python -m loadgen.fleet.experiments all --json`` (docs/experiments.md). These runs use fewer
workers, lower rates and shorter durations so that each experiment takes seconds; they assert the same
properties the issue asks of the full runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadgen.fleet import experiments_load
from loadgen.fleet.experiments import main as experiments_main
from loadgen.fleet.experiments import workers_figures
from loadgen.fleet.experiments_common import capacity
from loadgen.fleet.experiments_load import fairness_figures, overload_figures, routing_figures
from policies.estimates import EstimateConfig
from tests.support.signals import as_a_foreground_job


def test_workers_the_default_windows_cost_no_gpus() -> None:
    head, _ = workers_figures(rate=100, duration_s=15, bounds=(0, 6))
    assert head["default_workers"] is not None and head["best_fixed_workers"] is not None
    assert head["default_workers"] <= 1.05 * head["best_fixed_workers"]


def test_routing_cache_aware_levels_off_past_its_slo_rate() -> None:
    """2 workers, 40 prompts, 30 s: no collapse past the SLO rate (the first round fell to a third). The
    full-scale run meets 95% of peak; at this scale the peak is a single lucky run, so 90% is asserted."""
    heads = {h["policy"]: h for h in routing_figures(workers=2, hi=200.0, steps=4, scale=(30, 10, 40))}
    ca = heads["cache_aware"]
    assert ca["slo_rps"] is not None and ca["slo_rps"] > (heads["round_robin"]["slo_rps"] or 0.0)
    for m in ("1.5", "2.0", "3.0"):
        assert ca["served_rps_at"][m] >= 0.9 * ca["peak_served_rps"], m
        assert ca["hit_rate_at"][m] >= 0.9 * ca["hit_rate_at_slo"], m


def test_overload_protects_classes_in_order_and_keeps_goodput_at_capacity() -> None:
    cap = capacity(workers=1, lo=10.0, hi=100.0, steps=5, duration_s=30.0)
    head, _ = overload_figures(workers=1, duration_s=30.0, cap=cap)
    g = head["goodput"]
    assert g["interactive"] >= 0.99 and head["p99_ttft_ms"]["interactive"] < 500
    assert g["standard"] >= 0.9 * head["standard_bound"]
    assert head["good_rps"] >= 0.95 * head["capacity_rps"]
    assert g["batch"] <= g["standard"]


@pytest.mark.parametrize(
    ("workers", "estimates"),
    [(1, EstimateConfig(calibration_target=0.0)), (4, EstimateConfig(calibration_target=0.99))],
    ids=["uncalibrated", "calibrated-4-workers"],
)
def test_fairness_quiet_tenants_keep_their_goodput(workers: int, estimates: EstimateConfig) -> None:
    """Calibrated too (``scheduler.prediction_calibration_target`` 0.99), on 4 workers so that requests
    can spill: the calibration's margin sheds the noisy tenant's excess and moves none of it to another
    worker. When the calibrated prediction decided spills, the noisy tenant's excess spread over every
    worker, weighted fair queuing shared each worker with it, and the quiet tenants' lowest goodput here
    fell to 94.7% (and to 94.8% in the full-scale run)."""
    cap = capacity(workers=workers, lo=10.0, hi=100.0 * workers, steps=5, duration_s=30.0)
    head, _ = fairness_figures(workers=workers, duration_s=30.0, cap=cap, estimates=estimates)
    assert head["quiet_goodput_min"] >= 0.99 and head["jain_quiet"] >= 0.99


POOL_CHILD = """
import time
from loadgen.fleet.experiments_common import parallel
parallel(time.sleep, [(120,)] * 256)  # more runs than processes: some wait in the queue
"""


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment holds ``marker`` (the child and the pool processes it forked)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("to_group", [True, False], ids=["ctrl-c", "sigterm-to-the-parent"])
def test_an_interrupted_pool_stops_its_processes_at_once(to_group: bool) -> None:
    """Ctrl-C on ``experiments all`` waited for every queued run to finish (ProcessPoolExecutor's workers
    catch KeyboardInterrupt as a task's error, then its exit waits); SIGTERM left the pool's processes
    running as orphans."""
    marker = f"pool-{os.getpid()}-{to_group}"
    child = subprocess.Popen(
        [sys.executable, "-c", POOL_CHILD],
        env={**os.environ, "RADIXGATE_TEST_MARKER": marker},
        preexec_fn=as_a_foreground_job,
        start_new_session=True,  # its own group, signalled as a terminal signals its foreground job
    )
    try:
        deadline = time.monotonic() + 60
        while len(marked_pids(marker)) < 3:  # the child and its pool processes (2 or more)
            assert child.poll() is None and time.monotonic() < deadline, "the pool did not start"
            time.sleep(0.1)
        time.sleep(0.5)  # the pool processes run their sleep
        if to_group:
            os.killpg(child.pid, signal.SIGINT)
        else:
            os.kill(child.pid, signal.SIGTERM)
        child.wait(timeout=15)
        assert child.returncode != 0
        deadline = time.monotonic() + 5
        while marked_pids(marker):
            assert time.monotonic() < deadline, "pool processes outlived their parent"
            time.sleep(0.1)
    finally:
        for pid in marked_pids(marker):
            os.kill(pid, signal.SIGKILL)


def test_ctrl_c_during_an_experiment_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C during ``experiments fairness`` (run in this process) ended in a KeyboardInterrupt traceback."""

    def interrupted(doc: Path | None) -> dict[str, object]:
        raise KeyboardInterrupt

    monkeypatch.setattr(experiments_load, "exp_fairness", interrupted)
    assert experiments_main(["fairness"]) == 130
    assert "interrupted" in capsys.readouterr().err

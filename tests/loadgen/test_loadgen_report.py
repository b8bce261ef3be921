"""loadgen report math on synthetic records: percentiles, goodput rules, Jain index, rates, cache hit rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from loadgen.cli import app
from loadgen.report import build_report, group_figures, jain_index, meets_slo, percentile, print_report
from loadgen.runner import RequestRecord
from loadgen.scenario import ClassSLO, parse_scenario
from tests.support.paths import REPO

SLO = {"interactive": ClassSLO(ttft_ms=100, tpot_ms=10), "batch": ClassSLO(ttft_ms=1000, e2e_ms=5000)}


def rec(**kw: Any) -> RequestRecord:
    """A successful streamed standard request of 11 tokens: TTFT 50 ms, E2E 150 ms (TPOT 10 ms)."""
    base: dict[str, Any] = {
        "index": 0, "tenant": "a", "priority_class": "interactive", "session_id": "s", "turn": 0,
        "stream": True, "warmup": False, "max_tokens": 11, "scheduled_s": 1.0, "sent_s": 1.0, "status": 200,
        "ttft_ms": 50.0, "e2e_ms": 150.0, "itl_ms": [10.0] * 10, "prompt_tokens": 100,
        "completion_tokens": 11, "cached_tokens": 40,
    }  # fmt: skip
    base.update(kw)
    return RequestRecord(**base)


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    values = [float(x) for x in np.random.default_rng(1).lognormal(3, 1, 101)]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([7.0], q) == 7.0
    assert percentile([], q) is None


def test_jain_index() -> None:
    assert jain_index([5, 5, 5, 5]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)  # 1/n: one tenant gets everything
    assert jain_index([1, 2, 3]) == pytest.approx(36 / 42)
    assert jain_index([0, 0]) == 1.0 and jain_index([]) is None


def test_goodput_rules() -> None:
    assert meets_slo(rec(), SLO["interactive"])
    assert not meets_slo(rec(ttft_ms=101), SLO["interactive"])
    assert not meets_slo(rec(e2e_ms=250), SLO["interactive"])  # TPOT (250-50)/10 = 20 ms > 10
    assert not meets_slo(rec(status=503, ttft_ms=None), SLO["interactive"])
    assert not meets_slo(rec(error="stream ended without [DONE]"), SLO["interactive"])
    # non-streamed: budget ttft + tpot × (n-1) = 100 + 10 × 10 = 200 ms
    assert meets_slo(rec(stream=False, ttft_ms=None, itl_ms=[], e2e_ms=200), SLO["interactive"])
    assert not meets_slo(rec(stream=False, ttft_ms=None, itl_ms=[], e2e_ms=201), SLO["interactive"])
    # e2e objective: binding for both kinds
    batch = SLO["batch"]
    assert meets_slo(rec(priority_class="batch", stream=False, ttft_ms=None, e2e_ms=4999), batch)
    assert not meets_slo(rec(priority_class="batch", ttft_ms=900, e2e_ms=5001), batch)
    assert meets_slo(rec(), None)  # no SLO: success is enough


def test_tpot_from_usage_or_chunks() -> None:
    assert rec().tpot_ms == pytest.approx(10.0)
    assert rec(completion_tokens=None).tpot_ms == pytest.approx(10.0)  # 10 gaps → 11 chunks
    assert rec(completion_tokens=1).tpot_ms is None
    assert rec(stream=False, ttft_ms=None).tpot_ms is None


def test_group_figures_rates_throughput_and_cache() -> None:
    records = [
        *(rec(index=i) for i in range(6)),
        rec(index=6, status=429, ttft_ms=None, e2e_ms=1.0, retry_after_s=2.0, completion_tokens=None),
        rec(index=7, status=503, ttft_ms=None, e2e_ms=1.0, completion_tokens=None),
        rec(index=8, status=0, error="ConnectError", ttft_ms=None, completion_tokens=None),
        rec(index=9, ttft_ms=500.0),  # served, misses its TTFT objective
    ]
    g = group_figures(records, SLO, window_s=2.0)
    assert (g["sent"], g["ok"], g["status_429"], g["status_503"], g["errors"]) == (10, 7, 1, 1, 1)
    assert g["shed_rate"] == 0.1 and g["rate_limited_rate"] == 0.1 and g["error_rate"] == 0.1
    assert g["goodput"] == pytest.approx(0.6) and g["goodput_rps"] == pytest.approx(3.0)
    assert g["throughput_rps"] == pytest.approx(3.5)
    assert g["completion_tokens_per_s"] == pytest.approx(7 * 11 / 2)
    assert g["cache_hit_rate"] == pytest.approx(0.4)
    assert g["ttft_ms"]["n"] == 7 and g["ttft_ms"]["p50"] == 50.0 and g["ttft_ms"]["p99"] > 400
    assert g["itl_ms"]["n"] == 70 and g["itl_ms"]["p99"] == 10.0
    assert group_figures([rec(cached_tokens=None)], SLO, 1.0)["cache_hit_rate"] is None


def scenario() -> Any:
    return parse_scenario(
        {
            "duration_s": 10,
            "warmup_s": 2,
            "tenants": [
                {"id": "a", "priority_class": "interactive"},
                {"id": "b", "priority_class": "interactive"},
                {"id": "c", "priority_class": "interactive", "weight": 2},
                {"id": "z", "priority_class": "batch"},
            ],
            "slo": {k: v.model_dump() for k, v in SLO.items()},
        }
    )


def test_build_report_excludes_warmup_and_computes_fairness() -> None:
    records = [
        rec(index=0, tenant="a", sent_s=0.5, warmup=True, ttft_ms=9999.0),
        *(rec(index=i, tenant="a", sent_s=2.0 + i / 10) for i in range(1, 7)),
        *(rec(index=i, tenant="b", sent_s=2.0 + i / 10) for i in range(7, 10)),
        rec(index=10, tenant="c", sent_s=3.0),
        rec(index=11, tenant="z", priority_class="batch", sent_s=9.0, e2e_ms=1000.0),
    ]
    run = {"base_url": "http://x", "wall_s": 10.0, "cpu_s": 0.5, "send_lag_ms": [0.1, 0.2, 5.0]}
    report = build_report(scenario(), records, run, bin_s=1.0)
    assert report["planned"] == 12 and report["measured"] == 11
    assert report["window_s"] == pytest.approx(8.0)  # warm-up end (2 s) to the last end (9 + 1 s)
    assert report["overall"]["ttft_ms"]["p99"] == 50.0  # the warm-up outlier is not counted
    assert set(report["classes"]) == {"interactive", "batch"}
    assert report["tenants"]["a"]["offered_share"] == pytest.approx(6 / 11)
    assert report["tenants"]["z"]["priority_class"] == "batch"
    (fair,) = report["fairness"]  # a and b (weight 1); c has weight 2, z is alone in its class
    assert fair["tenants"] == ["a", "b"] and fair["jain_throughput"] == pytest.approx(81 / (2 * 45))
    assert fair["jain_demand"] == pytest.approx(1.0)
    lg = report["loadgen"]
    assert lg["cpu_cores"] == pytest.approx(0.05) and lg["send_lag_ms"]["max"] == 5.0
    tl = report["timeline"]
    assert tl["t_s"][:3] == [0.0, 1.0, 2.0] and sum(tl["sent_rps"]) == 12
    assert tl["ttft_p50_ms_by_class"]["batch"][9] == 50.0
    console = Console(record=True, width=200)
    print_report(report, console)
    text = console.export_text()
    assert "requests (measured)" in text and "Jain fairness, interactive" in text and "0.05" in text


def test_peers_none_of_whom_was_served_print_as_undefined() -> None:
    """nu17: two standard tenants served 0 of 224 requests printed "served/demanded 1.000"."""
    records = [
        *(rec(index=i, tenant="a", sent_s=3.0, status=503, completion_tokens=None) for i in range(3)),
        *(rec(index=i, tenant="b", sent_s=3.0, status=503, completion_tokens=None) for i in range(3, 6)),
    ]
    run = {"base_url": "http://x", "wall_s": 10.0, "cpu_s": 0.5, "send_lag_ms": [0.1]}
    report = build_report(scenario(), records, run, bin_s=1.0)
    (fair,) = report["fairness"]
    assert fair["tenants"] == ["a", "b"] and not fair["served_any"]
    console = Console(record=True, width=200)
    print_report(report, console)
    text = console.export_text()
    assert "(a, b): none of them was served (undefined)" in text and "served/demanded 1" not in text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "cannot read"),
        ("{not json", "cannot read"),
        ("[]", "not a results file"),
        ('{"scenario": {}}', "not a results file"),
        ('{"scenario": {}, "run": {}, "records": [{"bogus": 1}]}', "not a results file"),
        ('{"scenario": {"duration_s": "x"}, "run": {}, "records": []}', "invalid scenario"),
    ],
    ids=["missing", "not json", "a list", "no run", "bad record", "bad scenario"],
)
def test_report_on_a_file_that_is_not_results_exits_2_with_the_reason(
    tmp_path: Path, text: str | None, message: str
) -> None:
    """``loadgen report`` of a wrong file was a traceback (KeyError, TypeError) instead of a clear line."""
    path = tmp_path / "results.json"
    if text is not None:
        path.write_text(text)
    result = CliRunner().invoke(app, ["report", str(path), "--no-plots"])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


@pytest.mark.parametrize("text", [None, "{oops", '["k"]', '{"smoke-a": 5}'])
def test_run_with_a_bad_keys_file_exits_2_before_sending(tmp_path: Path, text: str | None) -> None:
    keys = tmp_path / "keys.json"
    if text is not None:
        keys.write_text(text)
    scenario = REPO / "loadgen" / "scenarios" / "smoke.toml"
    result = CliRunner().invoke(
        app, ["run", str(scenario), "--keys", str(keys), "--base-url", "http://127.0.0.1:9"]
    )
    assert result.exit_code == 2, result.output
    assert "keys file" in " ".join(result.output.split())


def test_ctrl_c_during_a_run_says_what_was_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C mid-run exited without a word (130), leaving an empty --out folder unexplained."""
    import loadgen.cli as loadgen_cli

    async def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(loadgen_cli, "run_plan", interrupted)
    scenario = REPO / "loadgen" / "scenarios" / "smoke.toml"
    result = CliRunner().invoke(
        app,
        ["run", str(scenario), "--api-key", "k", "--base-url", "http://127.0.0.1:9", "--out", str(tmp_path)],
    )
    assert result.exit_code == 130, result.output
    said = " ".join(result.output.split())
    assert "interrupted after 0 of" in said and "no results written" in said, result.output
    assert not (tmp_path / "results.json").exists()

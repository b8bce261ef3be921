"""The gateway benchmark's arithmetic on fixed inputs: /proc parsing and process trees, Redis command
deltas, medians and added latency, CPU per chunk, goals, wrk's summary and script, py-spy stacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from loadgen.bench.command import _split
from loadgen.bench.measure import (
    Sample,
    aggregate,
    calls_delta,
    cores_busy_s,
    goals,
    idle_cpu_ms_per_s,
    parse_cpu_busy,
    parse_proc_stat,
    read_proc_stats,
    redis_calls,
    tree_cpu_s,
)
from loadgen.bench.profile import library_of, parse_collapsed, summarize
from loadgen.bench.report import JSON_KEYS, json_lines
from loadgen.bench.runner import MODES
from loadgen.bench.targets import plan_cores
from loadgen.bench.wrk import MARKER, WrkError, lua_script, parse_wrk_output


def stat_line(
    pid: int, comm: str, ppid: int, utime: int, stime: int, cutime: int = 0, cstime: int = 0
) -> str:
    # fields 3..: state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime ...
    rest = f"S {ppid} {pid} {pid} 0 -1 4194304 100 0 0 0 {utime} {stime} {cutime} {cstime} 20 0 4 0 77"
    return f"{pid} ({comm}) {rest}\n"


def test_parse_proc_stat_reads_fields_after_the_last_parenthesis() -> None:
    st = parse_proc_stat(stat_line(42, "python -m (x) y", 7, 150, 50, 20, 5))
    assert (st.pid, st.ppid, st.utime, st.stime, st.cutime, st.cstime) == (42, 7, 150, 50, 20, 5)
    assert st.ticks == 225
    with pytest.raises(ValueError):
        parse_proc_stat("garbage")


def write_proc(root: Path, lines: dict[int, str]) -> Path:
    for pid, line in lines.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "stat").write_text(line)
    (root / "self").mkdir()  # not a pid: ignored
    return root


def test_tree_cpu_sums_a_process_and_its_descendants_only(tmp_path: Path) -> None:
    proc = write_proc(
        tmp_path,
        {
            10: stat_line(10, "gateway", 1, 300, 100, cutime=50),  # 50 ticks of reaped children
            11: stat_line(11, "worker", 10, 200, 0),
            12: stat_line(12, "grandchild", 11, 40, 10),
            20: stat_line(20, "other", 1, 9999, 9999),
        },
    )
    stats = read_proc_stats(proc)
    assert set(stats) == {10, 11, 12, 20}
    assert tree_cpu_s(stats, [10], hz=100) == pytest.approx((400 + 50 + 200 + 50) / 100)
    assert tree_cpu_s(stats, [11], hz=100) == pytest.approx(2.5)
    assert tree_cpu_s(stats, [999], hz=100) == 0.0  # a gone process counts nothing


def test_cpu_busy_per_core_leaves_out_idle_and_iowait() -> None:
    text = (
        "cpu  1000 0 500 9000 100 0 0 0 0 0\n"
        "cpu0 600 0 300 4000 50 10 5 0 0 0\n"
        "cpu1 400 0 200 5000 50 0 0 0 0 0\n"
        "intr 12345\n"
    )
    busy = parse_cpu_busy(text)
    assert busy == {0: 915, 1: 600}
    assert cores_busy_s(busy, [1], hz=100) == 6.0
    assert cores_busy_s(busy, None) is None


def test_redis_command_deltas_leave_out_info_and_idle_commands() -> None:
    before = redis_calls({"cmdstat_get": {"calls": 10}, "cmdstat_info": {"calls": 3}, "redis_version": "7"})
    after = redis_calls(
        {
            "cmdstat_get": {"calls": 30},
            "cmdstat_evalsha": {"calls": 20},
            "cmdstat_info": {"calls": 5},
            "cmdstat_ping": {"calls": 0},
        }
    )
    assert calls_delta(before, after) == {"evalsha": 20, "get": 20}


def sample(target: str, mode: str, repeat: int, **kw: float) -> Sample:
    base: dict[str, object] = {
        "requests": 1000,
        "duration_s": 10.0,
        "errors": 0,
        "p50_ms": 1.0,
        "p99_ms": 2.0,
        "target_cpu_s": 1.0,
    }
    base.update(kw)
    return Sample(target=target, mode=mode, repeat=repeat, **base)  # type: ignore[arg-type]


def test_aggregate_takes_medians_and_pairs_added_latency_with_the_same_repeat() -> None:
    samples = [
        sample("direct", "c1", 0, p50_ms=0.10, p99_ms=0.50),
        sample("direct", "c1", 1, p50_ms=0.30, p99_ms=0.70),
        sample("direct", "c1", 2, p50_ms=0.20, p99_ms=0.60),
        # radixgate: 500 requests in 10 s using 3.5 s CPU -> 7 ms/request
        sample("radixgate", "c1", 0, requests=500, p50_ms=8.10, p99_ms=15.5, target_cpu_s=3.5),
        sample("radixgate", "c1", 1, requests=400, p50_ms=9.30, p99_ms=20.7, target_cpu_s=4.0),
        sample("radixgate", "c1", 2, requests=600, p50_ms=7.20, p99_ms=14.6, target_cpu_s=3.0),
    ]
    samples[3].redis_commands = {"get": 1000, "evalsha": 1000}
    samples[4].redis_commands = {"get": 800, "evalsha": 800}
    samples[5].redis_commands = {"get": 1200, "evalsha": 1200}
    samples[3].upstream_requests = {"/generate": 500, "/metrics": 10}
    results = {(r["target"], r["mode"]): r for r in aggregate(samples, chunks=32)}
    rg = results[("radixgate", "c1")]
    assert rg["rps"] == pytest.approx(50.0)
    assert rg["cpu_ms_per_request"] == pytest.approx(7.0)  # median of 7, 10, 5
    assert rg["cpu_ms_per_request_range"] == pytest.approx([5.0, 10.0])
    # paired differences 8.0, 9.0, 7.0 -> median 8.0; P99: 15.0, 20.0, 14.0 -> 15.0
    assert rg["added_p50_ms"] == pytest.approx(8.0)
    assert rg["added_p99_ms"] == pytest.approx(15.0)
    assert rg["redis_commands_per_request"] == pytest.approx(4.0)
    assert rg["redis_commands"] == {"evalsha": 2.0, "get": 2.0}
    assert rg["repeats"] == 3 and rg["requests"] == 1500
    direct = results[("direct", "c1")]
    assert direct["added_p50_ms"] == 0.0 and direct["added_p99_ms"] == 0.0


def test_cpu_per_chunk_is_the_stream_surplus_over_non_streamed_requests() -> None:
    samples = [
        sample("radixgate", "c64", 0, requests=1000, target_cpu_s=8.0),  # 8 ms/request
        sample("radixgate", "stream", 0, requests=1000, target_cpu_s=12.16),  # 12.16 ms/request
        sample("router", "c64", 0, requests=1000, target_cpu_s=0.3),
        sample("litellm", "c64", 0, requests=310, duration_s=10.0, target_cpu_s=9.6),
    ]
    results = aggregate(samples, chunks=32)
    stream = next(r for r in results if r["mode"] == "stream")
    assert stream["cpu_ms_per_chunk"] == pytest.approx(4.16 / 32)
    assert all(r["cpu_ms_per_chunk"] is None for r in results if r["mode"] != "stream")
    by_goal = {g["goal"]: g for g in goals(results)}
    assert by_goal["cpu_vs_router"]["value"] == pytest.approx(8.0 / 0.3)
    assert by_goal["cpu_vs_router"]["met"] is False
    assert by_goal["rps_vs_litellm"]["value"] == pytest.approx(100.0 / 31.0)
    assert by_goal["ms_per_chunk"]["met"] is False
    assert by_goal["added_p50_c1"]["value"] is None and by_goal["added_p50_c1"]["met"] is None


def test_sample_contention_and_idle_rates() -> None:
    s = sample("radixgate", "c64", 0, target_cpu_s=6.0, target_core_busy_s=9.0)
    assert s.target_cores_used == pytest.approx(0.6)
    assert s.others_on_target_core == pytest.approx(0.3)
    assert sample("router", "c64", 0).others_on_target_core is None
    assert idle_cpu_ms_per_s(1.00, 1.10, 10.0) == pytest.approx(10.0)
    assert idle_cpu_ms_per_s(1.0, 1.0, 0.0) is None


def test_json_lines_have_the_issue_keys_first() -> None:
    samples = [sample("direct", "c8", 0), sample("radixgate", "c8", 0, target_cpu_s=5.0, p50_ms=3.0)]
    lines = json_lines(aggregate(samples, chunks=32))
    rows = [json.loads(line) for line in lines]
    assert [list(r)[:6] for r in rows] == [
        ["target", "mode", "rps", "cpu_ms_per_request", "added_p50_ms", "added_p99_ms"]
    ] * 2
    assert set(rows[1]) == set(JSON_KEYS)
    assert rows[1]["cpu_ms_per_request"] == 5.0 and rows[1]["added_p50_ms"] == 2.0


@pytest.mark.parametrize(
    ("cpus", "target", "load", "aux"),
    [
        ([0], None, None, None),
        ([0, 1], {1}, {0}, {0}),
        ([2, 3, 5, 7], {7}, {2}, {3}),
    ],
)
def test_core_plan(
    cpus: list[int], target: set[int] | None, load: set[int] | None, aux: set[int] | None
) -> None:
    plan = plan_cores(cpus)
    assert (plan.target, plan.load, plan.aux) == (target, load, aux)


def test_wrk_summary_and_script() -> None:
    line = MARKER + json.dumps(
        {
            "requests": 1200,
            "duration_us": 3_000_000,
            "bytes": 1,
            "errors": {"connect": 0, "read": 1, "write": 0, "status": 2, "timeout": 0},
            "latency_us": {
                "min": 100,
                "max": 9000,
                "mean": 500.5,
                "p50": 400,
                "p90": 800,
                "p99": 2500,
                "p999": 8000,
            },
        }
    )
    result = parse_wrk_output("Running 3s test\n" + line + "\nRequests/sec: 400\n")
    assert result.requests == 1200 and result.duration_s == 3.0 and result.error_count == 3
    assert result.latency_ms["p50"] == 0.4 and result.latency_ms["p99"] == 2.5
    with pytest.raises(WrkError):
        parse_wrk_output("Running 3s test\n")
    script = lua_script('{"a":"b\\"]]"}', {"Authorization": "Bearer k"})
    assert 'wrk.body = "{\\"a\\":\\"b\\\\\\"]]\\"}"' in script
    assert 'wrk.headers["Authorization"] = "Bearer k"' in script
    assert "done = function" in script


def test_profile_summary_of_collapsed_stacks() -> None:
    text = (
        'process 7:"python -m service serve";<module> (service/__main__.py:80);'
        "Dispatcher.complete (service/pipeline/dispatch.py:120);AsyncClient.post (httpx/_client.py:1)"
        ";AsyncConnectionPool.handle (httpcore/_async/connection_pool.py:9) 6\n"
        "<module> (service/__main__.py:80);Dispatcher.complete (service/pipeline/dispatch.py:120);"
        "Dispatcher._settle (service/pipeline/dispatch.py:200);"
        "Redis.execute_command (redis/asyncio/client.py:5) 3\n"
        "<module> (service/__main__.py:80);run (asyncio/runners.py:1) 1\n"
        "junk line\n"
    )
    stacks = parse_collapsed(text)
    assert len(stacks) == 3 and stacks[0][0][0] == ("<module>", "service/__main__.py")
    summary = summarize(stacks)
    assert summary["samples"] == 10
    self_lib = {r["name"]: r["share"] for r in summary["self_by_library"]}
    assert self_lib == {"httpx/httpcore": 0.6, "redis-py": 0.3, "asyncio/uvloop": 0.1}
    incl = {r["name"]: r["share"] for r in summary["inclusive_by_library"]}
    assert incl["radixgate"] == 0.9  # the entry point <module> does not count
    stages = {r["name"]: r["share"] for r in summary["inclusive_by_stage"]}
    assert stages == {"settle (Dispatcher._settle)": 0.3}
    own = {r["name"]: r["share"] for r in summary["inclusive_own"]}
    assert own == {
        "Dispatcher.complete (service/pipeline/dispatch.py)": 0.9,
        "Dispatcher._settle (service/pipeline/dispatch.py)": 0.3,
    }
    assert library_of("threading.py") == "threading (thread-pool hops)"
    assert library_of("/usr/lib/python3.11/json/decoder.py") == "json"
    assert summarize([]) == {"samples": 0}


@pytest.mark.parametrize(
    ("value", "expected"),
    [("c64,c64", ["c64"]), (" c1 , stream,c1", ["c1", "stream"]), ("", None), ("c2", None), (",", None)],
)
def test_bench_lists_are_checked_and_each_name_runs_once(value: str, expected: list[str] | None) -> None:
    if expected is None:
        with pytest.raises(typer.BadParameter, match="--modes: choose from"):
            _split(value, tuple(MODES), "--modes")
    else:
        assert _split(value, tuple(MODES), "--modes") == expected


def test_ctrl_c_during_the_bench_says_it_stopped_everything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ctrl-C mid-run stopped every process but exited without a word (130 from a bare KeyboardInterrupt)."""
    from typer.testing import CliRunner

    from loadgen.bench import command
    from loadgen.cli import app

    def interrupted(*args: object) -> dict[str, object]:
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "wrk_binary", lambda: "/usr/bin/wrk")
    monkeypatch.setattr(command, "check_targets", lambda names, peers_dir: [])
    monkeypatch.setattr(command, "run_bench", interrupted)
    result = CliRunner().invoke(
        app, ["bench-gateway", "--quick", "--targets", "direct", "--out", str(tmp_path)]
    )
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.output and "Traceback" not in result.output, result.output


def test_a_baseline_env_adds_a_second_radixgate_after_the_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--baseline-env`` measures a radixgate with other settings interleaved with the rest (before/after
    figures of a change in one run); it needs nothing installed beyond radixgate."""
    from typer.testing import CliRunner

    from loadgen.bench import command
    from loadgen.bench.runner import BenchConfig, check_targets
    from loadgen.cli import app

    seen: list[BenchConfig] = []

    def record(cfg: BenchConfig, say: object) -> dict[str, object]:
        seen.append(cfg)
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "wrk_binary", lambda: "/usr/bin/wrk")
    monkeypatch.setattr(command, "run_bench", record)
    args = ["bench-gateway", "--quick", "--targets", "radixgate,direct", "--out", str(tmp_path)]
    CliRunner().invoke(app, [*args, "--baseline-env", "RADIXGATE_REDIS__QUOTA_LEASE_S=0"])
    assert seen[0].targets == ["radixgate", "radixgate-base", "direct"]
    assert seen[0].baseline_env == {"RADIXGATE_REDIS__QUOTA_LEASE_S": "0"}
    CliRunner().invoke(app, args)
    assert seen[1].targets == ["radixgate", "direct"] and seen[1].baseline_env is None
    assert check_targets(["radixgate-base"], tmp_path) == []


def test_a_bad_baseline_env_is_named_with_its_own_option_and_log(tmp_path: Path) -> None:
    """nu14: ``--baseline-env FOO=1`` was refused as "--radixgate-env wants ...", and a baseline gateway
    that exited on a bad value was reported as "radixgate exited with 2:" with the other gateway's log."""
    from loadgen.bench.command import _env_pairs
    from loadgen.bench.targets import BenchSetupError, Processes, start_radixgate

    with pytest.raises(typer.BadParameter, match="--baseline-env wants"):
        _env_pairs(["FOO=1"], "--baseline-env")
    procs = Processes(tmp_path)
    (tmp_path / "radixgate.log").write_text("the other gateway's log")
    bad = {"RADIXGATE_REDIS__QUOTA_LEASE_S": "abc"}
    try:
        with pytest.raises(BenchSetupError, match="radixgate-base exited") as err:
            start_radixgate(
                procs,
                "http://127.0.0.1:9",
                "redis://127.0.0.1:9/0",
                tmp_path,
                bad,
                None,
                30,
                "radixgate-base",
            )
    finally:
        procs.stop()
    assert "RADIXGATE_REDIS__QUOTA_LEASE_S" in str(err.value) and "other gateway" not in str(err.value)

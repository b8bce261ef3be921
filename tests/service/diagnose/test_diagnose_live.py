"""``python -m service diagnose`` against a live gateway in front of three simulated workers (issue 28): each
cause injected in turn (the simulated workers' knobs, their faults, a delay in front of Redis, more
clients) is the one it names first, every time; a window with no fault names none. The command's own
entry point runs once end to end (``--json``, the workers listed on ``/admin/workers``), and the
Prometheus mode, on a real Prometheus that scraped the same run, names the same causes.

One stack for the module (:mod:`tests.support.diagnose_stack`) watched by one Prometheus
(:class:`tests.support.prometheus_live.LivePrometheus`, every 0.5 s), warmed up first: that warm-up is the
baseline each window is judged against. Windows of 2 s, scraped every 0.25 s."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from loadgen.sim.server import FaultSpec
from policies.diagnosis_types import Cause, Diagnosis, Verdict
from service.__main__ import cli
from service.diagnose.command import Result, from_prometheus, from_scrapes
from service.diagnose.sources import host_port
from tests.conftest import ADMIN_TOKEN
from tests.support.diagnose_stack import CLIENTS, DiagnoseStack
from tests.support.paths import REPO
from tests.support.prometheus_live import LivePrometheus, Webhook

WINDOW_S = 2.0
INTERVAL_S = 0.25


@dataclass(frozen=True)
class Case:
    """One injected cause and the cause diagnose must name first (None: no cause).

    Attributes:
        knobs: the simulated workers' knobs (:class:`loadgen.sim.knobs.PerfKnobs`), on ``worker`` only
            when it is set, else on every worker. fault: a :class:`loadgen.sim.server.FaultSpec` for
            ``worker``. redis_delay_s: added to each Redis answer. clients, max_tokens, question_tokens,
            system: the load (:func:`tests.support.diagnose_stack.body`).
    """

    name: str
    expect: Cause | None
    knobs: dict[str, Any] = field(default_factory=dict)
    worker: int | None = None
    fault: FaultSpec | None = None
    redis_delay_s: float = 0.0
    clients: int = CLIENTS
    max_tokens: int = 16
    question_tokens: int = 200
    system: bool = True


CASES = [
    Case("no fault", None),
    Case("300 ms more on the network to every worker", "network", {"network_delay_s": 0.3}),
    # short prompts: 30 clients of long ones would spend this process's CPU (and slow the Redis proxy)
    Case("five times the clients", "queueing", clients=5 * CLIENTS, question_tokens=20, system=False),
    Case("prefill 10x slower", "prefill", {"prefill_factor": 10}),
    Case("a hot-spot of uncached prompts", "prefill", {"uncached_share": 1.0}),
    Case("decode 4x slower", "decode", {"decode_factor": 4}),
    Case("256 more sequences in every batch", "decode", {"extra_batch": 256, "extra_context_tokens": 2000}),
    Case(
        "a KV pool of 1,900 tokens",
        "retraction",
        {"kv_capacity_tokens": 1900, "new_token_ratio": 0.05},
        clients=9,
        max_tokens=64,
        question_tokens=20,
    ),
    Case("one worker 6x slower", "worker", {"prefill_factor": 6, "decode_factor": 6}, worker=0),
    Case("Redis 100 ms slower", "quota_store", redis_delay_s=0.1),
    Case("one worker failing", "worker", worker=0, fault=FaultSpec(mode="http_500")),
]


@dataclass
class Live:
    """The module's stack, its Prometheus, when the warm-up began and each case's window (Unix s)."""

    ds: DiagnoseStack
    prom: LivePrometheus
    since: float
    windows: dict[str, tuple[float, float]] = field(default_factory=dict)
    verdicts: dict[str, Verdict | None] = field(default_factory=dict)


@pytest.fixture(scope="module")
def live(redis_url: str, stub_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """The stack and its Prometheus, after 4 s of the normal load (the baseline)."""
    with (
        DiagnoseStack(redis_url, stub_model_dir) as ds,
        Webhook() as hook,
        LivePrometheus(tmp_path_factory.mktemp("prom"), ds.stack.url, ds.worker_urls, hook.url) as prom,
    ):
        since = time.time()
        ds.window(4.0)
        yield Live(ds, prom, since)


@pytest.fixture
def stack(live: Live) -> DiagnoseStack:
    return live.ds


def diagnosed(ds: DiagnoseStack, case: Case, windows: dict[str, tuple[float, float]] | None = None) -> Result:
    """Inject ``case``, diagnose a window under its load (noted in ``windows``), take the fault away."""

    async def window() -> Result:
        start = time.time()
        result = await from_scrapes(ds.stack.url, ds.worker_urls, WINDOW_S, INTERVAL_S)
        if windows is not None:
            windows[case.name] = (start, time.time())
        return result

    ds.knobs(case.worker, **case.knobs)
    if case.fault is not None:
        ds.stack.sims[case.worker or 0].set_fault(case.fault)
    ds.redis.latency_s = case.redis_delay_s
    try:
        return ds.run(
            window,
            case.clients,
            case.max_tokens,
            case.question_tokens,
            system=case.system,
        )
    finally:
        ds.knobs()
        for sim in ds.stack.sims:
            sim.set_fault(FaultSpec())
        ds.redis.latency_s = 0.0
        if case.fault is not None:
            ds.wait_healthy()


def line(v: Verdict) -> str:
    """A verdict as the report's first line."""
    return f"{v.cause} score {v.score:.2f} adds {v.explained_s * 1000:.0f} ms of {v.of}: {v.summary}"


def evidence(d: Diagnosis, cause: Cause, what: str) -> float | None:
    """The value of the evidence ``what`` of the first verdict of ``cause``."""
    verdict = next(v for v in d.verdicts if v.cause == cause)
    return next(e.value for e in verdict.evidence if e.what == what)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_diagnose_names_the_injected_cause_first(live: Live, case: Case) -> None:
    stack = live.ds
    d = diagnosed(stack, case, live.windows).diagnosis
    live.verdicts[case.name] = d.verdicts[0] if d.verdicts else None
    print(f"\n[{case.name}] " + (line(d.verdicts[0]) if d.verdicts else "no cause"))
    assert d.served > 0 and not d.notes, d
    if case.expect is None:
        assert d.verdicts == (), [line(v) for v in d.verdicts]
        return
    assert d.verdicts, f"no cause named; judged: {[line(v) for v in d.rejected]}"
    first = d.verdicts[0]
    assert first.cause == case.expect, [line(v) for v in d.verdicts]
    assert first.consequence_of is None and first.score >= 0.15
    if case.worker is not None:
        assert first.worker == host_port(stack.worker_urls[case.worker])
    if case.expect == "retraction":  # the pool was full and the engines did retract
        assert (evidence(d, "retraction", "KV usage, max") or 0) >= 0.95
        assert (evidence(d, "retraction", "retracted requests") or 0) > 0
    if case.name.startswith("a hot-spot"):  # told apart from a slower prefill by the hit rate
        assert "hit rate fell" in first.summary
    if case.name.startswith("prefill"):
        assert "hit rate fell" not in first.summary


def test_the_command_line_names_the_cause_in_json(stack: DiagnoseStack) -> None:
    """``python -m service diagnose --gateway URL --admin-token T --json`` (workers from /admin/workers),
    run as a process under a network fault."""
    command = [
        sys.executable, "-m", "service", "diagnose", "--gateway", stack.stack.url,
        "--admin-token", ADMIN_TOKEN, "--window-s", "2", "--interval-s", "0.25", "--json",
    ]  # fmt: skip
    stack.knobs(network_delay_s=0.3)
    try:
        proc = stack.run(
            lambda: asyncio.to_thread(
                subprocess.run, command, capture_output=True, text=True, cwd=REPO, timeout=60
            ),
            warm_s=0.0,
        )
    finally:
        stack.knobs()
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["causes"][0]["cause"] == "network" and out["causes"][0]["rank"] == 1
    assert out["window"]["served"] > 0 and out["window"]["ttft_p99_s"] > 0.3
    shown = {e["what"] for e in out["causes"][0]["evidence"]}
    assert shown >= {"gateway TTFT, mean", "upstream_connect, P99"}
    assert "3 workers" in out["source"]


def test_bad_options_exit_2_and_a_source_that_does_not_answer_1() -> None:
    runner = CliRunner()

    def run(*args: str) -> Any:
        return runner.invoke(cli, ["diagnose", *args])

    neither = run()
    assert neither.exit_code == 2 and "either --prometheus URL or --gateway URL" in neither.output
    window = run("--prometheus", "http://127.0.0.1:1", "--window", "5 minutes")
    assert window.exit_code == 2 and "not a duration" in window.output
    scheme = run("--gateway", "ftp://127.0.0.1:1", "--worker", "http://127.0.0.1:1")
    assert scheme.exit_code == 2 and "not an http(s) URL" in scheme.output
    down = run("--gateway", "http://127.0.0.1:1", "--worker", "http://127.0.0.1:1", "--window-s", "1")
    assert down.exit_code == 1 and "cannot read the metrics" in down.output


AGAIN = ["no fault", "300 ms more on the network to every worker", "decode 4x slower", "one worker 6x slower"]


@pytest.mark.parametrize("name", AGAIN)
def test_the_prometheus_mode_names_the_same_cause(live: Live, name: str) -> None:
    """``--prometheus URL --window W --at T``: the same window, read from what Prometheus scraped, against
    the baseline since the warm-up began."""
    if name not in live.windows:  # its case was deselected: run it now
        d = diagnosed(live.ds, next(c for c in CASES if c.name == name), live.windows).diagnosis
        live.verdicts[name] = d.verdicts[0] if d.verdicts else None
    start, end = live.windows[name]
    result = from_prometheus(live.prom.url, end - start, start - live.since, at=end)
    direct = live.verdicts[name]
    d = result.diagnosis
    print(f"\n[{name}, from Prometheus] " + (line(d.verdicts[0]) if d.verdicts else "no cause"))
    assert d.served > 0 and not d.notes, d
    assert {w.name for w in result.window.workers} == {host_port(u) for u in live.ds.worker_urls}
    if direct is None:
        assert d.verdicts == (), [line(v) for v in d.verdicts]
    else:
        assert (d.verdicts[0].cause, d.verdicts[0].worker) == (direct.cause, direct.worker)

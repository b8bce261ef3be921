"""SIGTERM to the parent of ``RADIXGATE_WORKERS=2`` while a rolling restart (SIGHUP) waits for an old process
to drain a stream (service/runtime/host_serve.py, ``MetricsMultiprocess``). Before, the replacement already
serving got no SIGTERM until the old process had drained (it answered ``/readyz`` 200 and admitted new
requests meanwhile, about 12 s after the signal with a 15 s stream), and the restart went on to start one
more process after the signal. Now every process, the replacement included, starts its drain at the signal
and no process starts after it; the stream still finishes whole and the parent exits 0.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from datetime import datetime
from pathlib import Path

from tests.service.runtime.test_drain import chat, log_lines, start
from tests.service.runtime.test_gateway_processes import gateway_env, issue_key, wait_for
from tests.support.fake_worker import TOKENS, FakeWorker
from tests.support.servers import ThreadedServer, free_port

STEP_S = 0.25  # the fake worker's pause per word
WORDS = 48  # the stream: about 12 s; the signals come in its first seconds
MARGIN_S = 4.0  # generous for a busy machine, well under what is left of the stream when the signal comes


def _epoch(line: dict[str, object]) -> float:
    return datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00")).timestamp()


def test_sigterm_during_a_rolling_restart_drains_the_replacement_at_once(
    redis_url: str, stub_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "gateway.log"
    base = f"http://127.0.0.1:{port}"
    fake = FakeWorker()
    fake.tokens = list(TOKENS) + [" w"] * (WORDS - len(TOKENS))
    with ThreadedServer(fake.app) as upstream:
        env = gateway_env(redis_url, stub_model_dir, upstream.url, port, 2, "hupterm:")
        env["RADIXGATE_SHUTDOWN__DRAIN_TIMEOUT_S"] = "60"
        proc = start(env, log, port, processes=2)
        try:
            key = issue_key(base, "hupterm")
            fake.delay_s = STEP_S
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                stream = pool.submit(chat, base, key, WORDS, True)
                wait_for(lambda: len(fake.received) == 1, "the stream at the worker", timeout_s=20)
                os.kill(proc.pid, signal.SIGHUP)
                # the restart waits on an old process that drains the stream
                wait_for(
                    lambda: any(
                        line.get("event") == "drain_started" and int(str(line.get("in_flight"))) >= 1
                        for line in log_lines(log)
                    ),
                    "an old process draining the stream",
                    timeout_s=30,
                )
                assert not stream.done(), "the stream ended before the restart waited on it: make it longer"
                term_at = time.time()
                os.kill(proc.pid, signal.SIGTERM)
                status, events = stream.result(timeout=120)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert status == 200 and events[-1] == "[DONE]", events
    assert not any("error" in e for e in events[:-1]), events
    lines = log_lines(log)
    ready = {line["pid"]: _epoch(line) for line in lines if line.get("event") == "gateway_ready"}
    drains = {line["pid"]: _epoch(line) for line in lines if line.get("event") == "drain_started"}
    started_after = [pid for pid, at in ready.items() if at > term_at]
    assert not started_after, f"processes started after SIGTERM: {started_after}"
    for pid in ready:
        assert pid in drains, f"process {pid} never drained"
        assert drains[pid] <= term_at + MARGIN_S, (
            f"process {pid} began its drain {drains[pid] - term_at:.1f} s after SIGTERM"
        )

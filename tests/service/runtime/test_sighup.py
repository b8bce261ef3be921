"""SIGHUP to a one-process gateway (``RADIXGATE_WORKERS=1``, what ``make up`` runs): it is ignored with a
``sighup_ignored`` warning (service/runtime/host_serve.py). Before, SIGHUP's default action killed the process
at once: the stream in flight was cut with no error event and no ``[DONE]``, no ``request`` line was logged
and no usage was settled. With several processes SIGHUP is uvicorn's rolling restart
(tests/service/runtime/test_rolling_restart.py)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
from pathlib import Path

import httpx

from service.runtime.host_serve import SIGHUP_IGNORED
from tests.conftest import ADMIN_TOKEN
from tests.service.runtime.test_drain import chat, log_lines, start
from tests.service.runtime.test_gateway_processes import gateway_env, issue_key, wait_for
from tests.support.fake_worker import TOKENS, FakeWorker
from tests.support.servers import ThreadedServer, free_port

STEP_S = 0.2  # the fake worker's pause per word
WORDS = 15  # the stream: about 3 s, the signal comes in its middle


def test_sighup_to_one_process_is_ignored_with_a_warning_and_the_stream_finishes(
    redis_url: str, stub_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "gateway.log"
    base = f"http://127.0.0.1:{port}"
    fake = FakeWorker()
    fake.tokens = list(TOKENS) + [" w"] * (WORDS - len(TOKENS))
    with ThreadedServer(fake.app) as upstream:
        env = gateway_env(redis_url, stub_model_dir, upstream.url, port, 1, "sighup:")
        proc = start(env, log, port, processes=1)
        try:
            key = issue_key(base, "hupper")
            fake.delay_s = STEP_S
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                stream = pool.submit(chat, base, key, WORDS, True)
                wait_for(lambda: len(fake.received) == 1, "the stream at the worker", timeout_s=20)
                os.kill(proc.pid, signal.SIGHUP)
                assert not stream.done(), "the stream ended before the signal came: make it longer"
                try:
                    status, events = stream.result(timeout=60)
                except httpx.HTTPError as exc:  # the process died under it
                    raise AssertionError(f"stream cut ({exc!r}), gateway exit {proc.poll()}") from exc
            assert proc.poll() is None, log.read_text()[-3000:]
            wait_for(
                lambda: any(line.get("event") == "sighup_ignored" for line in log_lines(log)),
                "a sighup_ignored line",
                timeout_s=10,
            )
            # it goes on serving: a request after the signal is answered
            fake.delay_s = 0.0
            after_status, after = chat(base, key, 2, False)
            assert after_status == 200 and after[0]["usage"]["completion_tokens"] == 2, after
            with httpx.Client(base_url=base, timeout=30) as admin:
                usage = admin.get(
                    "/admin/tenants/hupper/usage", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
                ).json()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    # the stream was not cut: every word, no error event, [DONE]
    assert status == 200 and events[-1] == "[DONE]", events
    assert not any("error" in e for e in events[:-1]), events
    text = "".join(
        choice["delta"].get("content") or "" for e in events[:-1] for choice in e.get("choices", [])
    )
    assert text == "".join(fake.tokens), text
    lines = log_lines(log)
    (warning,) = [line for line in lines if line.get("event") == "sighup_ignored"]
    assert warning["level"] == "warning" and warning["hint"] == SIGHUP_IGNORED
    assert "RADIXGATE_WORKERS > 1" in warning["hint"]
    # settled: a request line each, and the tenant's usage counts both answers
    served = [line for line in lines if line.get("event") == "request" and line.get("tenant") == "hupper"]
    assert sorted(line["status"] for line in served) == [200, 200], served
    assert usage["requests"] == 2 and usage["completion_tokens"] == WORDS + 2, usage
    # and it still stops as before: SIGTERM drains, exit status 0
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert any(line.get("event") == "drain_finished" for line in lines)

"""Several gateway processes on one host (``RADIXGATE_WORKERS``): ``python -m service serve`` forks uvicorn
workers from the app factory; they share the port and Redis, so a tenant's quota holds across them, and
their ``/metrics`` (prometheus_client multiprocess mode, in a directory of the run) shows the whole host."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from typer.testing import CliRunner

from service.__main__ import cli
from service.config.settings import Settings
from service.observability.metrics import GatewayMetrics, TenantLabels, multiprocess_values_active
from service.runtime.host_serve import MULTIPROC_ENV
from tests.conftest import ADMIN_TOKEN
from tests.support.fake_worker import FakeWorker
from tests.support.servers import ThreadedServer, free_port

MODEL = "proc-model"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def test_several_processes_cannot_each_launch_the_engines() -> None:
    with pytest.raises(ValidationError, match=r"workers > 1 needs engine\.launch false"):
        Settings.model_validate({"workers": 2, "engine": {"launch": True}})
    assert Settings.model_validate({"workers": 2}).workers == 2


def gateway_env(
    redis_url: str, stub_model_dir: Path, upstream: str, port: int, workers: int, prefix: str
) -> dict[str, str]:
    """The environment of ``python -m service serve``: this one without any RADIXGATE_* or
    PROMETHEUS_MULTIPROC_DIR variable, plus the gateway's settings."""
    env = {k: v for k, v in os.environ.items() if k not in MULTIPROC_ENV and not k.startswith("RADIXGATE_")}
    return env | {
        "PYTHONUNBUFFERED": "1",
        "RADIXGATE_WORKERS": str(workers),
        "RADIXGATE_PORT": str(port),
        "RADIXGATE_ADMIN_TOKEN": ADMIN_TOKEN,
        "RADIXGATE_REDIS__URL": redis_url,
        "RADIXGATE_REDIS__KEY_PREFIX": prefix,
        "RADIXGATE_UPSTREAM__WORKERS": json.dumps([upstream]),
        "RADIXGATE_ENGINE__SERVED_MODEL_NAME": MODEL,
        "RADIXGATE_API__TOKENIZER_PATH": str(stub_model_dir),
    }


def ready_processes(log: Path) -> set[int]:
    """The pids that have logged ``gateway_ready`` in ``log`` so far."""
    ready = set()
    for line in log.read_text().splitlines():
        if line.startswith("{") and '"gateway_ready"' in line:
            ready.add(json.loads(line)["pid"])
    return ready


def serve(env: dict[str, str], log: Path, port: int) -> Iterator[str]:
    """Run ``python -m service serve`` with ``env`` until the generator is closed; yields its URL once
    ``/readyz`` answers 200 and every one of its ``RADIXGATE_WORKERS`` processes has logged
    ``gateway_ready`` (one ready process answers ``/readyz`` and would take every connection)."""
    processes = int(env.get("RADIXGATE_WORKERS", "1"))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "gateway not ready in 60 s"
            try:
                if (
                    httpx.get(f"{base}/readyz", timeout=2).status_code == 200
                    and len(ready_processes(log)) >= processes
                ):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_two_processes_serve_and_share_a_tenants_quota(
    redis_url: str, stub_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "gateway.log"
    with ThreadedServer(FakeWorker().app) as upstream:
        env = gateway_env(redis_url, stub_model_dir, upstream.url, port, workers=2, prefix="procs:")
        server = serve(env, log, port)
        base = next(server)
        try:
            with httpx.Client(base_url=base, timeout=30) as admin:
                # a burst of 30 requests refilled at 1/min: 30 pass in all, whichever process serves them
                tenant = {
                    "id": "shared",
                    "name": "shared",
                    "quotas": {"requests_per_min": 1, "request_burst": 30},
                }
                assert admin.post("/admin/tenants", json=tenant, headers=ADMIN).status_code == 201
                issued = admin.post("/admin/tenants/shared/keys", json={"name": "k"}, headers=ADMIN)
                assert issued.status_code == 201
                key = issued.json()["api_key"]

            def ask(_: int) -> tuple[int, str]:  # a fresh connection each time: either process may take it
                body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                headers = {"Authorization": f"Bearer {key}"}
                resp = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=30)
                return resp.status_code, resp.text

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(ask, range(60)))
        finally:
            server.close()
    statuses = Counter(status for status, _ in answers)
    odd = [text for status, text in answers if status not in (200, 429)]
    assert statuses == {200: 30, 429: 30}, odd
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    served = [line for line in lines if line.get("event") == "request" and line.get("tenant") == "shared"]
    assert len(served) == 30 and {line["status"] for line in served} == {200}
    by_process = Counter(line["pid"] for line in served)
    assert len(by_process) == 2, f"one process served every request: {by_process}"


def issue_key(base: str, tenant_id: str) -> str:
    """Create ``tenant_id`` (no quotas) and return a new API key of it."""
    with httpx.Client(base_url=base, timeout=30) as admin:
        tenant = {"id": tenant_id, "name": tenant_id}
        assert admin.post("/admin/tenants", json=tenant, headers=ADMIN).status_code == 201
        issued = admin.post(f"/admin/tenants/{tenant_id}/keys", json={"name": "k"}, headers=ADMIN)
        assert issued.status_code == 201
        return str(issued.json()["api_key"])


def ask(base: str, key: str, max_tokens: int = 2) -> int:
    """One chat completion on a fresh connection (either process may take it); its status."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=60).status_code


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(base: str) -> Samples:
    """``/metrics`` on a fresh connection, as {(sample name, sorted labels): value}."""
    resp = httpx.get(f"{base}/metrics", timeout=30)
    assert resp.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.text)
        for s in family.samples
    }


def served(samples: Samples, tenant: str) -> float:
    """``radixgate_requests_total`` of ``tenant``'s answered-200 requests."""
    labels = (("model", MODEL), ("status", "200"), ("tenant", tenant))
    return samples.get(("radixgate_requests_total", labels), 0.0)


def counters_agree(scrapes: list[Samples]) -> bool:
    """Every scrape shows the same counters (gauges such as windows may move with the load polls)."""
    counters = [{key: v for key, v in s.items() if key[0].endswith("_total")} for s in scrapes]
    return bool(counters[0]) and all(c == counters[0] for c in counters[1:])


def ready_pids(log: Path) -> list[int]:
    """The pids of the gateway processes that logged ``gateway_ready``, in order."""
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [int(line["pid"]) for line in lines if line.get("event") == "gateway_ready"]


def in_flight_of(multiproc_dir: Path, pid: int) -> float:
    """``radixgate_in_flight_requests`` as process ``pid`` wrote it in its own multiprocess file."""
    files = [str(f) for f in multiproc_dir.glob(f"gauge_livesum_{pid}.db")]
    for family in MultiProcessCollector.merge(files):  # type: ignore[no-untyped-call]
        for sample in family.samples:
            if sample.name == "radixgate_in_flight_requests":
                return float(sample.value)
    return 0.0


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    """Poll ``condition`` every 0.1 s until true; fail with ``what`` after ``timeout_s`` s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_two_processes_metrics_show_the_whole_host_and_survive_a_restart(
    redis_url: str, stub_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "gateway.log"
    temp = tmp_path / "temp"  # the serve command's TMPDIR: where its multiprocess directory is made
    temp.mkdir()
    fake = FakeWorker()
    k, m = 24, 10
    with ThreadedServer(fake.app) as upstream:
        env = gateway_env(redis_url, stub_model_dir, upstream.url, port, workers=2, prefix="procmetrics:")
        server = serve(env | {"TMPDIR": str(temp)}, log, port)
        base = next(server)
        try:
            (multiproc_dir,) = temp.glob("radixgate-metrics-*")
            assert multiproc_dir.stat().st_mode & 0o777 == 0o700
            wait_for(lambda: len(ready_pids(log)) == 2, "two processes ready")
            key = issue_key(base, "metrics")
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                assert set(pool.map(lambda _: ask(base, key), range(k))) == {200}
            lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
            pids = Counter(line["pid"] for line in lines if line.get("event") == "request")
            assert len(pids) == 2, f"one process served every request: {pids}"
            # whichever process answers, a scrape sees the whole host, and all scrapes agree
            scrapes = [scrape(base) for _ in range(8)]
            assert [served(s, "metrics") for s in scrapes] == [k] * 8
            assert counters_agree(scrapes)
            assert scrapes[0][("radixgate_in_flight_requests", ())] == 0

            # a request held in flight by one process; then that process is killed and replaced
            fake.delay_s = 2.0
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                slow = pool.submit(ask, base, key, 2)  # 2 words, 2 s each at the worker
                wait_for(
                    lambda: any(in_flight_of(multiproc_dir, pid) == 1 for pid in ready_pids(log)),
                    "the slow request in flight",
                    timeout_s=20,
                )
                (victim,) = [pid for pid in ready_pids(log) if in_flight_of(multiproc_dir, pid) == 1]
                assert all(scrape(base)[("radixgate_in_flight_requests", ())] == 1 for _ in range(4))
                os.kill(victim, signal.SIGKILL)
                with pytest.raises(httpx.HTTPError):
                    slow.result()
            fake.delay_s = 0.0
            wait_for(lambda: len(ready_pids(log)) == 3, "uvicorn replaced the killed process")
            # the dead process's live gauges are gone (its in-flight request no longer counts) ...
            wait_for(lambda: not list(multiproc_dir.glob(f"gauge_live*_{victim}.db")), "marked dead")
            assert list(multiproc_dir.glob(f"counter_{victim}.db")), "its counters are kept"
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                assert set(pool.map(lambda _: ask(base, key), range(m))) == {200}
            # ... while what it served still counts, once: the replacement writes files of its own pid
            scrapes = [scrape(base) for _ in range(8)]
            assert [served(s, "metrics") for s in scrapes] == [k + m] * 8
            assert [s[("radixgate_in_flight_requests", ())] for s in scrapes] == [0] * 8
            assert counters_agree(scrapes)
        finally:
            server.close()
    assert not multiproc_dir.exists(), "the multiprocess directory outlived the gateway"


def test_one_process_keeps_metrics_in_memory(redis_url: str, stub_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    temp = tmp_path / "temp"
    temp.mkdir()
    with ThreadedServer(FakeWorker().app) as upstream:
        env = gateway_env(redis_url, stub_model_dir, upstream.url, port, workers=1, prefix="procone:")
        server = serve(env | {"TMPDIR": str(temp)}, tmp_path / "gateway.log", port)
        base = next(server)
        try:
            key = issue_key(base, "solo")
            assert [ask(base, key) for _ in range(3)] == [200] * 3
            samples = scrape(base)
            assert served(samples, "solo") == 3
            # in-memory counters carry a _created sample; multiprocess files do not
            assert any(name == "radixgate_requests_created" for name, _ in samples)
            assert list(temp.iterdir()) == []  # no multiprocess directory made
        finally:
            server.close()


def test_tenant_labels_are_capped_for_the_whole_host(tmp_path: Path) -> None:
    # two processes' label maps over one shared file: the cap holds for both together, and a tenant gets
    # the same label whichever process serves it (each capping alone gave N x cap labels, and a tenant
    # "other" in one process and named in the next)
    shared = tmp_path / "tenant-labels"
    one, two = TenantLabels(2, shared), TenantLabels(2, shared)
    assert [one("a"), two("b"), two("c"), one("c"), one("d")] == ["a", "b", "other", "other", "other"]
    assert [two("a"), one("b"), two("a")] == ["a", "b", "a"]
    alone = TenantLabels(1)  # one process: no file
    assert [alone("x"), alone("y"), alone("x")] == ["x", "other", "x"]


def test_two_processes_keep_the_tenant_label_cap(
    redis_url: str, stub_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    with ThreadedServer(FakeWorker().app) as upstream:
        env = gateway_env(redis_url, stub_model_dir, upstream.url, port, workers=2, prefix="proclabels:")
        env["RADIXGATE_OBSERVABILITY__MAX_TENANT_LABELS"] = "2"
        server = serve(env, tmp_path / "gateway.log", port)
        base = next(server)
        try:
            keys = [issue_key(base, f"lab{i}") for i in range(6)]
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                assert set(pool.map(lambda i: ask(base, keys[i % 6]), range(36))) == {200}
            samples = scrape(base)
        finally:
            server.close()
    labels = {dict(labels)["tenant"] for name, labels in samples if name == "radixgate_requests_total"}
    assert len(labels - {"other"}) == 2 and "other" in labels, labels
    assert sum(served(samples, t) for t in labels) == 36


def test_metrics_refuse_a_multiproc_dir_while_values_are_in_memory(tmp_path: Path) -> None:
    assert not multiprocess_values_active()
    with pytest.raises(ValueError, match="PROMETHEUS_MULTIPROC_DIR"):
        GatewayMetrics(CollectorRegistry(), 10, tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        GatewayMetrics(CollectorRegistry(), 10, tmp_path / "missing")
    assert not GatewayMetrics(CollectorRegistry(), 10).multiprocess


@pytest.mark.parametrize("name", MULTIPROC_ENV)
def test_serve_refuses_an_inherited_multiproc_dir(name: str, tmp_path: Path) -> None:
    # RADIXGATE_WORKERS=0 is invalid: were the inherited directory accepted, serve would stop there
    # (exit 2 with another message) rather than start a server
    result = CliRunner().invoke(cli, ["serve"], env={name: str(tmp_path), "RADIXGATE_WORKERS": "0"})
    assert result.exit_code == 2
    assert f"unset {name}" in result.output


def test_a_gateway_whose_port_is_taken_exits(redis_url: str, stub_model_dir: Path, tmp_path: Path) -> None:
    """uvicorn binds after the lifespan started; when the bind fails it runs the lifespan's shutdown and
    exits. A background task in a Redis call could swallow its cancel there (redis-py), and the process
    then hung for ever (ignoring SIGTERM: uvicorn holds the signal). Run a few times: it was a race."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = gateway_env(redis_url, stub_model_dir, "http://127.0.0.1:9", port, 1, "rg-port-taken:")
        for attempt in range(3):
            log = tmp_path / f"gateway-{attempt}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "service", "serve"], env=env, stdout=out, stderr=subprocess.STDOUT
                )
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise AssertionError(f"attempt {attempt}: running 60 s after it could not bind") from None
            assert code != 0 and "address already in use" in log.read_text(), log.read_text()[-2000:]

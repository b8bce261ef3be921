"""The benchmark's instant fake SGLang upstream: its ``/generate`` as SGLang sends it, and the real gateway
serving chat completions from it, streamed and not; then a tiny ``bench-gateway --json`` run."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.app import create_app
from service.config.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.support.paths import REPO
from tests.support.servers import ThreadedServer, free_port

ROOT = REPO


@pytest.fixture(scope="module", params=["cumulative", "incremental"])
def fake_upstream(request: pytest.FixtureRequest) -> Iterator[tuple[str, bool]]:
    """(URL, incremental?) of a fake streaming `/generate` cumulatively (SGLang default) or incrementally."""
    port = free_port()
    flags = ["--incremental"] if request.param == "incremental" else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadgen.bench.upstream", "--port", str(port), *flags],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise RuntimeError("fake upstream exited")
            time.sleep(0.05)
        yield url, request.param == "incremental"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def sse_payloads(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def test_generate_answers_like_sglang(fake_upstream: tuple[str, bool]) -> None:
    url, incremental = fake_upstream
    body = {"text": "hello there world", "sampling_params": {"max_new_tokens": 3}, "rid": "r-1"}
    with httpx.Client(base_url=url) as http:
        plain = http.post("/generate", json=body).json()
        assert plain["text"] == "alpha beta gamma" and plain["output_ids"] == [1000, 1001, 1002]
        meta = plain["meta_info"]
        assert meta["id"] == "r-1" and meta["completion_tokens"] == 3
        assert meta["finish_reason"] == {"type": "length", "length": 3}
        streamed = http.post("/generate", json={**body, "stream": True, "rid": "a-much-longer-request-id"})
        assert streamed.headers["transfer-encoding"] == "chunked"
        events = sse_payloads(streamed.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert http.get("/server_info").json()["incremental_streaming_output"] is incremental
        if incremental:  # each event its own token, as --incremental-streaming-output
            assert [c["text"] for c in chunks] == ["alpha", " beta", " gamma"]
            assert [c["output_ids"] for c in chunks] == [[1000], [1001], [1002]]
        else:
            assert [c["text"] for c in chunks] == ["alpha", "alpha beta", "alpha beta gamma"]
            assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3]
        assert [c["meta_info"]["finish_reason"] for c in chunks[:2]] == [None, None]
        assert all(c["meta_info"]["id"] == "a-much-longer-request-id" for c in chunks)
        # a shorter answer than max_new_tokens ends with "stop"; unknown routes answer 404
        assert (
            http.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 9999}}).status_code
            == 200
        )
        assert http.get("/nope").status_code == 404
        stats = http.get("/_bench/stats").json()
        assert stats["requests"]["/generate"] == 3


@pytest.fixture(scope="module")
def gateway(
    redis_url: str, stub_model_dir: Path, fake_upstream: tuple[str, bool]
) -> Iterator[tuple[str, str]]:
    settings = Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": f"bench-up-{fake_upstream[1]}:"},
            "engine": {"served_model_name": "bench-model"},
            "upstream": {"workers": [fake_upstream[0]], "health_interval_s": 0.2},
            "api": {"tokenizer_path": str(stub_model_dir)},
        }
    )
    with (
        ThreadedServer(create_app(settings)) as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        for _ in range(100):
            if http.get("/readyz").status_code == 200:
                break
            time.sleep(0.05)
        tenant = {"id": "b", "name": "b", "quotas": {"requests_per_min": 1e9, "tokens_per_min": 1e12}}
        assert http.post("/admin/tenants", json=tenant, headers=admin).status_code == 201
        key = http.post("/admin/tenants/b/keys", json={"name": "k"}, headers=admin).json()["api_key"]
        yield server.url, key


def test_gateway_serves_chat_from_the_fake_upstream(gateway: tuple[str, str]) -> None:
    url, key = gateway
    body = {"model": "bench-model", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        plain = http.post("/v1/chat/completions", json=body)
        assert plain.status_code == 200, plain.text
        answer = plain.json()
        assert answer["choices"][0]["message"]["content"] == "alpha beta gamma delta"
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 4
        streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.status_code == 200
        events = sse_payloads(streamed.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == "alpha beta gamma delta"
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        # the fake writes a whole answer at once: its chunks' events reach the client in one write
        # (one HTTP chunk), not one write per token; [DONE] follows once the worker's response has ended
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
            writes = [piece for piece in resp.iter_raw() if piece]
        assert b"".join(writes).count(b"data: ") == len(events)
        assert len(writes) <= 2 and writes[0].count(b"data: ") >= len(events) - 1, [w[:60] for w in writes]


def test_bench_gateway_json_from_a_tiny_run(tmp_path: Path) -> None:
    # radixgate too: on 4246358 it kept the fake upstream out of its pool (the upstream reported its
    # tokenizer folder as its model, not the name radixgate serves) and answered every request 503
    argv = [
        sys.executable,
        "-m",
        "loadgen",
        "bench-gateway",
        "--targets",
        "direct,radixgate",
        "--modes",
        "c1",
    ]
    argv += ["--repeats", "1", "--duration-s", "1", "--warmup-s", "0", "--idle-s", "0.5", "--json"]
    argv += ["--out", str(tmp_path / "run")]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["target"] for r in rows] == ["direct", "radixgate"]
    gateway = rows[1]
    assert gateway["requests"] > 50 and gateway["errors"] == 0
    row = rows[0]
    assert (row["target"], row["mode"]) == ("direct", "c1")
    assert row["rps"] > 100 and row["requests"] > 100 and row["errors"] == 0
    assert row["cpu_ms_per_request"] is not None and 0 <= row["cpu_ms_per_request"] < 5
    assert row["added_p50_ms"] == 0.0 and row["added_p99_ms"] == 0.0  # direct against itself
    assert row["upstream_requests_per_request"] >= 1.0
    report = json.loads((tmp_path / "run" / "bench.json").read_text())
    assert report["results"][0]["rps"] == pytest.approx(row["rps"], abs=1e-3)
    assert report["samples"][0]["wrk_requests"] >= row["requests"]
    assert (tmp_path / "run" / "bench.png").stat().st_size > 10_000


def children_of(pid: int) -> set[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_bench_gateway_stops_its_processes_on_sigterm(tmp_path: Path) -> None:
    # SIGTERM (a CI timeout, `timeout`, systemd) must stop the fake upstream and the targets as Ctrl-C does:
    # they run in sessions of their own, so only the benchmark can stop them
    argv = [sys.executable, "-m", "loadgen", "bench-gateway", "--targets", "direct", "--modes", "c1"]
    argv += ["--repeats", "1", "--duration-s", "60", "--warmup-s", "0", "--idle-s", "0"]
    argv += ["--out", str(tmp_path / "run")]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "run" / "wrk" / "direct-c1.lua").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the benchmark did not start wrk"
            time.sleep(0.2)
        time.sleep(1.0)  # wrk running
        started = children_of(proc.pid)
        assert started, "no child processes"
        proc.terminate()
        assert proc.wait(timeout=30) != 0
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in started if alive(pid)], "children outlived the benchmark"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in children_of(proc.pid) | locals().get("started", set()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

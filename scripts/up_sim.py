"""compose.yaml's ``sim`` topology as local processes (no Docker): ``make up-sim`` (docs/scaling.md).

Redis, two gateway processes on one port (``RADIXGATE_WORKERS=2``: the kernel spreads the connections over
them, as compose's balancer spreads them over its two replicas; each process is one replica with its own
scheduler, both sharing Redis and the worker registry), simulated SGLang workers (``python -m loadgen.sim``,
a simulator, not a model: made-up words at an H100's speed for Llama-3.1-8B) and, when Debian's
``prometheus`` is installed (``make setup`` installs it), Prometheus scraping the gateway and the workers,
with deploy/prometheus/rules (the recording rules the runbook queries and the alerts).
Steps:

1. write the word-level stub tokenizer (``loadgen.bench.stub_tokenizer``, which counts what the simulator
   counts) and start the simulated workers;
2. start Redis and the gateway with the workers in ``RADIXGATE_UPSTREAM__WORKERS`` (shared through the
   registry with every process);
3. create a tenant and a key, stream one chat and send a few more, show ``/admin/workers``;
4. keep running until Ctrl-C (``--keep``), or stop everything.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import yaml

from loadgen.bench.stub_tokenizer import write_stub_model
from loadgen.stack import LocalStack, StackError, free_port, terminate_as_exit, wait_until_stopped

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / ".run" / "sim"
MODEL = "sim-llama-3.1-8b"
PROFILE = "llama-3.1-8b-h100"
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULE_FILES = tuple(
    PROMETHEUS_DIR / name
    for name in yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())["rule_files"]
)
"""The rule files deploy/prometheus/prometheus.yml loads (compose's Prometheus loads the same), as paths."""


def start_workers(count: int) -> list[tuple[subprocess.Popen[bytes], int]]:
    """``count`` simulated workers on free ports, each answering ``/health``."""
    workers = []
    for i in range(count):
        port = free_port()
        log = open(RUN / f"sim-{port}.log", "wb")  # noqa: SIM115 - owned by the child process
        argv = [sys.executable, "-m", "loadgen.sim", "--profile", PROFILE, "--model-name", MODEL]
        argv += ["--port", str(port), "--seed", str(i)]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        workers.append((proc, port))
    deadline = time.monotonic() + 60
    for proc, port in workers:
        while True:
            if proc.poll() is not None:
                raise StackError(f"simulated worker on {port} exited; see {RUN}/sim-{port}.log")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise StackError(f"simulated worker on {port} did not answer in 60 s")
            time.sleep(0.2)
    return workers


def start_prometheus(
    gateway_port: int, worker_ports: list[int]
) -> tuple[subprocess.Popen[bytes], int] | None:
    """Debian's prometheus scraping the gateway and the workers every 5 s, with the recording and alert rules
    compose's Prometheus loads (:data:`RULE_FILES`, evaluated every 5 s), so the runbook's queries answer
    and the alerts can fire here too (no Alertmanager is started: a firing alert shows on Prometheus's
    /alerts page and ``/api/v1/alerts``). None when prometheus is not installed."""
    binary = shutil.which("prometheus")
    if binary is None:
        return None
    port = free_port()
    config = {
        "global": {
            "scrape_interval": "5s",
            "evaluation_interval": "5s",
            "external_labels": {"service": "radixgate"},
        },
        "rule_files": [str(path) for path in RULE_FILES],
        "scrape_configs": [
            {"job_name": "radixgate", "static_configs": [{"targets": [f"127.0.0.1:{gateway_port}"]}]},
            {"job_name": "sglang", "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in worker_ports]}]},
        ],
    }
    (RUN / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    # a fresh TSDB: an earlier run's series (its workers' ports, unmarked as stale when it stopped) would
    # answer queries and fire alerts for workers that are gone
    shutil.rmtree(RUN / "prometheus-data", ignore_errors=True)
    log = open(RUN / "prometheus.log", "wb")  # noqa: SIM115 - owned by the child process
    argv = [
        binary,
        f"--config.file={RUN / 'prometheus.yml'}",
        f"--storage.tsdb.path={RUN / 'prometheus-data'}",
    ]
    argv += [f"--web.listen-address=127.0.0.1:{port}"]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc, port


def run_requests(stack: LocalStack, requests: int) -> None:
    """A tenant, one streamed chat, ``requests`` more; which gateway process answered each."""
    key = stack.create_tenant("sim-demo", priority_class="interactive")
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello, fleet."}], "max_tokens": 12}
    print("\n== a streamed chat")
    with httpx.stream(
        "POST", f"{stack.url}/v1/chat/completions", json={**body, "stream": True}, headers=auth, timeout=30
    ) as resp:
        resp.raise_for_status()
        chunks = sum(1 for line in resp.iter_lines() if line.startswith("data: "))
    print(f"  {chunks} events, status {resp.status_code}")
    print(f"\n== {requests} more chats, each on a new connection")
    statuses: Counter[int] = Counter()
    t0 = time.perf_counter()
    for _ in range(requests):
        resp = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=auth, timeout=30)
        statuses[resp.status_code] += 1
    print(f"  statuses {dict(statuses)} in {time.perf_counter() - t0:.2f} s")
    if set(statuses) != {200}:
        raise StackError(f"not every chat was answered 200: {dict(statuses)}; see {RUN}/gateway.log")
    with stack.admin() as admin:
        print("\n== GET /admin/workers")
        for w in admin.get("/admin/workers").json()["data"]:
            print(f"  {w['url']:<26} model={w['model']} healthy={w['healthy']}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keep", action="store_true", help="keep the stack running until Ctrl-C")
    parser.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    parser.add_argument("--workers", type=int, default=3, help="simulated workers (default 3)")
    parser.add_argument("--requests", type=int, default=20, help="chats sent after the stream (default 20)")
    args = parser.parse_args()
    RUN.mkdir(parents=True, exist_ok=True)
    tokenizer = write_stub_model(RUN / "stub-tokenizer")
    print(f"starting {args.workers} simulated workers, redis-server and 2 gateway processes (logs in {RUN})")
    with terminate_as_exit():
        workers: list[tuple[subprocess.Popen[bytes], int]] = []
        prometheus = None
        stack = None
        try:
            workers = start_workers(args.workers)
            urls = [f"http://127.0.0.1:{port}" for _, port in workers]
            env = {
                "RADIXGATE_WORKERS": "2",
                "RADIXGATE_ENGINE__SERVED_MODEL_NAME": MODEL,
                "RADIXGATE_API__TOKENIZER_PATH": str(tokenizer),
                "RADIXGATE_UPSTREAM__WORKERS": json.dumps(urls),
            }
            stack = LocalStack(RUN, port=args.port, env=env, launch_workers=False, ready_timeout_s=60)
            stack.start()
            prometheus = start_prometheus(stack.port, [port for _, port in workers])
            run_requests(stack, args.requests)
            if args.keep:
                prom = f"http://127.0.0.1:{prometheus[1]}" if prometheus else None
                wait_until_stopped(
                    f"\nThe stack keeps running: gateway {stack.url} (2 processes), workers {', '.join(urls)}"
                    f"{f', Prometheus {prom}' if prom else ''}, Redis {stack.redis_url}\n"
                    f"admin token {stack.admin_token}\n{stack.runbook_variables(prom)}\nCtrl-C stops it."
                )
        except StackError as exc:
            sys.exit(str(exc))
        except KeyboardInterrupt:
            print("interrupted")
        finally:
            if stack is not None:
                stack.stop()
            for proc, _ in workers + ([prometheus] if prometheus else []):
                proc.terminate()
                proc.wait(timeout=10)


if __name__ == "__main__":
    main()

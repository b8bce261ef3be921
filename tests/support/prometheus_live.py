"""A real Prometheus and Alertmanager watching a :class:`tests.support.prometheus.SimStack` (issue 28): the
live alert test, the live dashboard test and the docs' panel images share it.

- :class:`Webhook`: the receiver Alertmanager posts to (stdlib ``http.server`` in a thread); it keeps every
  alert of every notification with the time it came.
- :class:`LivePrometheus`: Debian's ``prometheus`` (2.42) on the scaled rule files of deploy/prometheus/rules
  (:func:`tests.support.prometheus.scaled_rule_files`), scraping the gateway and the simulated workers, and
  ``prometheus-alertmanager`` (0.25) routing with deploy/prometheus/alertmanager.yml (its routes and
  inhibitions), with the receivers' URLs pointed at the webhook and its waits shortened.
- :class:`Load`: closed-loop clients (asyncio, one thread) that keep ``concurrency`` streamed chat requests in
  flight against the gateway until stopped, counting the answers' statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.prometheus import PROM, scaled_rule_files, tool
from tests.support.servers import free_port


@dataclass(frozen=True, slots=True)
class Notified:
    """One alert of one Alertmanager notification.

    Attributes:
        at: when the webhook got it (``time.time()``, s). receiver: the path posted to (``/alerts``,
        ``/page``). status: ``firing`` or ``resolved``. labels: the alert's labels.
    """

    at: float
    receiver: str
    status: str
    labels: dict[str, str]


class Webhook:
    """An HTTP server on 127.0.0.1 that stores what Alertmanager's webhook receivers post (its JSON:
    ``{"status", "alerts": [{"status", "labels", ...}], ...}``)."""

    def __init__(self) -> None:
        self.received: list[Notified] = []
        self._lock = threading.Condition()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with hook._lock:
                    for alert in body["alerts"]:
                        hook.received.append(
                            Notified(time.time(), self.path, alert["status"], alert["labels"])
                        )
                    hook._lock.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Webhook:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait_for(
        self, alertname: str, status: str, timeout_s: float, since: float = 0.0, **labels: str
    ) -> Notified | None:
        """The first alert ``alertname`` with ``status`` and ``labels`` received at ``since`` or later;
        waits up to ``timeout_s`` for it (None if none came)."""

        def match(n: Notified) -> bool:
            wanted = {"alertname": alertname, **labels}
            return (
                n.status == status and n.at >= since and all(n.labels.get(k) == v for k, v in wanted.items())
            )

        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                found = next((n for n in self.received if match(n)), None)
                left = deadline - time.monotonic()
                if found is not None or left <= 0:
                    return found
                self._lock.wait(left)

    def between(self, start: float, end: float) -> list[Notified]:
        """The alerts received from ``start`` to ``end`` (``time.time()``)."""
        with self._lock:
            return [n for n in self.received if start <= n.at <= end]


SCRAPE_S = 0.5
"""Scrape and rule-evaluation interval of the live Prometheus, s."""

FACTOR = 1 / 60
"""Time scale of the live rules: every range, ``for`` and group interval times this (5 m -> 5 s)."""


def alertmanager_config(webhook: str) -> dict[str, Any]:
    """deploy/prometheus/alertmanager.yml with every receiver posting to ``webhook`` (same path) and
    the route's waits at 1 s (group_wait, group_interval) and 1 h (repeat_interval: one firing and one
    resolved notification per alert)."""
    config = yaml.safe_load((PROM / "alertmanager.yml").read_text())
    for receiver in config["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = webhook + httpx.URL(hook["url"]).path
    routes = [config["route"], *config["route"].get("routes", [])]
    for route in routes:
        route.update(group_wait="500ms", group_interval="1s", repeat_interval="1h")
    return config


class LivePrometheus:
    """Prometheus and Alertmanager processes for ``gateway`` and ``workers`` (base URLs), in ``workdir``.

    Prometheus scrapes every :data:`SCRAPE_S` (jobs ``radixgate`` and ``sglang``, as in
    deploy/prometheus/prometheus.yml), evaluates the rules scaled by :data:`FACTOR` and resends firing
    alerts every second.
    """

    def __init__(self, workdir: Path, gateway: str, workers: list[str], webhook: str) -> None:
        self.workdir = workdir
        self.port, self.am_port = free_port(), free_port()
        rules_dir = workdir / "rules"
        rules_dir.mkdir(parents=True, exist_ok=True)
        rule_files = scaled_rule_files(rules_dir, FACTOR)
        interval = f"{int(SCRAPE_S * 1000)}ms"

        def job(name: str, urls: list[str]) -> dict[str, Any]:
            hosts = [httpx.URL(u).netloc.decode() for u in urls]
            return {"job_name": name, "scrape_timeout": interval, "static_configs": [{"targets": hosts}]}

        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(p) for p in rule_files],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{self.am_port}"]}]}]},
            "scrape_configs": [job("radixgate", [gateway]), job("sglang", workers)],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        (workdir / "alertmanager.yml").write_text(
            yaml.safe_dump(alertmanager_config(webhook), sort_keys=False)
        )
        self._procs: list[subprocess.Popen[bytes]] = []
        self._targets = 1 + len(workers)

    @property
    def url(self) -> str:
        """Prometheus's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def _start(self, args: list[str], log: str, ready: str) -> None:
        out = (self.workdir / log).open("wb")
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir)
        self._procs.append(proc)
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (self.workdir / log).read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ready, timeout=1).status_code == 200:
                    return
            assert time.monotonic() < deadline, f"{args[0]} not ready: {(self.workdir / log).read_text()}"
            time.sleep(0.1)

    def __enter__(self) -> LivePrometheus:
        am = f"127.0.0.1:{self.am_port}"
        self._start(
            [
                tool("prometheus-alertmanager"),
                f"--config.file={self.workdir / 'alertmanager.yml'}",
                f"--storage.path={self.workdir / 'am-data'}",
                f"--web.listen-address={am}",
                "--cluster.listen-address=",
            ],
            "alertmanager.log",
            f"http://{am}/-/ready",
        )
        self._start(
            [
                tool("prometheus"),
                f"--config.file={self.workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--rules.alert.resend-delay=1s",
            ],
            "prometheus.log",
            f"{self.url}/-/ready",
        )
        # Prometheus's discovery manager hands the scrape manager its targets up to 5 s after the start
        # (it batches updates every 5 s): wait for a scrape of each, or a run's first seconds go unseen
        self.wait_until(f"count(up == 1) == {self._targets}", timeout_s=30)
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self._procs):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def api(self, path: str, **params: Any) -> Any:
        """``GET /api/v1/<path>``'s ``data``; raises AssertionError with Prometheus's error on a failure."""
        resp = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = resp.json()
        assert resp.status_code == 200 and body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def names(self) -> set[str]:
        """Every metric name Prometheus holds (``/api/v1/label/__name__/values``)."""
        return set(self.api("label/__name__/values"))

    def wait_until(self, query: str, timeout_s: float) -> list[dict[str, Any]]:
        """Polls the instant ``query`` until it returns a series; its result. Raises AssertionError."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.api("query", query=query)["result"]
            if result:
                return list(result)
            assert time.monotonic() < deadline, f"{query}: empty for {timeout_s} s"
            time.sleep(SCRAPE_S)


@dataclass
class Load:
    """Closed-loop load: ``concurrency`` clients, each sending the next streamed chat request as soon as
    its last one ends, until :meth:`stop`.

    Attributes:
        url: the gateway. key: the API key. body: makes the request body from a running number.
        concurrency: clients. backoff_s: a client's pause after an answer other than 200 (a shed request's
        503 comes at once; without it the clients would spin). statuses: the answers' HTTP statuses, counted.
    """

    url: str
    key: str
    body: Callable[[int], dict[str, Any]]
    concurrency: int
    backoff_s: float = 0.2
    statuses: Counter[int] = field(default_factory=Counter)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Load:
        """Start the clients (in a thread of their own); self."""
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),), daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Counter[int]:
        """Stop the clients (each finishes its request); the statuses counted."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        return self.statuses

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=self.concurrency + 4)
        headers = {"Authorization": f"Bearer {self.key}"}
        async with httpx.AsyncClient(base_url=self.url, timeout=60, limits=limits, headers=headers) as http:
            counter = iter(range(10**9))

            async def client() -> None:
                while not self._stop.is_set():
                    body = self.body(next(counter))
                    status = 0  # no answer (connection failed)
                    with contextlib.suppress(httpx.HTTPError):
                        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                            async for _ in resp.aiter_raw():
                                pass
                            status = resp.status_code
                    self.statuses[status] += 1
                    if status != 200:
                        await asyncio.sleep(self.backoff_s)

            await asyncio.gather(*(client() for _ in range(self.concurrency)))


@contextlib.contextmanager
def running(load: Load) -> Iterator[Load]:
    """``load`` started, and stopped on leaving."""
    load.start()
    try:
        yield load
    finally:
        load.stop()


def iso(at: float) -> str:
    """``at`` (``time.time()``) as RFC 3339, for the Prometheus API's ``start``/``end``."""
    return datetime.datetime.fromtimestamp(at, datetime.UTC).isoformat()

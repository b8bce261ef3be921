"""Stopping is a state the gateway announces (service/runtime/drain.py): SIGTERM to ``python -m service
serve``, one
process and several, in front of the fake worker with slow answers.

From the signal on ``/readyz`` answers 503 and a new request 503 with ``Retry-After`` (or, once the drain
is over, its connection is refused; never accepted and left unanswered); what is in flight finishes, up to
``shutdown.drain_timeout_s``, after which a longer stream is ended (error event, aborted at the worker,
charged what was generated); each request is settled once; the drain's start and end are logged with the
counts; the exit status is 0."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import uvicorn
from starlette.types import Message
from structlog.testing import capture_logs
from uvicorn.server import ServerState

from service.config.settings import Settings
from service.config.shutdown import KUBERNETES_GRACE_S, ShutdownSettings
from service.errors import GatewayError
from service.runtime.drain import Drain, closing_connection, drain_on_signals
from service.runtime.http_protocol import GatewayHttpToolsProtocol
from tenancy.layout import KeyLayout
from tests.service.runtime.test_gateway_processes import MODEL, gateway_env, issue_key, ready_pids, wait_for
from tests.support.fake_worker import TOKENS, FakeWorker
from tests.support.servers import ThreadedServer, free_port

STEP_S = 0.25  # the fake worker's pause per word
SHORT = 6  # words of the requests that finish within the deadline (1.5 s)
LONG = 40  # words of the stream that outlives it (10 s)
DRAIN_S = 3.0


def start(env: dict[str, str], log: Path, port: int, processes: int) -> subprocess.Popen[bytes]:
    """``python -m service serve`` with ``env``, once ``/readyz`` says ready and each process logged
    ``gateway_ready``."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "serve"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()[-2000:]
        assert time.monotonic() < deadline, "gateway not ready in 60 s"
        try:
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
            if ready and len(ready_pids(log)) == processes:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def chat(base: str, key: str, max_tokens: int, stream: bool) -> tuple[int, list[Any]]:
    """One chat completion on a fresh connection: (status, the stream's events as parsed JSON with
    ``"[DONE]"`` for the end, or the one JSON body)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{base}/v1/chat/completions"
    if not stream:
        resp = httpx.post(url, json=body, headers=headers, timeout=30)
        return resp.status_code, [resp.json()]
    events: list[Any] = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return resp.status_code, events


def log_lines(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def test_default_drain_fits_kubernetes_grace_period() -> None:
    shutdown = Settings().shutdown
    assert shutdown.drain_timeout_s + shutdown.end_timeout_s + 1.0 < KUBERNETES_GRACE_S


@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_drains_what_is_in_flight_and_exits_0(
    processes: int, redis_url: str, stub_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    log = tmp_path / "gateway.log"
    base = f"http://127.0.0.1:{port}"
    prefix = f"drain{processes}:"
    fake = FakeWorker()
    fake.tokens = list(TOKENS) + [" w"] * (LONG - len(TOKENS))
    with ThreadedServer(fake.app) as upstream:
        env = gateway_env(redis_url, stub_model_dir, upstream.url, port, processes, prefix)
        env["RADIXGATE_SHUTDOWN__DRAIN_TIMEOUT_S"] = str(DRAIN_S)
        env["RADIXGATE_SCHEDULER__WINDOW_MODE"] = "fixed"  # all 13 at the worker at once
        env["RADIXGATE_SCHEDULER__WINDOW_INITIAL"] = "32"
        proc = start(env, log, port, processes)
        try:
            key = issue_key(base, "drainer")
            fake.delay_s = STEP_S
            with concurrent.futures.ThreadPoolExecutor(13) as pool:
                streams = [pool.submit(chat, base, key, SHORT, True) for _ in range(8)]
                plain = [pool.submit(chat, base, key, SHORT, False) for _ in range(4)]
                long = pool.submit(chat, base, key, LONG, True)
                wait_for(lambda: len(fake.received) == 13, "13 requests at the worker", timeout_s=20)
                # two keep-alive connections, open and idle when the signal comes (one per process when
                # there are two: each client is its own connection; which process takes it is the kernel's)
                kept = [httpx.Client(base_url=base, timeout=5) for _ in range(2)]
                for client in kept:
                    assert client.get("/healthz").status_code == 200
                # the parent alone, as Kubernetes and docker stop do (it passes it on to its processes)
                signalled = time.monotonic()
                os.kill(proc.pid, signal.SIGTERM)
                time.sleep(0.3)
                # a request on a connection that was idle is served (not reset under the client), and its
                # answer closes the connection
                first = kept[0].post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert first.status_code == 200 and first.headers["connection"] == "close", first.text
                # from the signal until the exit: a new connection is refused (the port is closed at once:
                # shutdown.accept_for_s is 0), never accepted and left unanswered (a short client timeout)
                answers: list[tuple[str, int | str]] = []
                while proc.poll() is None:
                    for path, ask in (
                        ("/readyz", lambda: httpx.get(f"{base}/readyz", timeout=2)),
                        (
                            "chat",
                            lambda: httpx.post(
                                f"{base}/v1/chat/completions",
                                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                                headers={"Authorization": f"Bearer {key}"},
                                timeout=2,
                            ),
                        ),
                    ):
                        try:
                            resp = ask()
                        except httpx.ConnectError:
                            answers.append((path, "refused"))
                            continue
                        except httpx.TimeoutException:
                            raise AssertionError(f"{path} accepted and left unanswered: {answers}") from None
                        raise AssertionError(f"{path} accepted after the signal: {resp.status_code}")
                    if time.monotonic() - signalled > DRAIN_S + 0.3 and len(kept) > 1:
                        # past the deadline a request on the other idle connection is refused with 503
                        late = kept.pop().post(
                            "/v1/chat/completions",
                            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                            headers={"Authorization": f"Bearer {key}"},
                        )
                        late_answer = (late.status_code, late.headers.get("retry-after"), late.json())
                    assert time.monotonic() - signalled < 30, "still running 30 s after SIGTERM"
                    time.sleep(0.1)
                code = proc.wait()
                results = [f.result() for f in streams + plain]
                long_status, long_events = long.result()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert ("/readyz", "refused") in answers and ("chat", "refused") in answers, answers
    status, retry_after, body = late_answer
    assert (status, retry_after, body["error"]["code"]) == (503, "1", "shutting_down"), body
    # what was in flight finished
    for status, events in results[:8]:
        assert status == 200 and events[-1] == "[DONE]", events
        assert not any("error" in e for e in events[:-1])
    for status, (body,) in results[8:]:
        assert status == 200 and body["usage"]["completion_tokens"] == SHORT, body
    # the long stream was ended at the deadline: an error event, then [DONE]; aborted at its worker
    assert long_status == 200 and long_events[-1] == "[DONE]", long_events
    assert long_events[-2]["error"]["code"] == "shutting_down", long_events[-2:]
    (long_rid,) = [b["rid"] for b in fake.received if b["sampling_params"]["max_new_tokens"] == LONG]
    assert long_rid in fake.aborted
    # each settled once: one request line per request, and the usage of all 13 (the long one charged
    # what was generated)
    lines = log_lines(log)
    served = [line for line in lines if line.get("event") == "request" and line.get("tenant") == "drainer"]
    assert len({line["request_id"] for line in served}) == len(served) == 14, served
    assert sorted(line["status"] for line in served) == [200] * 13 + [503]
    usage = redis.Redis.from_url(redis_url, decode_responses=True).hgetall(KeyLayout(prefix).usage("drainer"))
    assert (int(usage["requests"]), int(usage["errors"])) == (14, 1), usage
    generated = int(usage["completion_tokens"]) - 12 * SHORT - 2
    assert 1 <= generated < LONG, usage
    # the drain's start and end, with the counts, in each process
    started = [line for line in lines if line.get("event") == "drain_started"]
    finished = [line for line in lines if line.get("event") == "drain_finished"]
    assert len(started) == len(finished) == processes, text[-3000:]
    assert sum(line["in_flight"] for line in started) == 13
    assert all(line["signal"] == "SIGTERM" for line in started)
    assert sum(line["ended"] for line in finished) == 1
    assert all(line["in_flight"] == 0 for line in finished)
    assert all(DRAIN_S <= line["drain_s"] < DRAIN_S + 5 for line in finished if line["ended"])


async def test_signals_drain_first_a_second_sigterm_is_ignored_and_a_second_sigint_cuts_it_short() -> None:
    """The handlers of service/runtime/drain.py in this (main) thread: the first signal begins the drain, the
    handler installed before (uvicorn's: stop listening, shut down once the connections are closed) is
    called with it after shutdown.accept_for_s; a second SIGTERM (the
    parent passing it on to a process group signalled as a whole) changes nothing; a second SIGINT (Ctrl-C
    again) ends what is in flight at once."""
    calls: list[int] = []
    ended: list[str] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: calls.append(sig))
    previous_int = signal.signal(signal.SIGINT, lambda sig, frame: calls.append(sig))
    try:

        def end_all(error: GatewayError) -> int:
            ended.append(error.code)
            return 1

        drain = Drain(ShutdownSettings(drain_timeout_s=30.0, end_timeout_s=0.2), end_all)
        drain.enter()  # one request in flight, which never ends
        with drain_on_signals(drain):
            signal.raise_signal(signal.SIGTERM)
            await asyncio.sleep(0.05)
            assert drain.draining and not drain.finished
            signal.raise_signal(signal.SIGTERM)
            await asyncio.sleep(0.05)
            # the server was told to stop listening at once (shutdown.accept_for_s is 0), once
            assert ended == [] and calls == [signal.SIGTERM]
            signal.raise_signal(signal.SIGINT)
            await asyncio.wait_for(drain.wait(), 5)
            assert ended == ["shutting_down"] and calls == [signal.SIGTERM]
            signal.raise_signal(signal.SIGINT)  # after the drain: straight to the previous handler
            assert calls == [signal.SIGTERM, signal.SIGINT]
        assert signal.getsignal(signal.SIGTERM) is not None and drain.in_flight == 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


async def test_a_drain_with_nothing_in_flight_ends_at_once() -> None:
    stopped = asyncio.Event()
    drain = Drain(ShutdownSettings(drain_timeout_s=30.0), lambda e: 0)
    with capture_logs() as logs:
        assert drain.begin(stopped.set, "SIGTERM") and not drain.begin(stopped.set, "SIGTERM")
        await asyncio.wait_for(stopped.wait(), 1)
    assert [(e["event"], e["in_flight"]) for e in logs] == [("drain_started", 0), ("drain_finished", 0)]


async def test_the_port_closes_after_accept_for_s_and_the_drain_waits_for_open_connections() -> None:
    """shutdown.accept_for_s: the server is told to stop only that long after the signal (a balancer
    polling /readyz stops sending meanwhile); the drain is over once nothing is in flight and no client
    connection is open (an idle one closes at its next answer or its keep-alive timeout)."""
    stopped: list[float] = []
    loop = asyncio.get_running_loop()
    drain = Drain(ShutdownSettings(accept_for_s=0.3, drain_timeout_s=5.0), lambda e: 0)
    drain.connections = connections = {object()}
    began = loop.time()
    assert drain.begin(lambda: stopped.append(loop.time() - began), "SIGTERM")
    await asyncio.sleep(0.2)
    assert stopped == [] and drain.draining and not drain.refusing
    await asyncio.sleep(0.2)
    assert len(stopped) == 1 and 0.3 <= stopped[0] < 0.4
    drain.enter()  # a request on the connection that was open: served, the drain waits for it
    connections.clear()
    await asyncio.sleep(0.2)
    assert not drain.finished
    drain.leave()
    await asyncio.wait_for(drain.wait(), 1)
    assert drain.finished and len(stopped) == 1 and drain.in_flight == 0


async def test_requests_during_a_drain_close_their_connection() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    closing = closing_connection(send)
    await closing({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"x")]})
    await closing({"type": "http.response.body", "body": b"ok"})
    await closing({"type": "http.response.start", "status": 200, "headers": [(b"Connection", b"keep-alive")]})
    assert sent[0]["headers"] == [(b"content-type", b"x"), (b"connection", b"close")]
    assert sent[1] == {"type": "http.response.body", "body": b"ok"}
    assert sent[2]["headers"] == [(b"Connection", b"keep-alive")]  # an app's own choice is left as it is


def test_a_stopping_server_leaves_an_idle_connection_to_its_next_answer() -> None:
    """uvicorn's shutdown closes an idle keep-alive connection at once, under a client that may be sending
    on it (a reset, no answer); the gateway's protocol keeps it until its next answer (which closes it) or
    its keep-alive timeout, and closes a busy one once its answer is out, as uvicorn does."""
    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(app=noop_app, timeout_keep_alive=5)
        config.load()
        transports = []
        protocols = []
        for _ in range(3):
            proto = GatewayHttpToolsProtocol(config, ServerState(), {}, loop)
            transport = FakeTransport()
            proto.connection_made(transport)  # type: ignore[arg-type]
            protocols.append(proto)
            transports.append(transport)
        idle, busy, streaming = protocols
        busy.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert busy.cycle is not None and busy.cycle.keep_alive
        streaming.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert streaming.cycle is not None
        streaming.cycle.response_started = True  # its headers went out without Connection: close
        idle.shutdown()
        busy.shutdown()
        streaming.shutdown()
        assert not transports[0].closed and idle.timeout_keep_alive_task is not None
        assert busy.cycle.keep_alive is False  # its answer says Connection: close and closes it
        assert streaming.cycle.keep_alive is True  # kept open past its answer: its client was not told
        idle.data_received(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert idle.cycle is not None and idle.cycle.keep_alive is False  # its answer closes it
        for task in list(idle.tasks | busy.tasks | streaming.tasks):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()


def test_a_stream_in_flight_when_the_server_stops_leaves_its_connection_to_the_next_answer() -> None:
    """A stream whose headers went out before the drain carried no ``Connection: close``: its client takes
    the connection back for its next request as soon as the stream ends. uvicorn closed it right after the
    last chunk, so a request sent before the client saw the FIN met a reset (``ReadError``, 1 stream in
    1,000 of the rolling-restart test in about one CI run in four); the gateway's protocol keeps it open
    and answers the next request on it, with ``Connection: close``."""
    release = threading.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        if scope["path"] == "/stream":
            await send({"type": "http.response.body", "body": b"first", "more_body": True})
            await asyncio.to_thread(release.wait, 10)
        await send({"type": "http.response.body", "body": b"last"})

    def read_until(sock: socket.socket, end: bytes) -> bytes:
        data = b""
        while not data.endswith(end):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data

    with (
        ThreadedServer(app) as server,
        socket.create_connection((server.host, server.port), timeout=10) as sock,
    ):
        sock.sendall(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        head = read_until(sock, b"first\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower()
        server.server.should_exit = True  # uvicorn's shutdown: the port closes, then each connection's
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the port refused: shutdown() reached every connection
            try:
                socket.create_connection((server.host, server.port), timeout=1).close()
            except ConnectionRefusedError:
                break
            time.sleep(0.02)
        else:
            raise AssertionError("the server did not stop listening")
        release.set()
        assert read_until(sock, b"0\r\n\r\n").endswith(b"last\r\n0\r\n\r\n")
        time.sleep(0.3)  # past the moment uvicorn closed the connection
        sock.sendall(b"GET /plain HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = read_until(sock, b"\0")  # to the server's close
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert b"connection: close" in answer.lower() and answer.endswith(b"last\r\n0\r\n\r\n")


class FakeTransport:
    """Enough of an asyncio transport for uvicorn's protocol (nothing is sent anywhere)."""

    def __init__(self) -> None:
        self.closed = False
        self.written: list[bytes] = []

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}.get(name, default)

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_protocol(self, protocol: object) -> None:
        pass


async def noop_app(scope: Any, receive: Any, send: Any) -> None:
    """An ASGI app that answers nothing (the protocol test cancels its tasks)."""

"""A fake SGLang worker for the gateway's error-path tests (not a model: fixed words).

Speaks ``/generate`` (stream and non-stream, SGLang's SSE: cumulative ``text`` and ``output_ids``, or
deltas when its ``server_info`` says ``incremental_streaming_output``), ``/health``, ``/server_info``
(404 while ``server_info`` is None) and ``/abort_request`` (a non-streamed answer still being generated
ends at once, as SGLang answers a running request it aborted: the words so far and their counts).
Its ``mode`` makes it answer 500, or break a
stream after some chunks; ``poison`` makes it answer 500 to the requests that carry a marker only (a
request that crashes the engine while the worker stays healthy); ``reject`` makes it refuse every request
with a 4xx the way SGLang does (``reject_style``). Every request body it receives is kept in ``received``
so tests can assert that bad input never reached it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
TOKENS = [w if i == 0 else " " + w for i, w in enumerate(WORDS)]  # the answer, token by token


class FakeWorker:
    """State and behaviour of the fake worker.

    Attributes:
        mode: ``"ok"``, ``"error500"``, ``"break_after_2"`` (stream dies after 2 chunks) or
            ``"hang_after_2"`` (stream goes silent after 2 chunks, its connection open: a hung engine).
        received: bodies of ``/generate`` calls.
        aborted: rids passed to ``/abort_request``.
        delay_s: pause per generated word (between streamed chunks; summed for non-streamed answers).
        deep_status: status of ``/health_generate`` (500 anyway in mode ``"error500"``).
        deep_probes: ``/health_generate`` calls received.
        server_info: the ``/server_info`` body (SGLang's names), or None to answer 404.
        info_requests: how many times ``/server_info`` was asked.
        tokens: the texts of the tokens it answers with (token id = position), at most this many.
        up: False makes ``/health`` answer 503 (a worker restarting).
        finish: the finish reason of a complete answer: ``"length"`` (default) or ``"stop"`` (an end of
            turn, as a model that answered in fewer tokens than allowed).
        cached_tokens: the prompt tokens it reports as served from its prefix cache (0).
        poison: a marker; a ``/generate`` whose JSON body contains it answers 500 ``{"error": {"message":
            poison_message}}`` (health and other requests stay fine). None: off.
        poison_message: the text of that 500.
        reject: an error text; when set, every ``/generate`` is refused with it, as SGLang refuses bad
            input: ``reject_style`` ``"status"`` answers 400 ``{"error": {"message"}}``; ``"abort"``
            answers 200 with ``finish_reason = {"type": "abort", "message", "status_code": 400}`` (a
            grammar it cannot compile), as the only chunk when streamed; ``"event"`` (streams only; else as
            ``"status"``) sends the error event ``{"error": {"message", "code": reject_status}}``;
            ``"token500"`` is SGLang's answer to a grammar that admits no token: 500 ``{"object": "error",
            "message"}``, and when streamed a first token with no text, then an abort with ``status_code``
            500.
        reject_status: the status of a ``"status"`` refusal (400; e.g. 404 for a server without
            ``/generate``, 401 for SGLang's API-key check).
        markers: texts to count requests by: a ``/generate`` call whose body holds one is in flight under
            it (``in_flight``, highest so far in ``peak_in_flight``) from its arrival until its last
            token is sent (or it ends otherwise), as the worker sees it.
    """

    def __init__(self) -> None:
        self.url = ""  # set while served (:func:`served_fake_worker`)
        self.mode = "ok"
        self.received: list[dict[str, Any]] = []
        self.aborted: list[str] = []
        self.delay_s = 0.0
        self.deep_probes = 0
        self.deep_status = 200
        self.server_info: dict[str, Any] | None = None
        self.info_requests = 0
        self.tokens = list(TOKENS)
        self.up = True
        self.finish = "length"
        self.cached_tokens = 0
        self._running: dict[str, asyncio.Event] = {}  # rid -> set by /abort_request (non-streamed)
        self.poison: str | None = None
        self.poison_message = "boom"
        self.reject: str | None = None
        self.reject_style = "status"
        self.reject_status = 400
        self.markers: list[str] = []
        self.in_flight: collections.Counter[str] = collections.Counter()
        self.peak_in_flight: collections.Counter[str] = collections.Counter()
        self.app = Starlette(
            routes=[
                Route("/generate", self.generate, methods=["POST"]),
                Route("/server_info", self.info),
                Route("/health", self.health),
                Route("/health_generate", self.health_generate),
                Route("/abort_request", self.abort, methods=["POST"]),
            ]
        )

    async def health(self, _: Request) -> Response:
        return Response(status_code=200 if self.up else 503)

    async def info(self, _: Request) -> Response:
        self.info_requests += 1
        if self.server_info is None:
            return Response(status_code=404)
        return JSONResponse(self.server_info)

    async def health_generate(self, _: Request) -> Response:
        self.deep_probes += 1
        return Response(status_code=500 if self.mode == "error500" else self.deep_status)

    async def abort(self, request: Request) -> Response:
        rid = (await request.json())["rid"]
        self.aborted.append(rid)
        if rid in self._running:
            self._running[rid].set()
        return Response(status_code=200)

    def _meta(self, body: dict[str, Any], n: int, done: bool) -> dict[str, Any]:
        limit = body["sampling_params"]["max_new_tokens"]
        reason = (
            {"type": "length", "length": limit} if self.finish == "length" or n >= limit else {"type": "stop"}
        )
        return {
            "id": body.get("rid"),
            "prompt_tokens": len(body["input_ids"]) if "input_ids" in body else len(body["text"].split()),
            "completion_tokens": n,
            "cached_tokens": self.cached_tokens,
            "finish_reason": reason if done else None,
        }

    def _rejection(self, body: dict[str, Any]) -> Response:
        assert self.reject is not None
        stream = bool(body.get("stream"))
        if self.reject_style == "abort":
            meta = {
                **self._meta(body, 0, False),
                "finish_reason": {"type": "abort", "message": self.reject, "status_code": 400},
            }
            payload = {"text": "", "output_ids": [], "meta_info": meta}
            if not stream:
                return JSONResponse(payload)
            events = [f"data: {json.dumps(payload)}\n\n".encode(), b"data: [DONE]\n\n"]
            return StreamingResponse(iter(events), media_type="text/event-stream")
        if self.reject_style == "token500":
            if not stream:
                error = {"object": "error", "message": self.reject, "type": "500", "param": None, "code": 500}
                return JSONResponse(error, status_code=500)
            first: dict[str, Any] = {"text": "", "output_ids": [0], "meta_info": self._meta(body, 1, False)}
            meta = {
                **self._meta(body, 2, False),
                "finish_reason": {"type": "abort", "message": self.reject, "status_code": 500},
            }
            aborted = {"text": "", "output_ids": [0], "meta_info": meta}
            events = [f"data: {json.dumps(e)}\n\n".encode() for e in (first, aborted)] + [b"data: [DONE]\n\n"]
            return StreamingResponse(iter(events), media_type="text/event-stream")
        if self.reject_style == "event" and stream:
            error: dict[str, Any] = {
                "error": {"message": self.reject, "type": "invalid_request_error", "code": self.reject_status}
            }
            events = [f"data: {json.dumps(error)}\n\n".encode(), b"data: [DONE]\n\n"]
            return StreamingResponse(iter(events), media_type="text/event-stream")
        return JSONResponse({"error": {"message": self.reject}}, status_code=self.reject_status)

    async def generate(self, request: Request) -> Response:
        raw = await request.body()
        visit = _Visit(self, [m for m in self.markers if m.encode() in raw])
        try:
            return await self._generate(raw, visit)
        finally:
            if not visit.streaming:  # answered whole: done at the worker
                visit.end()

    async def _generate(self, raw: bytes, visit: _Visit) -> Response:
        """``/generate``; a token stream takes over ``visit`` and ends it before its last token goes out
        (the request is done at the worker before the gateway can see it done), or when it stops
        otherwise."""
        body = json.loads(raw)
        self.received.append(body)
        if self.mode == "error500":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if self.poison is not None and self.poison in raw.decode():
            return JSONResponse({"error": {"message": self.poison_message}}, status_code=500)
        if self.reject is not None:
            return self._rejection(body)
        tokens = self.tokens
        n = min(body["sampling_params"]["max_new_tokens"], len(tokens))
        if not body.get("stream"):
            meta_done = True
            if self.delay_s:
                rid = str(body.get("rid"))
                aborted = self._running[rid] = asyncio.Event()
                loop = asyncio.get_running_loop()
                started = loop.time()
                try:
                    await asyncio.wait_for(aborted.wait(), self.delay_s * n)
                    n = min(n, int((loop.time() - started) / self.delay_s))  # words done before the abort
                    meta_done = False
                except TimeoutError:
                    pass
                finally:
                    self._running.pop(rid, None)
            text = "".join(tokens[:n])
            meta = self._meta(body, n, True)
            if not meta_done:
                meta["finish_reason"] = {"type": "abort", "message": "Aborted", "status_code": None}
            return JSONResponse({"text": text, "output_ids": list(range(n)), "meta_info": meta})
        incremental = bool((self.server_info or {}).get("incremental_streaming_output"))

        async def events() -> AsyncIterator[bytes]:
            try:
                async for event in token_events():
                    yield event
            finally:
                visit.end()

        async def token_events() -> AsyncIterator[bytes]:
            for i in range(1, n + 1):
                if self.mode == "break_after_2" and i > 2:
                    raise RuntimeError("worker died")
                if self.mode == "hang_after_2" and i > 2:
                    await asyncio.sleep(3600)
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if incremental:  # SGLang --incremental-streaming-output: deltas
                    text, ids = tokens[i - 1], [i - 1]
                else:
                    text, ids = "".join(tokens[:i]), list(range(i))
                payload = {"text": text, "output_ids": ids, "meta_info": self._meta(body, i, i == n)}
                if i == n:
                    visit.end()
                yield f"data: {json.dumps(payload)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        visit.streaming = True
        return StreamingResponse(events(), media_type="text/event-stream")


class _Visit:
    """One ``/generate`` call, counted in flight under ``markers`` of ``worker`` until :meth:`end`."""

    def __init__(self, worker: FakeWorker, markers: list[str]) -> None:
        self._worker = worker
        self._markers = markers
        self._ended = False
        self.streaming = False  # a token stream ends it itself
        for marker in markers:
            worker.in_flight[marker] += 1
            worker.peak_in_flight[marker] = max(worker.peak_in_flight[marker], worker.in_flight[marker])

    def end(self) -> None:
        """Count it done (once, however often it is called)."""
        if not self._ended:
            self._ended = True
            for marker in self._markers:
                self._worker.in_flight[marker] -= 1


@contextlib.contextmanager
def served_fake_worker() -> Iterator[FakeWorker]:
    """A :class:`FakeWorker` served on a free local port (its ``url`` set) until the block ends."""
    from tests.support.servers import ThreadedServer

    worker = FakeWorker()
    with ThreadedServer(worker.app) as server:
        worker.url = server.url
        yield worker

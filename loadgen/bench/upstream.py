"""An instant fake SGLang worker for the gateway benchmark: raw asyncio HTTP/1.1, microseconds a request.

Not a model and not the simulator (:mod:`loadgen.sim` models engine time; this answers at once). It
speaks just enough of SGLang's HTTP API for radixgate, sglang-router and LiteLLM:

- ``POST /generate`` (SGLang native): non-streamed ``{"text", "output_ids", "meta_info"}``; streamed as
  SSE ``data: {...}`` events, one per token, ended by ``data: [DONE]``: with cumulative ``text`` and
  ``output_ids`` as SGLang sends them by default, or only each token's own (``--incremental``, as SGLang's
  ``--incremental-streaming-output``, which ``/server_info`` then reports). ``meta_info`` carries ``id``,
  ``finish_reason`` (``{"type": "length", "length": n}`` or ``{"type": "stop", "matched": 2}``),
  ``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``e2e_latency``
  (``sglang/srt/managers/tokenizer_manager.py``).
- ``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI shape, streamed or not; the routes
  sglang-router forwards and LiteLLM calls).
- ``GET /health``, ``/health_generate``, ``/metrics`` (idle load), ``/get_server_info``,
  ``/get_model_info``, ``/v1/models``; ``POST /abort_request``, ``/flush_cache``.
- ``GET /_bench/stats``: requests served by path and connections accepted (the benchmark reads it to
  count upstream calls and connection churn per gateway request).

Every answer has ``min(max_new_tokens, max_tokens_cap)`` tokens (``max_tokens`` for the OpenAI routes,
default 16). A stream writes all its events in one ``write`` (HTTP/1.1 chunked, one chunk per event).
Prompt tokens are counted as ``len(text) // 4 + 1`` (no tokenizer). Bodies of repeated shapes are
rendered once and cached, so a request costs a JSON parse and a few byte joins.

Run: ``python -m loadgen.bench.upstream --port 31000 [--incremental]`` (uses uvloop when installed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")
RID = b'"__RID__"'
"""Placeholder for the request id in cached response templates."""
_MAX_HEAD = 65536
_MAX_CACHE = 512

Response = bytes


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _response(
    status: int, body: bytes, content_type: bytes = b"application/json", close: bool = False
) -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed"}.get(status, b"")
    head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n" % (
        status,
        reason,
        content_type,
        len(body),
    )
    return head + (b"connection: close\r\n\r\n" if close else b"\r\n") + body


def _chunked(events: list[bytes]) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    parts = [head]
    for event in events:
        parts.append(b"%x\r\n%s\r\n" % (len(event), event))
    parts.append(b"0\r\n\r\n")
    return b"".join(parts)


def _tokens(n: int) -> tuple[list[str], list[int]]:
    """Cumulative texts and the ids of ``n`` output tokens."""
    texts, text = [], ""
    for i in range(n):
        text += ("" if i == 0 else " ") + WORDS[i % len(WORDS)]
        texts.append(text)
    return texts, list(range(1000, 1000 + n))


class FakeSGLang:
    """Request handling of the fake worker (no I/O; :class:`_Connection` does the HTTP).

    Args:
        model: model id reported by ``/get_model_info`` and ``/v1/models``.
        max_tokens_cap: most tokens one answer has.
        default_max_tokens: tokens of an OpenAI request that gives no ``max_tokens``.
        incremental: stream ``/generate`` as ``--incremental-streaming-output`` does (each event only its
            new text and ids) and say so in ``/server_info``.
    """

    def __init__(
        self,
        model: str = "bench-model",
        max_tokens_cap: int = 4096,
        default_max_tokens: int = 16,
        incremental: bool = False,
        served_model_name: str | None = None,
    ):
        self.model = model
        self.served_model_name = served_model_name or model
        self.incremental = incremental
        self.max_tokens_cap = max_tokens_cap
        self.default_max_tokens = default_max_tokens
        self.requests: Counter[str] = Counter()
        self.connections = 0
        self._cache: dict[tuple[Any, ...], Any] = {}
        self._started = time.time()
        self._routes: dict[tuple[bytes, bytes], Callable[[bytes], bytes]] = {
            (b"POST", b"/generate"): self.generate,
            (b"POST", b"/v1/chat/completions"): self.chat,
            (b"POST", b"/v1/completions"): self.completions,
            (b"POST", b"/abort_request"): self._ok,
            (b"POST", b"/flush_cache"): self._ok,
            (b"GET", b"/health"): self._ok,
            (b"GET", b"/health_generate"): self._ok,
            (b"GET", b"/metrics"): self.metrics,
            (b"GET", b"/get_server_info"): self.server_info,
            (b"GET", b"/server_info"): self.server_info,
            (b"GET", b"/get_model_info"): self.model_info,
            (b"GET", b"/model_info"): self.model_info,
            (b"GET", b"/v1/models"): self.models,
            (b"GET", b"/_bench/stats"): self.stats,
        }

    def handle(self, method: bytes, target: bytes, body: bytes) -> bytes:
        """The full HTTP response (status line to body) for one request."""
        path = target.split(b"?", 1)[0]
        handler = self._routes.get((method, path))
        if handler is None:
            return _response(404, b'{"error":{"message":"not found"}}')
        self.requests[path.decode()] += 1
        try:
            return handler(body)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return _response(400, _dumps({"error": {"message": f"bad request: {exc}"}}))

    def _cached(self, key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
        found = self._cache.get(key)
        if found is None:
            if len(self._cache) >= _MAX_CACHE:
                self._cache.clear()
            found = self._cache[key] = build()
        return found

    def _ok(self, _: bytes) -> bytes:
        return _response(200, b"", b"text/plain")

    def metrics(self, _: bytes) -> bytes:
        text = (
            "# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 0.0\n"
            "# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs 0.0\n"
            "# TYPE sglang:token_usage gauge\nsglang:token_usage 0.0\n"
        )
        return _response(200, text.encode(), b"text/plain; version=0.0.4")

    def model_info(self, _: bytes) -> bytes:
        return _response(
            200, _dumps({"model_path": self.model, "tokenizer_path": None, "is_generation": True})
        )

    def server_info(self, _: bytes) -> bytes:
        info = {
            "model_path": self.model,
            "served_model_name": self.served_model_name,
            "tokenizer_path": None,
            "version": "0.0.0-fake",
            "tp_size": 1,
            "dp_size": 1,
            "max_total_num_tokens": 1 << 20,
            "incremental_streaming_output": self.incremental,
            "internal_states": [{"last_gen_throughput": 0.0}],
        }
        return _response(200, _dumps(info))

    def models(self, _: bytes) -> bytes:
        data = {
            "id": self.served_model_name,
            "object": "model",
            "created": int(self._started),
            "owned_by": "fake",
        }
        return _response(200, _dumps({"object": "list", "data": [data]}))

    def stats(self, _: bytes) -> bytes:
        return _response(200, _dumps({"requests": dict(self.requests), "connections": self.connections}))

    # --- SGLang native /generate ------------------------------------------------------------------

    def generate(self, body: bytes) -> bytes:
        req = json.loads(body)
        params = req.get("sampling_params") or {}
        limit = int(params.get("max_new_tokens") or 128)
        n = max(1, min(limit, self.max_tokens_cap))
        text = req.get("text")
        prompt_tokens = len(text) // 4 + 1 if isinstance(text, str) else len(req.get("input_ids") or ()) or 1
        rid = _dumps(req.get("rid") or "fake")
        if req.get("stream"):
            events = self._cached(
                ("gs", n, limit, prompt_tokens), lambda: self._generate_events(n, limit, prompt_tokens)
            )
            return _chunked([e.replace(RID, rid) for e in events])
        tmpl = self._cached(
            ("g", n, limit, prompt_tokens), lambda: self._generate_body(n, limit, prompt_tokens)
        )
        return _response(200, tmpl.replace(RID, rid))

    @staticmethod
    def _meta(i: int, n: int, limit: int, prompt_tokens: int) -> dict[str, Any]:
        done = i == n
        reason = None
        if done:
            reason = {"type": "length", "length": limit} if n >= limit else {"type": "stop", "matched": 2}
        return {
            "id": "__RID__",
            "finish_reason": reason,
            "prompt_tokens": prompt_tokens,
            "weight_version": "default",
            "completion_tokens": i,
            "cached_tokens": 0,
            "e2e_latency": 0.0001,
        }

    def _generate_body(self, n: int, limit: int, prompt_tokens: int) -> bytes:
        texts, ids = _tokens(n)
        return _dumps(
            {"text": texts[-1], "output_ids": ids, "meta_info": self._meta(n, n, limit, prompt_tokens)}
        )

    def _generate_events(self, n: int, limit: int, prompt_tokens: int) -> list[bytes]:
        texts, ids = _tokens(n)
        events = []
        for i in range(1, n + 1):
            text, new_ids = texts[i - 1], ids[:i]
            if self.incremental:
                text, new_ids = text[len(texts[i - 2]) if i > 1 else 0 :], ids[i - 1 : i]
            payload = {
                "text": text,
                "output_ids": new_ids,
                "meta_info": self._meta(i, n, limit, prompt_tokens),
            }
            events.append(b"data: " + _dumps(payload) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        return events

    # --- OpenAI routes (what sglang-router forwards and LiteLLM calls) ----------------------------

    def chat(self, body: bytes) -> bytes:
        req = json.loads(body)
        prompt_chars = sum(len(str(m.get("content") or "")) for m in req.get("messages") or ())
        return self._openai(req, "chat.completion", prompt_chars // 4 + 1)

    def completions(self, body: bytes) -> bytes:
        req = json.loads(body)
        return self._openai(req, "text_completion", len(str(req.get("prompt") or "")) // 4 + 1)

    def _openai(self, req: dict[str, Any], kind: str, prompt_tokens: int) -> bytes:
        limit = int(req.get("max_tokens") or req.get("max_completion_tokens") or self.default_max_tokens)
        n = max(1, min(limit, self.max_tokens_cap))
        model = str(req.get("model") or self.model)
        usage = bool((req.get("stream_options") or {}).get("include_usage"))
        key = (kind, bool(req.get("stream")), usage, n, limit, prompt_tokens, model)
        return self._cached(key, lambda: self._openai_answer(key))  # type: ignore[no-any-return]

    @staticmethod
    def _openai_answer(key: tuple[Any, ...]) -> bytes:
        kind, stream, usage_wanted, n, limit, prompt_tokens, model = key
        texts, _ = _tokens(n)
        finish = "length" if n >= limit else "stop"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        chat = kind == "chat.completion"
        common = {"id": "cmpl-fake", "created": int(time.time()), "model": model}
        if not stream:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": texts[-1]}
            else:
                choice["text"] = texts[-1]
            return _response(200, _dumps({**common, "object": kind, "choices": [choice], "usage": usage}))
        obj = "chat.completion.chunk" if chat else "text_completion"
        events = []
        previous = ""
        for i, text in enumerate(texts):
            piece, previous = text[len(previous) :], text
            if chat:
                delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
                choice = {"index": 0, "delta": delta, "finish_reason": None, "logprobs": None}
            else:
                choice = {"index": 0, "text": piece, "finish_reason": None, "logprobs": None}
            events.append(b"data: " + _dumps({**common, "object": obj, "choices": [choice]}) + b"\n\n")
        last: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if chat:
            last["delta"] = {}
        else:
            last["text"] = ""
        events.append(b"data: " + _dumps({**common, "object": obj, "choices": [last]}) + b"\n\n")
        if usage_wanted:
            events.append(
                b"data: " + _dumps({**common, "object": obj, "choices": [], "usage": usage}) + b"\n\n"
            )
        events.append(b"data: [DONE]\n\n")
        return _chunked(events)


def _dechunk(data: bytes | bytearray, start: int) -> tuple[bytes, int] | None:
    """Decode an HTTP/1.1 chunked body starting at ``start``; (body, end offset) or None if incomplete."""
    out: list[bytes] = []
    pos = start
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(data[pos:eol]).split(b";", 1)[0], 16)
        pos = eol + 2
        if size == 0:
            end = data.find(b"\r\n\r\n", pos - 2)
            return (b"".join(out), end + 4) if end >= 0 else None
        if len(data) < pos + size + 2:
            return None
        out.append(bytes(data[pos : pos + size]))
        pos += size + 2


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: parses pipelined requests and writes whole responses."""

    def __init__(self, app: FakeSGLang) -> None:
        self.app = app
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.app.connections += 1

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while self.transport is not None:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                if len(self.buf) > _MAX_HEAD:
                    self._fail()
                return
            lines = bytes(self.buf[:head_end]).split(b"\r\n")
            try:
                method, target, version = lines[0].split(b" ", 2)
            except ValueError:
                self._fail()
                return
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
            start = head_end + 4
            if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
                decoded = _dechunk(self.buf, start)
                if decoded is None:
                    return
                body, end = decoded
            else:
                length = int(headers.get(b"content-length", b"0") or 0)
                end = start + length
                if len(self.buf) < end:
                    return
                body = bytes(self.buf[start:end])
            del self.buf[:end]
            conn = headers.get(b"connection", b"").lower()
            close = conn == b"close" or (version == b"HTTP/1.0" and conn != b"keep-alive")
            self.transport.write(self.app.handle(method, target, body))
            if close:
                self.transport.close()
                self.transport = None

    def _fail(self) -> None:
        if self.transport is not None:
            self.transport.write(_response(400, b"", close=True))
            self.transport.close()
            self.transport = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def serve(app: FakeSGLang, host: str, port: int) -> asyncio.Server:
    """Start listening (``SO_REUSEADDR``, backlog 1024); the caller keeps the server open."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: _Connection(app), host, port, backlog=1024, reuse_address=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m loadgen.bench.upstream``: serve until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="bench-model", help="model path (a tokenizer folder)")
    parser.add_argument(
        "--served-model-name", default=None, help="the name it serves the model under (default: --model)"
    )
    parser.add_argument("--max-tokens-cap", type=int, default=4096)
    parser.add_argument("--incremental", action="store_true", help="stream /generate as deltas")
    args = parser.parse_args(argv)
    app = FakeSGLang(
        args.model,
        args.max_tokens_cap,
        incremental=args.incremental,
        served_model_name=args.served_model_name,
    )

    async def run() -> None:
        server = await serve(app, args.host, args.port)
        async with server:
            await server.serve_forever()

    try:
        import uvloop

        runner: Callable[[Any], Any] = uvloop.run
    except ImportError:
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(run())


if __name__ == "__main__":
    main()

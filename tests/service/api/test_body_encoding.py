"""Compressed request bodies (issue 25, item 6): ``Content-Encoding`` is honoured or refused on every route
that takes a body, with the gateway in front of the fake worker (``max_body_bytes`` 65536, conftest).

gzip and deflate (zlib and raw) are decoded, the size bound applied to the decoded bytes (a small bomb gets
413 without being decoded whole), a corrupt stream gets 400, an unknown coding 415; nothing is charged."""

from __future__ import annotations

import gzip
import json
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from service.api.body_encoding import BodyDecoder, parse_codings
from service.api.errors import APIError
from tests.conftest import MODEL
from tests.service.api.test_api import ADMIN, assert_openai_error, auth, chat, new_tenant, usage_of
from tests.support.fake_worker import WORDS, FakeWorker

LIMIT = 65536  # the conftest gateway's api.max_body_bytes


@pytest.fixture
def http(gateway: str, fake: tuple[FakeWorker, str]) -> Iterator[httpx.Client]:
    fake[0].mode, fake[0].delay_s = "ok", 0.0
    with httpx.Client(base_url=gateway, timeout=30) as client:
        yield client


def raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


def body(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload).encode()


def post(
    http: httpx.Client, path: str, content: bytes, encoding: str | None, headers: dict[str, str]
) -> httpx.Response:
    sent = {**headers, "Content-Type": "application/json"}
    if encoding is not None:
        sent["Content-Encoding"] = encoding
    return http.post(path, content=content, headers=sent)


CODINGS: list[tuple[str, Callable[[bytes], bytes]]] = [
    ("gzip", gzip.compress),
    ("GZIP", gzip.compress),
    ("x-gzip", gzip.compress),
    ("deflate", zlib.compress),  # zlib format (RFC 1950), as the standard says
    ("Deflate", raw_deflate),  # raw deflate (RFC 1951), as some clients send it
    ("identity", lambda b: b),
    ("gzip, deflate", lambda b: zlib.compress(gzip.compress(b))),  # gzip applied first
    ("identity, gzip", gzip.compress),
    ("gzip", lambda b: gzip.compress(b[:10]) + gzip.compress(b[10:])),  # two gzip members
]


@pytest.mark.parametrize(("encoding", "pack"), CODINGS, ids=[f"{e}-{i}" for i, (e, _) in enumerate(CODINGS)])
def test_an_encoded_chat_body_is_decoded_and_served(
    http: httpx.Client, encoding: str, pack: Callable[[bytes], bytes]
) -> None:
    tenant_id, key = new_tenant(http)
    resp = post(http, "/v1/chat/completions", pack(body(chat(max_tokens=3))), encoding, auth(key))
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == " ".join(WORDS[:3])
    assert usage_of(http, tenant_id)["requests"] == 1


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "hello there", "max_tokens": 2}),
        ("/v1/responses", {"model": MODEL, "input": "hello there", "max_output_tokens": 2}),
    ],
)
def test_every_completion_route_decodes_gzip(http: httpx.Client, path: str, payload: dict[str, Any]) -> None:
    _, key = new_tenant(http)
    resp = post(http, path, gzip.compress(body(payload)), "gzip", auth(key))
    assert resp.status_code == 200, resp.text
    refused = post(http, path, body(payload), "br", auth(key))
    assert_openai_error(refused, 415, "unsupported_content_encoding")


class GzipRequests(httpx.BaseTransport):
    """An httpx transport that sends every request body gzipped (``Content-Encoding: gzip``)."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.sent = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        raw = request.read()
        if raw:
            headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
            packed = gzip.compress(raw)
            request = httpx.Request(
                request.method,
                request.url,
                headers=[*headers, (b"Content-Encoding", b"gzip")],
                content=packed,
                extensions=request.extensions,
            )
            self.sent += 1
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_the_openai_client_sends_gzipped_bodies_streamed_and_not(http: httpx.Client, gateway: str) -> None:
    tenant_id, key = new_tenant(http)
    transport = GzipRequests()
    with httpx.Client(transport=transport, timeout=30) as gzipping:
        client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, http_client=gzipping)
        messages: Any = [{"role": "user", "content": "hello there"}]
        done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        assert done.choices[0].message.content == " ".join(WORDS[:3])
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == " ".join(WORDS[:4])
    assert transport.sent == 2
    usage = usage_of(http, tenant_id)
    assert usage["requests"] == 2 and usage["completion_tokens"] == 7


def test_the_size_bound_is_on_the_decoded_body(http: httpx.Client) -> None:
    """A body of exactly ``max_body_bytes`` once decoded passes, one byte more is 413, whatever its
    compressed size (both are a few hundred bytes of gzip)."""
    _, key = new_tenant(http)
    raw = body(chat(max_tokens=2))
    exact = raw[:-1] + b" " * (LIMIT - len(raw)) + b"}"
    assert len(exact) == LIMIT
    assert post(http, "/v1/chat/completions", gzip.compress(exact), "gzip", auth(key)).status_code == 200
    over = exact[:-1] + b" }"
    resp = post(http, "/v1/chat/completions", gzip.compress(over), "gzip", auth(key))
    assert "once decoded" in assert_openai_error(resp, 413, "request_too_large")["message"]
    resp = post(http, "/v1/chat/completions", zlib.compress(over), "deflate", auth(key))
    assert_openai_error(resp, 413, "request_too_large")


def test_a_gzip_bomb_gets_413_without_being_decoded_whole(http: httpx.Client) -> None:
    """10 MB of zeros in under 20 KB of gzip: 413 after at most ``max_body_bytes + 1`` decoded bytes. The
    gateway runs in this process (a thread), so tracemalloc sees what it allocates: far less than the
    10 MB that decoding it whole takes."""
    tenant_id, key = new_tenant(http, quotas={"requests_per_min": 1})
    bomb = gzip.compress(bytes(10_000_000), 9)
    assert len(bomb) < 20_000
    http.get("/healthz")  # the connection is open before measuring
    tracemalloc.start()
    try:
        resp = post(http, "/v1/chat/completions", bomb, "gzip", auth(key))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert_openai_error(resp, 413, "request_too_large")
    assert peak < 2_000_000, peak
    # nothing charged: the tenant's only request of the minute still passes
    again = post(http, "/v1/chat/completions", gzip.compress(body(chat())), "gzip", auth(key))
    assert again.status_code == 200
    assert usage_of(http, tenant_id)["requests"] == 1


CORRUPT = {
    "not-gzip": ("gzip", body(chat())),
    "gzip-truncated": ("gzip", gzip.compress(body(chat()))[:-6]),
    "gzip-corrupt-middle": ("gzip", gzip.compress(body(chat()))[:30] + b"\x00garbage" * 4),
    "gzip-trailing-garbage": ("gzip", gzip.compress(body(chat())) + b"trailing"),
    "deflate-truncated": ("deflate", zlib.compress(body(chat()))[:-3]),
    "deflate-bytes-after-end": ("deflate", zlib.compress(body(chat())) + b"x"),
    "deflate-one-byte": ("deflate", b"\x78"),
    "inner-layer-not-gzip": ("gzip, deflate", zlib.compress(body(chat()))),
}


@pytest.mark.parametrize(("encoding", "content"), CORRUPT.values(), ids=CORRUPT.keys())
def test_a_corrupt_stream_gets_400_and_charges_nothing(
    http: httpx.Client, encoding: str, content: bytes
) -> None:
    tenant_id, key = new_tenant(http, quotas={"requests_per_min": 1})
    resp = post(http, "/v1/chat/completions", content, encoding, auth(key))
    assert_openai_error(resp, 400, "invalid_content_encoding")
    assert post(http, "/v1/chat/completions", body(chat()), None, auth(key)).status_code == 200
    assert usage_of(http, tenant_id)["requests"] == 1


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "BR", "gzip, br", "snappy", "gzip," * 5])
def test_an_unknown_coding_gets_415_and_charges_nothing(http: httpx.Client, encoding: str) -> None:
    tenant_id, key = new_tenant(http, quotas={"requests_per_min": 1})
    # a plain body: taken as if not encoded before the fix
    resp = post(http, "/v1/chat/completions", body(chat()), encoding, auth(key))
    assert_openai_error(resp, 415, "unsupported_content_encoding")
    assert resp.headers["accept-encoding"] == "gzip, deflate"
    assert post(http, "/v1/chat/completions", body(chat()), "identity", auth(key)).status_code == 200
    assert usage_of(http, tenant_id)["requests"] == 1


def test_admin_routes_decode_and_refuse_codings_too(http: httpx.Client) -> None:
    spec = {"id": "gz-tenant", "name": "gzipped"}
    created = post(http, "/admin/tenants", gzip.compress(body(spec)), "gzip", ADMIN)
    assert created.status_code == 201, created.text
    assert created.json()["name"] == "gzipped"
    patched = post(http, "/admin/tenants/gz-tenant/keys", raw_deflate(body({"name": "k"})), "deflate", ADMIN)
    assert patched.status_code == 201 and patched.json()["name"] == "k"
    refused = post(http, "/admin/tenants", body({"id": "br-tenant", "name": "x"}), "br", ADMIN)
    assert_openai_error(refused, 415, "unsupported_content_encoding")
    assert_openai_error(http.get("/admin/tenants/br-tenant", headers=ADMIN), 404)
    broken = post(http, "/admin/tenants", gzip.compress(body(spec))[:-4], "gzip", ADMIN)
    assert_openai_error(broken, 400, "invalid_content_encoding")
    bomb = post(http, "/admin/workers", gzip.compress(bytes(1_000_000)), "gzip", ADMIN)
    assert_openai_error(bomb, 413, "request_too_large")


def test_the_decoder_gives_the_same_bytes_for_any_chunking() -> None:
    """Chunks of any size, one byte included (the deflate kind is told from its first two bytes)."""
    data = body(chat("word " * 500))
    for encoding, pack in CODINGS:
        packed = pack(data)
        for step in (1, 2, 3, 64, len(packed)):
            decoder = BodyDecoder(parse_codings([encoding]), LIMIT)
            out = b"".join(decoder.feed(packed[i : i + step]) for i in range(0, len(packed), step))
            assert out + decoder.finish() == data, (encoding, step)
    with pytest.raises(APIError) as over:
        decoder = BodyDecoder(["gzip"], len(data) - 1)
        decoder.feed(gzip.compress(data))
        decoder.finish()
    assert over.value.status == 413

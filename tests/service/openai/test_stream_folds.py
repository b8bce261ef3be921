"""A streamed answer adds up to the same answer not streamed, for chat, completions and Responses (issue 25).

A table of model texts: text before, between and after tool calls, several calls, a call of a function
that was not declared, and texts cut by ``max_tokens`` inside a marker, inside a call and after one; for
each tool-call format the gateway serves (``api.tool_call_format``). Each text is cut into stream pieces
at every boundary (in two at each one, where a piece then holds a marker's end and the text after it:
the Responses stream put that text into the message before the call), one character a piece, and in
pieces of a few characters from every offset. The stream is folded (:mod:`tests.support.folds`) and
compared with the non-streamed answer of the same pieces, ids and timestamps aside; a Responses stream's
``response.completed.output`` must be the items its events built, in the order the model wrote them: a
message, the call, a new message for the text after it (OpenAI's Responses API).

Two levels: the gateway's shapers fed directly (every cut of every text, in milliseconds), and the real
gateway in front of the fake worker scripted to write the text in those pieces (SSE, the worker client,
coalesced writes; the cheaper set of cuts that still puts every boundary between two pieces).
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.openai.choices import ChoiceState, OutputSpec
from service.openai.responses import ResponsesShaper
from service.openai.shapes import ChatShaper, Shaper, TextShaper
from service.openai.tool_formats import FORMATS, ParsedCall
from service.openai.tools import ToolPlan, plan_tools
from service.protocol.completions import ChatCompletionRequest, UsageInfo
from service.workers.chunks import UpstreamChunk
from tests.conftest import gateway_settings
from tests.service.api.test_api import MODEL, auth, new_tenant
from tests.support.fake_worker import FakeWorker
from tests.support.folds import (
    chunks_of,
    comparable,
    events_of,
    fold_chat,
    fold_completion,
    fold_responses,
)
from tests.support.servers import ThreadedServer

PARAMETERS = {"type": "object", "properties": {"location": {"type": "string"}}}
FUNCTIONS = ("get_weather", "get_time")
CHAT_TOOLS = [{"type": "function", "function": {"name": n, "parameters": PARAMETERS}} for n in FUNCTIONS]
RESPONSES_TOOLS = [{"type": "function", "name": n, "parameters": PARAMETERS} for n in FUNCTIONS]
MARKER_PREFIX = {"hermes": "", "llama3_json": "<|python_tag|>", "mistral": ""}
"""What starts a call block anywhere in an answer (Llama's bare JSON is a call only at the start)."""
MAX_TOKENS = 400
"""More than the pieces of any text below: the worker ends with the finish reason the case gives."""

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": MAX_TOKENS}
CHAT_BODY = {**CHAT, "tools": CHAT_TOOLS, "stream_options": {"include_usage": True}}
COMPLETION_BODY = {
    "model": MODEL,
    "prompt": "Weather?",
    "max_tokens": MAX_TOKENS,
    "stream_options": {"include_usage": True},
}
RESPONSES_BODY = {
    "model": MODEL,
    "input": "Weather?",
    "tools": RESPONSES_TOOLS,
    "max_output_tokens": MAX_TOKENS,
}


def calls(fmt: str, *names: str) -> str:
    """One call block of ``names`` (each with a location), as the family writes it."""
    written = [ParsedCall(n, json.dumps({"location": f"Paris {i}"})) for i, n in enumerate(names)]
    return MARKER_PREFIX[fmt] + FORMATS[fmt].render_calls(written)


Item = tuple[str, str]
"""An output item in short: ``("message", its text)`` or ``("function_call", the function's name)``."""


@dataclass(frozen=True)
class Said:
    """A model text (per format), how the answer ended, and the Responses output items it makes."""

    name: str
    text: dict[str, str]
    items: dict[str, list[Item]]
    finish: str = "stop"


def said(name: str, build: Any, items: Any, finish: str = "stop") -> Said:
    """A case whose text and items are ``build(fmt)`` and ``items(text)`` for each format."""
    texts = {fmt: build(fmt) for fmt in sorted(FORMATS)}
    return Said(name, texts, {fmt: items(text) for fmt, text in texts.items()}, finish)


def message(text: str) -> Item:
    return ("message", text)


WEATHER, TIME = FUNCTIONS
CALLED = {name: ("function_call", name) for name in FUNCTIONS}
START = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
TEXTS = [
    said(
        "text before a call",
        lambda f: "Checking. " + calls(f, WEATHER),
        lambda _: [message("Checking."), CALLED[WEATHER]],
    ),
    said(
        "text after a call",
        lambda f: calls(f, WEATHER) + " And more text.",
        lambda _: [CALLED[WEATHER], message("And more text.")],
    ),
    said(
        "text before and after a call",
        lambda f: "Checking. " + calls(f, WEATHER) + " And more text.",
        lambda _: [message("Checking."), CALLED[WEATHER], message("And more text.")],
    ),
    said(
        "text before, between and after calls",
        lambda f: "Checking. " + calls(f, WEATHER) + " Then. " + calls(f, TIME) + " Done.",
        lambda _: [message("Checking."), CALLED[WEATHER], message("Then."), CALLED[TIME], message("Done.")],
    ),
    said(
        "two calls in one block", lambda f: calls(f, WEATHER, TIME), lambda _: [CALLED[WEATHER], CALLED[TIME]]
    ),
    said(
        "two blocks back to back",
        lambda f: calls(f, WEATHER) + "\n" + calls(f, TIME) + "\nDone.",
        lambda _: [CALLED[WEATHER], CALLED[TIME], message("Done.")],
    ),
    said(
        "no call, markup-like text",
        lambda f: "a < b and [x] {y}; <tool> [TOOL]",
        lambda text: [message(text)],
    ),
    said(
        "a function not declared stays text",
        lambda f: "Try " + calls(f, "nope") + " end.",
        lambda text: [message(text)],
    ),
    said(
        "a marker cut by max_tokens",
        lambda f: "Checking. " + START[f][:-3],
        lambda text: [message(text)],  # not yet a marker: text
        "length",
    ),
    said(
        "a call cut by max_tokens",
        lambda f: "Checking. " + calls(f, WEATHER)[:-6],
        lambda _: [message("Checking.")],  # the unfinished call is dropped, not passed on as markup
        "length",
    ),
    said(
        "text after a call cut by max_tokens",
        lambda f: calls(f, WEATHER) + " And mo",
        lambda _: [CALLED[WEATHER], message("And mo")],
        "length",
    ),
]


def summary(output: list[dict[str, Any]]) -> list[Item]:
    """Output items in short (:data:`Item`)."""
    return [
        ("message", item["content"][0]["text"]) if item["type"] == "message" else (item["type"], item["name"])
        for item in output
    ]


def two_piece_cuts(text: str) -> list[list[str]]:
    """The text cut in two at every boundary."""
    return [[text[:at], text[at:]] for at in range(1, len(text))]


def stride_cuts(text: str, strides: tuple[int, ...] = (2, 5, 11)) -> list[list[str]]:
    """The text in pieces of ``stride`` characters, from every offset: each boundary falls between two
    pieces once per stride (with pieces short enough to end just after a marker, and long enough to hold
    one)."""
    out = []
    for stride in strides:
        for offset in range(stride):
            points = [0, *range(offset or stride, len(text), stride), len(text)]
            out.append([text[a:b] for a, b in itertools.pairwise(points) if b > a])
    return out


def all_cuts(text: str) -> list[list[str]]:
    """Whole, one character a piece, every two-piece cut and the stride cuts."""
    return [[text], list(text), *two_piece_cuts(text), *stride_cuts(text)]


# -- the shapers, fed directly ----------------------------------------------------------------------------
def chunks(pieces: list[str], finish: str) -> list[UpstreamChunk]:
    """The worker's chunks of ``pieces`` (one token each), the last one with ``finish``."""
    last = len(pieces) - 1
    return [
        UpstreamChunk(piece, 7, i + 1, 0, finish if i == last else None) for i, piece in enumerate(pieces)
    ]


@functools.cache
def tool_plan(fmt: str) -> ToolPlan:
    """What the gateway makes of :data:`CHAT_TOOLS` (``tool_choice`` auto) for format ``fmt``."""
    return plan_tools(ChatCompletionRequest.model_validate({**CHAT, "tools": CHAT_TOOLS}), FORMATS[fmt])


def shaped(
    api: str, fmt: str, pieces: list[str], finish: str, stream: bool
) -> tuple[dict[str, Any] | None, list[str]]:
    """The answer of ``pieces`` as ``api`` (chat, completion, responses) shapes it: the whole object when
    not ``stream``, else the stream's lines."""
    state = ChoiceState(0, "rid", OutputSpec(tools=tool_plan(fmt) if api != "completion" else None), None)
    shaper: Shaper
    if api == "chat":
        shaper = ChatShaper("rid", MODEL, 0, include_usage=True)
    elif api == "completion":
        shaper = TextShaper("rid", MODEL, 0, include_usage=True)
    else:
        shaper = ResponsesShaper("rid", MODEL, 0, {})
    usage = UsageInfo.of(7, len(pieces), 0)
    if not stream:
        state.step(UpstreamChunk("".join(pieces), 7, len(pieces), 0, finish))
        return shaper.response([state], usage), []
    out: list[bytes] = []
    for chunk in chunks(pieces, finish):
        first = not state.started
        out += shaper.events(state, state.step(chunk), first)
    out += shaper.end(usage)
    return None, b"".join(out).decode().splitlines()


def assert_folds(api: str, lines: list[str], expected: dict[str, Any]) -> None:
    """The stream's lines fold into ``expected`` (ids and timestamps aside)."""
    if api == "responses":
        items, completed = fold_responses(events_of(lines))
        assert completed["output"] == items  # the ids too: the same items
        assert comparable(completed) == comparable(expected)
    else:
        fold = fold_chat if api == "chat" else fold_completion
        assert comparable(fold(chunks_of(lines))) == comparable(expected)


APIS = ("chat", "completion", "responses")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("case", TEXTS, ids=[t.name for t in TEXTS])
def test_the_shaped_stream_folds_into_the_answer_not_streamed_at_every_cut(fmt: str, case: Said) -> None:
    text = case.text[fmt]
    for api in APIS:
        answers: dict[int, dict[str, Any]] = {}
        for pieces in all_cuts(text):
            if len(pieces) not in answers:
                answer, _ = shaped(api, fmt, pieces, case.finish, stream=False)
                assert answer is not None
                answers[len(pieces)] = answer
            _, lines = shaped(api, fmt, pieces, case.finish, stream=True)
            assert_folds(api, lines, answers[len(pieces)])
        whole_answer = answers[1]  # the text in one piece
        if api == "responses":
            assert summary(whole_answer["output"]) == case.items[fmt]
        elif api == "completion":
            assert whole_answer["choices"][0]["text"] == text  # no tools: the text as written


# -- the gateway, in front of the fake worker -------------------------------------------------------------
@pytest.fixture(scope="module")
def gateways(redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]) -> Iterator[dict[str, str]]:
    """A gateway per tool-call format, in front of the one fake worker; format -> base URL."""
    urls: dict[str, str] = {}
    servers = []
    try:
        for fmt in sorted(FORMATS):
            settings = gateway_settings(
                redis_url,
                stub_model_dir,
                [fake[1]],
                max_body_bytes=65536,
                context_length=4096,
                tool_call_format=fmt,
            )
            server = ThreadedServer(create_app(settings))
            urls[fmt] = server.__enter__().url
            servers.append(server)
        yield urls
    finally:
        for server in reversed(servers):
            server.__exit__(None, None, None)


@pytest.fixture
def worker(fake: tuple[FakeWorker, str]) -> Iterator[FakeWorker]:
    yield fake[0]
    fake[0].tokens, fake[0].finish = list(FakeWorker().tokens), "length"


def stream_lines(http: httpx.Client, path: str, key: str, body: dict[str, Any]) -> list[str]:
    with http.stream("POST", path, json={**body, "stream": True}, headers=auth(key)) as resp:
        assert resp.status_code == 200, resp.read()
        return list(resp.iter_lines())


def whole(http: httpx.Client, path: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = http.post(path, json=body, headers=auth(key))
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("case", TEXTS, ids=[t.name for t in TEXTS])
def test_the_gateways_stream_folds_into_its_answer_not_streamed(
    gateways: dict[str, str], worker: FakeWorker, fmt: str, case: Said
) -> None:
    text = case.text[fmt]
    worker.finish = case.finish
    paths = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "responses": "/v1/responses"}
    bodies = {"chat": CHAT_BODY, "completion": COMPLETION_BODY, "responses": RESPONSES_BODY}
    apis = APIS if fmt == "hermes" else ("chat", "responses")  # completions read no calls: one format
    with httpx.Client(base_url=gateways[fmt], timeout=30) as http:
        _, key = new_tenant(http)
        answers: dict[tuple[str, int], dict[str, Any]] = {}  # the same text in as many pieces: same answer
        for pieces in [[text], list(text), *stride_cuts(text)]:
            worker.tokens = pieces
            for api in apis:
                if (api, len(pieces)) not in answers:
                    body = {k: v for k, v in bodies[api].items() if k != "stream_options"}
                    answers[api, len(pieces)] = whole(http, paths[api], key, body)
                assert_folds(api, stream_lines(http, paths[api], key, bodies[api]), answers[api, len(pieces)])
        assert summary(answers["responses", 1]["output"]) == case.items[fmt]
        if "completion" in apis:
            assert answers["completion", 1]["choices"][0]["text"] == text

"""Tool-call formats per model family, on recorded model outputs (issue 11).

Each case is a model's answer as the engine returns it (special tokens such as ``<|im_end|>`` already
cut) with the content and calls the gateway must read out of it. Sources:

- SmolLM2-135M-Instruct: recorded on this project's CPU SGLang worker (the hermes prompt the gateway
  writes for templates without ``tools``; "auto" unconstrained, "required" under the structural tag).
- Qwen2.5-7B-Instruct: the output printed in Qwen's function-calling guide (qwen.readthedocs.io, v2.5,
  framework/function_call).
- Llama 3.1: Meta's model card for JSON-based tool calling ("what is the weather like in Menlo Park?").
- Mistral-7B-Instruct-v0.3: the example response on ollama.com/library/mistral; the Boston answer with
  trailing text is the one in vLLM's Mistral tool parser; Magistral-Small-2509 (tokenizer v13) writes
  ``[TOOL_CALLS]name[ARGS]{...}``, tokenizer v11 adds ``[CALL_ID]``.

Every case is also cut into pieces every way (one character at a time, and at random points): the
streamed reading must give exactly what the whole answer gives.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from service.openai.tool_formats import FORMATS, ParsedCall, ParseStep, json_value_end
from service.openai.tool_parser import CallParser


@dataclass(frozen=True)
class Recorded:
    fmt: str
    model: str
    output: str
    content: str
    calls: list[tuple[str, dict[str, object]]]
    names: tuple[str, ...] = ("get_weather",)
    parallel: bool = True


QWEN_TWO_CALLS = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, '
    'CA, USA", "date": "2024-10-01"}}\n</tool_call>'
)
SF = "San Francisco, CA, USA"
TEMPERATURE = ("get_current_temperature", "get_temperature_date")

CASES = [
    Recorded(
        "hermes",
        "SmolLM2-135M-Instruct (auto, unconstrained)",
        '<tool_call>\n{"name": "get_weather", "arguments": {\n    "city": {\n        "type": "string",\n'
        '        "required": ["city"]\n    }\n}}\n</tool_call>\n\nParis.',
        "Paris.",
        [("get_weather", {"city": {"type": "string", "required": ["city"]}})],
    ),
    Recorded(
        "hermes",
        "SmolLM2-135M-Instruct (required, structural tag)",
        '<tool_call>\n{"name": "get_weather", "arguments": {\n "city": "Paris"\n}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    Recorded(
        "hermes",
        "Qwen2.5-7B-Instruct (two calls)",
        QWEN_TWO_CALLS,
        "",
        [(TEMPERATURE[0], {"location": SF}), (TEMPERATURE[1], {"location": SF, "date": "2024-10-01"})],
        names=TEMPERATURE,
    ),
    Recorded(
        "hermes",
        "Qwen2.5-7B-Instruct (two calls, parallel_tool_calls false keeps the first)",
        QWEN_TWO_CALLS,
        "",
        [(TEMPERATURE[0], {"location": SF})],
        names=TEMPERATURE,
        parallel=False,
    ),
    Recorded(
        "hermes",
        "Qwen2.5-7B-Instruct (a call of an undeclared function stays text)",
        QWEN_TWO_CALLS,
        QWEN_TWO_CALLS.split("\n<tool_call>")[0],
        [(TEMPERATURE[1], {"location": SF, "date": "2024-10-01"})],
        names=(TEMPERATURE[1],),
    ),
    Recorded("hermes", "Qwen2.5-7B-Instruct (nothing declared matches)", QWEN_TWO_CALLS, QWEN_TWO_CALLS, []),
    Recorded(
        "llama3_json",
        "Llama 3.1 (model card)",
        '{"name": "get_current_conditions", "parameters": {"location": "Menlo Park, CA", '
        '"unit": "Fahrenheit"}}',
        "",
        [("get_current_conditions", {"location": "Menlo Park, CA", "unit": "Fahrenheit"})],
        names=("get_current_conditions",),
    ),
    Recorded(
        "llama3_json",
        "Llama 3.2 (<|python_tag|> after text)",
        'Here are some results: <|python_tag|>{"name": "search", "parameters": {"query": "weather"}}',
        "Here are some results:",
        [("search", {"query": "weather"})],
        names=("search",),
    ),
    Recorded(
        "llama3_json",
        "Llama 3.x (two calls separated by ';')",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}',
        "",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})],
    ),
    Recorded(
        "llama3_json",
        "Llama 3.x (a JSON answer that is not a call stays text)",
        '{"answer": 42, "unit": "apples"}',
        '{"answer": 42, "unit": "apples"}',
        [],
    ),
    Recorded(
        "mistral",
        "Mistral-7B-Instruct-v0.3",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "San Francisco, CA", '
        '"format": "celsius"}}]',
        "",
        [("get_current_weather", {"location": "San Francisco, CA", "format": "celsius"})],
        names=("get_current_weather",),
    ),
    Recorded(
        "mistral",
        "Mistral-7B-Instruct-v0.3 (text after the call)",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Boston, MA", "unit": '
        '"fahrenheit"}}]\n\nToday\'s weather in Boston is :{function call result} (in Fahrenheit)\n\nIf you '
        "prefer Celsius, please let me know.",
        "Today's weather in Boston is :{function call result} (in Fahrenheit)\n\nIf you prefer Celsius, "
        "please let me know.",
        [("get_current_weather", {"location": "Boston, MA", "unit": "fahrenheit"})],
        names=("get_current_weather",),
    ),
    Recorded(
        "mistral",
        "Magistral-Small-2509 (tokenizer v13)",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}',
        "",
        [("get_weather", {"city": "Zürich"})],
    ),
    Recorded(
        "mistral",
        "Mistral tokenizer v11 (call id), two calls",
        '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]'
        '{"timezone": "UTC"}',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "UTC"})],
        names=("get_weather", "get_time"),
    ),
]


def parts_of(case: Recorded, pieces: list[str]) -> list[str | ParsedCall]:
    """The answer read piece by piece, as text runs and calls in the order written."""
    parser = CallParser(FORMATS[case.fmt], frozenset(case.names), case.parallel)
    total = ParseStep()
    for step in [*(parser.feed(p) for p in pieces), parser.finish()]:
        total.extend(step)
    return total.parts


def read(case: Recorded, pieces: list[str]) -> tuple[str, list[tuple[str, dict[str, object]]]]:
    parts = parts_of(case, pieces)
    text = "".join(p for p in parts if isinstance(p, str))
    return text, [(c.name, json.loads(c.arguments)) for c in parts if isinstance(c, ParsedCall)]


def cuts(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


@pytest.mark.parametrize("case", CASES, ids=[c.model for c in CASES])
def test_recorded_outputs_read_as_content_and_calls(case: Recorded) -> None:
    assert read(case, [case.output]) == (case.content, case.calls)


@pytest.mark.parametrize("case", CASES, ids=[c.model for c in CASES])
def test_any_cut_into_stream_pieces_reads_the_same(case: Recorded) -> None:
    whole = parts_of(case, [case.output])
    assert parts_of(case, list(case.output)) == whole
    for at in range(1, len(case.output)):  # every two-piece cut: a marker and the text after it in one piece
        assert parts_of(case, [case.output[:at], case.output[at:]]) == whole, at
    for seed in range(20):
        assert parts_of(case, cuts(case.output, seed)) == whole, seed


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize(
    "text",
    ["The capital of France is Paris.", "  spaced  \n\n", "a < b and [x] {y}", "<tool_c", "[TOOL_CALL", "{"],
)
def test_text_without_a_call_comes_back_unchanged(fmt: str, text: str) -> None:
    case = Recorded(fmt, "plain", text, text, [])
    assert read(case, [text]) == (text, [])
    assert read(case, list(text)) == (text, [])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_calls_the_gateway_writes_into_history_read_back(fmt: str) -> None:
    """What :meth:`render_calls` writes for templates without ``tool_calls`` is the family's format."""
    from service.openai.tool_formats import ParsedCall

    calls = [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", '{"tz": "UTC"}')]
    text = FORMATS[fmt].render_calls(calls)
    case = Recorded(fmt, "rendered", text, "", [], names=("get_weather", "get_time"))
    assert read(case, [text]) == ("", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})])


def test_json_value_end_respects_strings_and_escapes() -> None:
    text = '{"a": "}", "b": "\\"}", "c": [1, {"d": 2}]} tail'
    assert text[: json_value_end(text, 0)] == '{"a": "}", "b": "\\"}", "c": [1, {"d": 2}]}'
    assert json_value_end('{"a": [1, 2', 0) is None
    with pytest.raises(ValueError):
        json_value_end("x", 0)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_forced_constraint_names_each_allowed_function_and_its_schema(fmt: str) -> None:
    from service.openai.tool_formats import FunctionSpec

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    functions = [
        FunctionSpec("get_weather", None, schema),
        FunctionSpec("get_time", None, {"type": "object"}),
    ]
    one = json.dumps(FORMATS[fmt].forced_constraint(functions, parallel=False))
    assert '\\"get_weather\\"' in one and '\\"get_time\\"' in one and '"required": ["city"]' in one
    assert '"at_least_one": true' in one and '"stop_after_first": true' in one
    assert '"stop_after_first": false' in json.dumps(FORMATS[fmt].forced_constraint(functions, parallel=True))


DEEP = "[" * 3000 + "]" * 3000
"""JSON nested past what Python's recursive parser takes (~1,000 levels: RecursionError, which was a 500)."""
DEEP_ARGS = f'"arguments": {{"a": {DEEP}}}'
DEEP_CALLS = {
    "hermes": [f"<tool_call>{DEEP}</tool_call>", f'<tool_call>{{"name": "f", {DEEP_ARGS}}}</tool_call>'],
    "llama3_json": [f'{{"name": "f", "parameters": {DEEP}}}', f'{{"name": "f", {DEEP_ARGS}}}'],
    "mistral": [f"[TOOL_CALLS] {DEEP}", f'[TOOL_CALLS] [{{"name": "f", {DEEP_ARGS}}}]'],
}  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(DEEP_CALLS))
def test_a_call_nested_too_deep_to_parse_stays_content(fmt: str) -> None:
    for text in DEEP_CALLS[fmt]:
        parser = CallParser(FORMATS[fmt], frozenset({"f"}))
        step = parser.feed(text)
        end = parser.finish()
        assert step.calls == end.calls == []
        assert (step.text + end.text).strip() == text.strip()


CUT_CALLS = {  # a first call, then a second one cut off by max_tokens (nu11: "<tool_call>" became content)
    "hermes": ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}</tool_call>\n', '<tool_call>\n{"name": "f'),
    "llama3_json": ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', '<|python_tag|>{"na'),
    "mistral": ('[TOOL_CALLS]f[ARGS]{"a": 1}', "[TOOL_CALLS]f[ARGS]{"),
}  # fmt: skip


@pytest.mark.parametrize("fmt", sorted(CUT_CALLS))
@pytest.mark.parametrize("cut", [True, False])
def test_a_call_cut_off_by_max_tokens_is_dropped_not_passed_on_as_content(fmt: str, cut: bool) -> None:
    first, unfinished = CUT_CALLS[fmt]
    for pieces in ([first + unfinished], list(first + unfinished)):
        parser = CallParser(FORMATS[fmt], frozenset({"f"}))
        steps = [*(parser.feed(p) for p in pieces), parser.finish(cut=cut)]
        text = "".join(s.text for s in steps)
        assert [(c.name, json.loads(c.arguments)) for s in steps for c in s.calls] == [("f", {"a": 1})]
        # cut at max_tokens: the unfinished call is dropped; an answer that ended by itself keeps it as text
        assert text.strip() == ("" if cut else unfinished.strip()), (fmt, pieces[:1])

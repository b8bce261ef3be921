"""How each model family writes tool calls: parsing its output, constraining it, and rendering history.

A model calls a tool by writing text in its family's format; the gateway turns that text into OpenAI's
``tool_calls`` (:class:`service.openai.tool_parser.CallParser`, the same code for streamed and whole
answers), asks SGLang's grammar backend to force it when a call is required
(:meth:`ToolCallFormat.forced_constraint`: an xgrammar structural tag sent as
``sampling_params.structural_tag``), and writes earlier calls and results back into the prompt for chat
templates that do not render ``tools`` themselves.

Formats (``api.tool_call_format``), after SGLang 0.5.23's detectors (``sglang/srt/function_call/``:
``hermes_detector.py``, ``llama32_detector.py``, ``mistral_detector.py``) and the model cards:

- ``hermes`` (Hermes 2 Pro, Qwen 2.5/3, SmolLM2):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` per call; a JSON list inside one
  block is read too (SmolLM2's model card writes it that way).
- ``llama3_json`` (Llama 3.1/3.2/3.3 JSON tool calling): the answer is ``{"name": ..., "parameters": {...}}``,
  optionally after ``<|python_tag|>``; several calls are separated by ``;``.
- ``mistral`` (Mistral 7B v0.3 and later): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, or the
  compact ``[TOOL_CALLS]name[ARGS]{...}`` of newer Mistral tokenizers.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

FormatName = Literal["hermes", "llama3_json", "mistral"]

JSON_MAX_WHITESPACE = 2
"""Longest whitespace run the grammar allows inside forced JSON arguments, characters: small models
otherwise spend tokens (or loop) on indentation (xgrammar ``JSONSchemaFormat.max_whitespace_cnt``)."""


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """One function a request offers the model.

    Attributes:
        name: the function's name.
        description: what it does (shown to the model), or None.
        parameters: the JSON schema of its arguments (an object schema).
        strict: the caller asked for arguments that follow the schema exactly.
    """

    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool = False

    def openai(self) -> dict[str, Any]:
        """As OpenAI and Hugging Face chat templates (``tools=``) take it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """A tool call read from model output: the function's name and its arguments as a JSON text."""

    name: str
    arguments: str


@dataclass(slots=True)
class ParseStep:
    """What one piece of model output turned into: content text and complete calls, in the order the
    model wrote them (``parts``: a text run, a call, the text after it...; adjacent text is one run).

    ``text`` (all the text) and ``calls`` (all the calls) are views of ``parts``.
    """

    parts: list[str | ParsedCall] = field(default_factory=list)

    @classmethod
    def of_text(cls, text: str) -> ParseStep:
        """A step of text only (an answer not parsed for calls)."""
        step = cls()
        step.add_text(text)
        return step

    @property
    def text(self) -> str:
        """The step's content text (its text runs joined)."""
        return "".join(p for p in self.parts if isinstance(p, str))

    @property
    def calls(self) -> list[ParsedCall]:
        """The step's complete calls, in order."""
        return [p for p in self.parts if isinstance(p, ParsedCall)]

    def add_text(self, text: str) -> None:
        """Append content text (joined to a text run that ends the step)."""
        if not text:
            return
        if self.parts and isinstance(self.parts[-1], str):
            self.parts[-1] += text
        else:
            self.parts.append(text)

    def extend(self, later: ParseStep) -> None:
        """Append what a later step holds, in order."""
        for part in later.parts:
            if isinstance(part, str):
                self.add_text(part)
            else:
                self.parts.append(part)


def load_json(text: str) -> Any:
    """``json.loads``, where JSON nested deeper than Python's recursive parser takes (~1,000 levels:
    RecursionError) is a ValueError like any other text that is not JSON.

    Raises:
        ValueError: ``text`` is not JSON, or nests too deeply.
    """
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise ValueError("JSON nests too deeply") from exc


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array that starts at ``text[start]``; None while incomplete.

    Only brackets outside strings count (escapes respected). Raises ValueError when ``text[start]`` is
    not ``{`` or ``[``.
    """
    if text[start] not in "{[":
        raise ValueError("not a JSON object or array")
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _arguments_text(value: Any) -> str | None:
    """Arguments as OpenAI's JSON text: an object is serialised; a string holding a JSON object is kept."""
    try:
        if isinstance(value, dict):
            return json.dumps(value, ensure_ascii=False)
        if isinstance(value, str):
            return value if isinstance(load_json(value), dict) else None
    except (ValueError, RecursionError):  # the encoder recurses as the parser does
        return None
    return None


def calls_from_json(
    value: Any, names: frozenset[str], argument_keys: Sequence[str]
) -> list[ParsedCall] | None:
    """``{"name", "arguments"}`` objects (or a list of them) as calls; None when any is not a call of a
    declared function (the text is then content, not a call)."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        key = next((k for k in argument_keys if k in item), None)
        arguments = _arguments_text(item[key]) if key is not None else "{}"
        if arguments is None:
            return None
        calls.append(ParsedCall(str(item["name"]), arguments))
    return calls or None


@dataclass(slots=True)
class Extraction:
    """Result of reading a call block at the start of a buffer.

    Attributes:
        consumed: characters of the buffer the block took (0 while it is incomplete).
        calls: the calls read, or None when the block is not a valid call (its text becomes content).
    """

    consumed: int
    calls: list[ParsedCall] | None


class ToolCallFormat(ABC):
    """One family's tool-call format. Subclasses give markers, parsing, grammar and history rendering."""

    name: FormatName
    markers: tuple[str, ...]
    """Texts that start a call block anywhere in the answer."""
    argument_keys: tuple[str, ...] = ("arguments", "parameters")

    def start_at_output_begin(self, text: str) -> bool:
        """Whether ``text`` (the answer so far, leading whitespace removed) starts a call without a
        marker (Llama's bare JSON). Default: never."""
        return False

    @abstractmethod
    def extract(self, buffer: str, names: frozenset[str], final: bool) -> Extraction:
        """Read the call block at the start of ``buffer`` (which begins with a marker, or a bare start).

        ``final``: no more text will come; an incomplete block is then read as far as it goes.
        """

    @abstractmethod
    def call_tag(self, function: FunctionSpec) -> dict[str, Any]:
        """xgrammar ``TagFormat`` (structural tag) of one call to ``function``: fixed text around the
        arguments, which follow the function's schema."""

    separator: str = "\n"

    def forced_constraint(self, functions: Sequence[FunctionSpec], parallel: bool) -> dict[str, Any]:
        """Structural tag that forces at least one call to one of ``functions`` (exactly one unless
        ``parallel``) and nothing else (``tool_choice`` ``required`` or a named function)."""
        calls = {
            "type": "tags_with_separator",
            "tags": [self.call_tag(f) for f in functions],
            "separator": self.separator,
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
        return {"type": "structural_tag", "format": calls}

    def triggered_constraint(self, functions: Sequence[FunctionSpec], parallel: bool) -> dict[str, Any]:
        """Structural tag for ``tool_choice: "auto"`` with strict functions: free text, but once the
        model starts a call its arguments follow the schema."""
        tags = [self.call_tag(f) for f in functions]
        triggers = sorted({str(tag["begin"])[: len(self.markers[0])] for tag in tags})
        return {
            "type": "structural_tag",
            "format": {
                "type": "triggered_tags",
                "triggers": triggers,
                "tags": tags,
                "stop_after_first": not parallel,
            },
        }

    @abstractmethod
    def system_prompt(self, functions: Sequence[FunctionSpec]) -> str:
        """Instructions listing the functions, for chat templates that do not render ``tools``."""

    @abstractmethod
    def render_calls(self, calls: Sequence[ParsedCall]) -> str:
        """Earlier calls as this family writes them, for templates that do not render ``tool_calls``."""

    def render_result(self, content: str) -> str:
        """A tool result as this family reads it, for templates that do not render tool messages."""
        return content


def _schema_content(function: FunctionSpec) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": function.parameters,
        "max_whitespace_cnt": JSON_MAX_WHITESPACE,
    }


def _listing(functions: Sequence[FunctionSpec]) -> str:
    return "\n".join(json.dumps(f.openai(), ensure_ascii=False) for f in functions)


class HermesFormat(ToolCallFormat):
    """``<tool_call>{json}</tool_call>`` (Hermes 2 Pro function-calling prompt; Qwen 2.5 template)."""

    name: FormatName = "hermes"
    markers = ("<tool_call>",)
    end = "</tool_call>"

    def extract(self, buffer: str, names: frozenset[str], final: bool) -> Extraction:
        stop = buffer.find(self.end)
        if stop < 0 and not final:
            return Extraction(0, None)
        inner_end = stop if stop >= 0 else len(buffer)
        consumed = stop + len(self.end) if stop >= 0 else len(buffer)
        inner = buffer[len(self.markers[0]) : inner_end].strip()
        try:
            value = load_json(inner)
        except ValueError:
            return Extraction(consumed, None)
        return Extraction(consumed, calls_from_json(value, names, self.argument_keys))

    def call_tag(self, function: FunctionSpec) -> dict[str, Any]:
        name = json.dumps(function.name)
        return {
            "type": "tag",
            "begin": f'<tool_call>\n{{"name": {name}, "arguments": ',
            "content": _schema_content(function),
            "end": "}\n</tool_call>",
        }

    def system_prompt(self, functions: Sequence[FunctionSpec]) -> str:
        return (
            "You are a function calling AI model. You are provided with function signatures within "
            "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
            "Don't make assumptions about what values to plug into functions.\n<tools>\n"
            f"{_listing(functions)}\n</tools>\nFor each function call return a json object with function "
            "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def render_calls(self, calls: Sequence[ParsedCall]) -> str:
        return "\n".join(
            f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n</tool_call>'
            for c in calls
        )

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.x JSON tool calling: ``{"name": ..., "parameters": {...}}`` (Meta's model card prompt)."""

    name: FormatName = "llama3_json"
    markers = ("<|python_tag|>",)
    argument_keys = ("parameters", "arguments")
    separator = "; "

    def start_at_output_begin(self, text: str) -> bool:
        return text.startswith("{")

    def extract(self, buffer: str, names: frozenset[str], final: bool) -> Extraction:
        pos = len(self.markers[0]) if buffer.startswith(self.markers[0]) else 0
        calls: list[ParsedCall] = []
        while True:
            while pos < len(buffer) and buffer[pos].isspace():
                pos += 1
            if pos >= len(buffer):
                return Extraction(pos, calls or None) if final else Extraction(0, None)
            if buffer[pos] != "{":
                return Extraction(pos, calls or None)
            end = json_value_end(buffer, pos)
            if end is None:
                return Extraction(len(buffer), None) if final else Extraction(0, None)
            try:
                found = calls_from_json(load_json(buffer[pos:end]), names, self.argument_keys)
            except ValueError:
                found = None
            if found is None:
                return Extraction(end, None)
            calls += found
            pos = end
            rest = buffer[pos:].lstrip()
            if not rest and not final:
                return Extraction(0, None)  # a ";" and another call may follow
            if not rest.startswith(";"):
                return Extraction(pos, calls)
            pos = len(buffer) - len(rest) + 1

    def call_tag(self, function: FunctionSpec) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f'{{"name": {json.dumps(function.name)}, "parameters": ',
            "content": _schema_content(function),
            "end": "}",
        }

    def triggered_constraint(self, functions: Sequence[FunctionSpec], parallel: bool) -> dict[str, Any]:
        tags = [self.call_tag(f) for f in functions]
        return {
            "type": "structural_tag",
            "format": {
                "type": "triggered_tags",
                "triggers": ['{"name": '],
                "tags": tags,
                "stop_after_first": not parallel,
            },
        }

    def system_prompt(self, functions: Sequence[FunctionSpec]) -> str:
        return (
            "Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\nRespond in the format "
            '{"name": function name, "parameters": dictionary of argument name and its value}. '
            f"Do not use variables.\n\n{_listing(functions)}"
        )

    def render_calls(self, calls: Sequence[ParsedCall]) -> str:
        return "; ".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls)


class MistralFormat(ToolCallFormat):
    """``[TOOL_CALLS] [{...}, ...]`` (tokenizer v3) or ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` (v11;
    v13 drops the call id)."""

    name: FormatName = "mistral"
    markers = ("[TOOL_CALLS]",)
    separator = ", "

    def extract(self, buffer: str, names: frozenset[str], final: bool) -> Extraction:
        pos = len(self.markers[0])
        while pos < len(buffer) and buffer[pos].isspace():
            pos += 1
        if pos >= len(buffer):
            return Extraction(len(buffer), None) if final else Extraction(0, None)
        if buffer[pos] == "[":
            end = json_value_end(buffer, pos)
            if end is None:
                return Extraction(len(buffer), None) if final else Extraction(0, None)
            try:
                return Extraction(end, calls_from_json(load_json(buffer[pos:end]), names, self.argument_keys))
            except ValueError:
                return Extraction(end, None)
        args_at = buffer.find("[ARGS]", pos)
        brace = buffer.find("{", pos)
        if args_at < 0 and brace < 0:
            return Extraction(len(buffer), None) if final else Extraction(0, None)
        name_end = args_at if args_at >= 0 and (brace < 0 or args_at < brace) else brace
        name = buffer[pos:name_end].split("[CALL_ID]")[0].strip()  # v11: name[CALL_ID]id[ARGS]{...}
        start = buffer.find("{", name_end)
        if start < 0:
            return Extraction(len(buffer), None) if final else Extraction(0, None)
        end = json_value_end(buffer, start)
        if end is None:
            return Extraction(len(buffer), None) if final else Extraction(0, None)
        try:
            arguments = load_json(buffer[start:end])
        except ValueError:
            return Extraction(end, None)
        found = calls_from_json({"name": name, "arguments": arguments}, names, self.argument_keys)
        return Extraction(end, found)

    def call_tag(self, function: FunctionSpec) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f'{{"name": {json.dumps(function.name)}, "arguments": ',
            "content": _schema_content(function),
            "end": "}",
        }

    def forced_constraint(self, functions: Sequence[FunctionSpec], parallel: bool) -> dict[str, Any]:
        inner = super().forced_constraint(functions, parallel)["format"]
        sequence = [
            {"type": "const_string", "value": "[TOOL_CALLS] ["},
            inner,
            {"type": "const_string", "value": "]"},
        ]
        return {"type": "structural_tag", "format": {"type": "sequence", "elements": sequence}}

    def triggered_constraint(self, functions: Sequence[FunctionSpec], parallel: bool) -> dict[str, Any]:
        inner = super().forced_constraint(functions, parallel)["format"]
        tag = {"type": "tag", "begin": "[TOOL_CALLS] [", "content": inner, "end": "]"}
        return {
            "type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": ["[TOOL_CALLS]"], "tags": [tag]},
        }

    def system_prompt(self, functions: Sequence[FunctionSpec]) -> str:
        listing = json.dumps([f.openai() for f in functions], ensure_ascii=False)
        return (
            f"[AVAILABLE_TOOLS] {listing}[/AVAILABLE_TOOLS]\nTo call functions, answer with [TOOL_CALLS] "
            'followed by a JSON list of {"name": ..., "arguments": {...}} objects.'
        )

    def render_calls(self, calls: Sequence[ParsedCall]) -> str:
        items = ", ".join(f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}' for c in calls)
        return f"[TOOL_CALLS] [{items}]"

    def render_result(self, content: str) -> str:
        return f"[TOOL_RESULTS] {content}[/TOOL_RESULTS]"


FORMATS: dict[str, ToolCallFormat] = {
    f.name: f for f in (HermesFormat(), Llama3JsonFormat(), MistralFormat())
}


__all__ = [
    "FORMATS",
    "Extraction",
    "FormatName",
    "FunctionSpec",
    "ParseStep",
    "ParsedCall",
    "ToolCallFormat",
    "json_value_end",
    "load_json",
]

"""Tool calling for one chat request: what it asks (:class:`ToolPlan`), and its messages for the template.

- The prompt: the history (assistant ``tool_calls``, ``tool`` results) and the functions go through the
  model's chat template the Hugging Face way (``apply_chat_template(messages, tools=...)``: tools as
  OpenAI function dicts, a call's ``arguments`` as an object). A template that does not lay out ``tools``
  gets the family's tool instructions in the system message, and one that does not write ``tool_calls``
  gets earlier calls and results written in the family's format (:mod:`service.openai.tool_formats`).
  With ``tool_choice: "none"`` the functions are left out of the prompt and the answer is not parsed
  (SGLang's chat route does the same).
- ``required`` and a named function are forced by SGLang's grammar backend (a structural tag: the
  family's call syntax around arguments that follow the function's JSON schema), so even a 135M model
  answers with a valid call. ``auto`` leaves the model free; if a function is ``strict``, a call it
  starts is held to the schema (a triggered structural tag, as SGLang does for strict tools).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.errors import InvalidRequest
from service.openai.tool_formats import FunctionSpec, ParsedCall, ToolCallFormat, load_json
from service.openai.tool_parser import CallParser
from service.protocol.completions import ChatCompletionRequest, ChatMessage
from service.protocol.features import NamedToolChoice, check_schema

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""Parameters of a function declared without any (OpenAI: a function that takes no arguments)."""


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request asks of tools.

    Attributes:
        functions: the declared functions (empty when none).
        choice: ``"none"``, ``"auto"`` or ``"required"`` (a named function is ``"required"`` with
            ``forced`` set).
        forced: the function a named ``tool_choice`` forces, else None.
        parallel: several calls in one answer allowed (``parallel_tool_calls``, default true).
        fmt: the model family's call format.
    """

    functions: tuple[FunctionSpec, ...]
    choice: str
    forced: str | None
    parallel: bool
    fmt: ToolCallFormat

    @property
    def active(self) -> bool:
        """The model may call functions (some are declared and ``tool_choice`` is not ``"none"``)."""
        return bool(self.functions) and self.choice != "none"

    def constraint(self) -> dict[str, Any] | None:
        """The structural tag for ``sampling_params.structural_tag``, or None when the answer is free."""
        if not self.active:
            return None
        if self.choice == "required":
            allowed = [f for f in self.functions if self.forced is None or f.name == self.forced]
            # A named function is called once (OpenAI's forced function), whatever parallel_tool_calls says.
            return self.fmt.forced_constraint(allowed, self.parallel and self.forced is None)
        strict = [f for f in self.functions if f.strict]
        return self.fmt.triggered_constraint(self.functions, self.parallel) if strict else None

    def parser(self) -> CallParser | None:
        """A fresh parser of one answer, or None when answers are not parsed for calls."""
        if not self.active:
            return None
        return CallParser(self.fmt, frozenset(f.name for f in self.functions), self.parallel)


NO_TOOLS_CHOICE = "auto"


def plan_tools(req: ChatCompletionRequest, fmt: ToolCallFormat) -> ToolPlan:
    """Check a request's ``tools`` and ``tool_choice`` and say what they ask.

    Raises:
        InvalidRequest: a parameters schema that is not a JSON schema, two functions with one name,
            ``tool_choice`` ``required`` or naming a function without such a function declared.
    """
    functions = []
    for i, tool in enumerate(req.tools or []):
        function = tool.function
        parameters = function.parameters if function.parameters is not None else EMPTY_PARAMETERS
        problem = check_schema(parameters)
        if problem is not None:
            raise InvalidRequest(
                f"Invalid schema for function '{function.name}': {problem}",
                code="invalid_function_parameters",
                param=f"tools.{i}.function.parameters",
            )
        functions.append(FunctionSpec(function.name, function.description, parameters, bool(function.strict)))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequest("Function names in 'tools' must be unique.", code="invalid_value", param="tools")
    choice = req.tool_choice if req.tool_choice is not None else NO_TOOLS_CHOICE
    forced = None
    if isinstance(choice, NamedToolChoice):
        forced = choice.function.name
        if forced not in names:
            raise InvalidRequest(
                f"tool_choice names function '{forced}', which is not in 'tools'.",
                code="invalid_value",
                param="tool_choice",
            )
        choice = "required"
    if choice == "required" and not functions:
        raise InvalidRequest(
            "tool_choice 'required' needs at least one function in 'tools'.",
            code="invalid_value",
            param="tool_choice",
        )
    parallel = req.parallel_tool_calls is not False
    return ToolPlan(tuple(functions), choice, forced, parallel, fmt)


def _arguments_object(arguments: str) -> Any:
    """A call's arguments as the template takes them: the object when the text is a JSON object (Hugging
    Face's convention), else the text itself."""
    try:
        value = load_json(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _system_with(messages: list[dict[str, Any]], extra: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{extra}".strip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": extra}, *messages]


def template_messages(
    messages: Sequence[ChatMessage],
    plan: ToolPlan,
    renders_tools: bool,
    renders_tool_calls: bool,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and ``tools`` for the chat template (see the module docstring).

    ``developer`` becomes ``system``; a tool message gets the ``name`` of the call it answers.
    """
    names_by_id: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        item: dict[str, Any] = {"role": role, "content": message.text()}
        if message.tool_calls:
            calls = [ParsedCall(c.function.name, c.function.arguments) for c in message.tool_calls]
            for call in message.tool_calls:
                names_by_id[call.id] = call.function.name
            if renders_tool_calls:
                item["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": _arguments_object(c.function.arguments),
                        },
                    }
                    for c in message.tool_calls
                ]
            else:
                written = plan.fmt.render_calls(calls)
                item["content"] = f"{item['content']}\n{written}" if item["content"] else written
        if role == "tool":
            if message.tool_call_id is not None:
                item["tool_call_id"] = message.tool_call_id
                if message.tool_call_id in names_by_id:
                    item["name"] = names_by_id[message.tool_call_id]
            if not renders_tool_calls:
                item["content"] = plan.fmt.render_result(item["content"])
        out.append(item)
    if not plan.active:
        return out, None
    tools = [f.openai() for f in plan.functions]
    if renders_tools:
        return out, tools
    return _system_with(out, plan.fmt.system_prompt(plan.functions)), None


__all__ = ["EMPTY_PARAMETERS", "ToolPlan", "plan_tools", "template_messages"]

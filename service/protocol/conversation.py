"""References inside a conversation: every tool result answers a call made before it (issue 25).

A tool result names the call it answers by id (a chat ``tool`` message's ``tool_call_id``, a Responses
``function_call_output``'s ``call_id``); a template renders it whatever it names, so a result for a call
that never happened reached the model as if it had. The rules are OpenAI's, with its messages (as its API
answers them; the ``param`` in this gateway's ``messages.2.tool_call_id`` form):

Chat completions (``messages``):

- a ``tool`` message follows an assistant message with ``tool_calls``, or another tool message that does:
  "messages with role 'tool' must be a response to a preceding message with 'tool_calls'" (``.role``);
- its ``tool_call_id`` is one of that assistant message's calls: "'tool_call_id' of 'call_9' not found in
  'tool_calls' of previous message" (``.tool_call_id``), answered once: "Duplicate value for
  'tool_call_id'" (``.tool_call_id``);
- every call of an assistant message is answered before the next message that is not a tool result (or
  the end): "An assistant message with 'tool_calls' must be followed by tool messages responding to each
  'tool_call_id'" (the assistant message's ``.role``);
- a call id is not used twice in the conversation (``.tool_calls.1.id``).

Responses (``input`` items; the API has no turns, so order is all that counts):

- a ``function_call_output`` comes after a ``function_call`` with its ``call_id``: "No tool call found for
  function call output with call_id call_9", answered once;
- every ``function_call`` has an output: "No tool output found for function call call_1";
- a ``function_call``'s ``call_id`` is not used twice.

Each is a 400 ``invalid_request_error`` naming the field, raised before admission (nothing charged).
"""

from __future__ import annotations

from collections.abc import Sequence

from service.errors import InvalidRequest
from service.protocol.completions import ChatMessage
from service.protocol.responses import FunctionCallItem, FunctionCallOutputItem, ResponsesRequest

CODE = "invalid_value"


def _refuse(message: str, param: str) -> InvalidRequest:
    return InvalidRequest(message, code=CODE, param=param)


def _unanswered(turn: int, missing: Sequence[str]) -> InvalidRequest:
    return _refuse(
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(missing)}",
        f"messages.{turn}.role",
    )


def check_chat_references(messages: Sequence[ChatMessage]) -> None:
    """Check the tool calls and results of a chat conversation (the rules in the module docstring).

    Raises:
        InvalidRequest: 400 naming the message's field (``messages.2.tool_call_id``, ``messages.2.role``,
            ``messages.1.tool_calls.0.id``).
    """
    made: dict[str, str] = {}  # call id -> where it was made ("messages[1].tool_calls")
    turn: int | None = None  # the assistant message whose calls are being answered
    pending: dict[str, None] = {}  # its calls not yet answered, in order
    answered: dict[str, int] = {}  # its calls answered -> by which message
    for i, message in enumerate(messages):
        if message.role == "tool":
            call = message.tool_call_id or ""
            if turn is None:
                raise _refuse(
                    "Invalid parameter: messages with role 'tool' must be a response to a preceding message "
                    "with 'tool_calls'.",
                    f"messages.{i}.role",
                )
            if call in answered:
                raise _refuse(
                    f"Invalid parameter: Duplicate value for 'tool_call_id' of '{call}' in "
                    f"messages[{answered[call]}] and messages[{i}].",
                    f"messages.{i}.tool_call_id",
                )
            if call not in pending:
                raise _refuse(
                    f"Invalid parameter: 'tool_call_id' of '{call}' not found in 'tool_calls' of previous "
                    f"message (messages[{turn}]).",
                    f"messages.{i}.tool_call_id",
                )
            del pending[call]
            answered[call] = i
            continue
        if turn is not None and pending:
            raise _unanswered(turn, list(pending))
        turn, pending, answered = None, {}, {}
        if message.role != "assistant" or not message.tool_calls:
            continue
        for j, tool_call in enumerate(message.tool_calls):
            where = f"messages[{i}].tool_calls[{j}]"
            if tool_call.id in made:
                raise _refuse(
                    f"Invalid parameter: Duplicate value for 'id' of '{tool_call.id}' in "
                    f"{made[tool_call.id]} and {where}: each tool call has its own id.",
                    f"messages.{i}.tool_calls.{j}.id",
                )
            made[tool_call.id] = where
            pending[tool_call.id] = None
        turn = i
    if turn is not None and pending:
        raise _unanswered(turn, list(pending))


def check_responses_references(req: ResponsesRequest) -> None:
    """Check the ``function_call`` and ``function_call_output`` items of a Responses input (the rules in
    the module docstring).

    Raises:
        InvalidRequest: 400 naming the item's field (``input.2.call_id``).
    """
    if isinstance(req.input, str):
        return
    calls: dict[str, int] = {}  # call id -> index of its function_call item
    outputs: dict[str, int] = {}  # call id -> index of its function_call_output item
    for i, item in enumerate(req.input):
        if isinstance(item, FunctionCallItem):
            if item.call_id in calls:
                raise _refuse(
                    f"Duplicate 'call_id' {item.call_id}: input[{calls[item.call_id]}] and input[{i}] are "
                    "both function calls with it.",
                    f"input.{i}.call_id",
                )
            calls[item.call_id] = i
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise _refuse(
                    f"No tool call found for function call output with call_id {item.call_id}.",
                    f"input.{i}.call_id",
                )
            if item.call_id in outputs:
                raise _refuse(
                    f"Duplicate function call output for call_id {item.call_id}: "
                    f"input[{outputs[item.call_id]}] "
                    f"and input[{i}].",
                    f"input.{i}.call_id",
                )
            outputs[item.call_id] = i
    for call, i in calls.items():
        if call not in outputs:
            raise _refuse(f"No tool output found for function call {call}.", f"input.{i}.call_id")


__all__ = ["check_chat_references", "check_responses_references"]

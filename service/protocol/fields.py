"""Every field of OpenAI's request schema, and what radixgate does with it: one table per place.

OpenAI's published request types (``openai.types.chat.completion_create_params``,
``openai.types.completion_create_params`` and the chat message/content-part types) list the fields a
client may send. Each has a :class:`FieldRule` here:

- ``SERVED``: parsed by the request model (:mod:`service.protocol.completions`) and honoured. ``null`` means
the
  default. A rule may serve only some values (``n`` = 1): the others get 400 ``unsupported_value``.
- ``ACCEPTED``: a hint or bookkeeping field that cannot change the answer (``metadata``,
  ``prompt_cache_key``, ...): checked for shape, then dropped.
- ``OFF_ONLY``: a feature not served yet. Its "off" values (``null``, ``false``, ``[]``, ``"none"``, ...)
  mean the default and are dropped; any other well-formed value gets 400 ``unsupported_parameter``
  naming it, before anything is charged or sent.
- ``REFUSED``: content-part kinds a text-only model cannot take (400 naming the part).

:func:`screen_chat` and :func:`screen_completion` apply the tables to a JSON body before the request
model parses it; fields in no table are left for the model, which refuses them (400 ``Unrecognized
request argument``). Serving a feature later (issue 11: tools, ``response_format``, logprobs, ``n`` > 1)
means turning its rule into ``SERVED`` here and giving the request model the field; nothing else in the
parsing changes. docs/api.md's parameter table is generated from these tables (:func:`parameters_table`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from service.errors import InvalidRequest
from service.protocol import limits, template_kwargs
from service.protocol.features import MAX_TOOLS


class Support(StrEnum):
    """How radixgate treats a field."""

    SERVED = "served"
    ACCEPTED = "accepted, no effect"
    OFF_ONLY = "off only"
    REFUSED = "refused"


Check = Callable[[Any], bool]


def _anything(_: Any) -> bool:
    return True


def _is_null(value: Any) -> bool:
    return value is None


def _one_of(*values: Any) -> Check:
    """True for ``null`` and the given values (``==``, type-exact so that ``0`` is not ``false``)."""
    return lambda v: v is None or any(type(v) is type(x) and v == x for x in values)


def _typed(*types: type, check: Check = _anything) -> Check:
    """``null``, or an instance of ``types`` (``bool`` is not an ``int`` here) passing ``check``."""

    def valid(value: Any) -> bool:
        if value is None:
            return True
        if isinstance(value, bool) and bool not in types:
            return False
        return isinstance(value, types) and check(value)

    return valid


def _short_text(max_chars: int) -> Check:
    return _typed(str, check=lambda v: len(v) <= max_chars)


def _int_in(low: int, high: int) -> Check:
    return _typed(int, check=lambda v: low <= v <= high)


def _metadata(value: dict[Any, Any]) -> bool:
    """OpenAI's ``metadata``: at most 16 string pairs, keys up to 64 and values up to 512 characters."""
    return len(value) <= 16 and all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()
    )


def _prompt_cache_options(ttls: tuple[str, ...], extra: dict[str, Check] | None = None) -> Check:
    """OpenAI's ``prompt_cache_options``: ``mode`` implicit or explicit, ``ttl`` one of ``ttls``, plus the
    endpoint's ``extra`` fields; nothing else (nu13: any object, of any size and content, passed)."""
    fields: dict[str, Check] = {"mode": _one_of("implicit", "explicit"), "ttl": _one_of(*ttls)}
    fields.update(extra or {})
    return _typed(dict, check=lambda v: all(k in fields and fields[k](x) for k, x in v.items()))


def _text_format(value: dict[Any, Any]) -> bool:
    return value.get("type") in ("text", "json_object", "json_schema")


@dataclass(frozen=True, slots=True)
class FieldRule:
    """What radixgate does with one request field.

    Attributes:
        support: served, accepted with no effect, or refused when on.
        off: values meaning "not asked for" (dropped; an OFF_ONLY field is accepted with them).
        valid: well-formed values per OpenAI's schema; others get 400 ``invalid_value`` (SERVED fields are
            checked by the request model instead).
        served: for SERVED fields, the values actually served; other valid values get 400
            ``unsupported_value``.
        note: what a reader of docs/api.md's table needs to know.
        off_text: the off values in words (docs/api.md's table).
        expect: the valid values in words, for the 400 ``invalid_value`` message ("" : none given).
    """

    support: Support
    off: Check = _is_null
    valid: Check = _anything
    served: Check = _anything
    note: str = ""
    off_text: str = "null"
    expect: str = ""

    def describe(self) -> str:
        """The cell of docs/api.md's table: ``served``, ``accepted, no effect``, ``off only (null, false)``,
        ``refused``."""
        if self.support is Support.OFF_ONLY:
            return f"off only ({self.off_text})"
        return str(self.support)


SERVED = FieldRule(Support.SERVED)
EXTENSION = "not OpenAI: SGLang / vLLM sampling extension"


def _served(note: str = "", served: Check = _anything, valid: Check = _anything) -> FieldRule:
    return FieldRule(Support.SERVED, served=served, valid=valid, note=note)


def _accepted(valid: Check, note: str = "", expect: str = "") -> FieldRule:
    return FieldRule(Support.ACCEPTED, valid=valid, note=note, expect=expect)


METADATA_EXPECTED = "an object of at most 16 string pairs, keys up to 64 and values up to 512 characters"
TEXT_EXPECTED = f"a string of at most {limits.MAX_USER_CHARS} characters"


def _off_only(
    off: Check = _is_null, valid: Check = _anything, off_text: str = "null", note: str = ""
) -> FieldRule:
    return FieldRule(Support.OFF_ONLY, off=off, valid=valid, note=note, off_text=off_text)


def _null_or_empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


_SAMPLING: dict[str, FieldRule] = {
    "model": SERVED,
    "max_tokens": _served("bounded by the tenant's cap and the context the workers report"),
    "temperature": _served("0-2"),
    "top_p": _served("(0, 1]"),
    "frequency_penalty": _served("-2 to 2"),
    "presence_penalty": _served("-2 to 2"),
    "seed": _served(
        "int64, sent to the worker (choice i: seed + i); the same seed gives the same answer only from a "
        "worker whose sampling is deterministic, which SGLang does not promise across batches (the CPU "
        "worker `make up` starts is not)"
    ),
    "stop": _served(
        f"up to {limits.MAX_STOP_SEQUENCES}, {limits.MAX_STOP_BYTES} bytes each; empty and repeated "
        "ones dropped"
    ),
    "stream": SERVED,
    "stream_options": _served("include_usage; include_obfuscation accepted, no effect"),
    "user": _served(f"up to {limits.MAX_USER_CHARS} characters; keys consistent-hash routing"),
    "n": _served(
        "1 to api.max_n (default 8); each choice is its own worker request after the first one's prefill "
        "(prompt computed once); reserves prompt + n x max_tokens, usage counts every choice",
        valid=_int_in(1, 2**63),
    ),
    "logit_bias": _off_only(_null_or_empty, _typed(dict), "null, {}"),
    # radixgate and SGLang extensions (not in OpenAI's schema)
    "top_k": _served(f"{EXTENSION}; 1 to 2**30, -1 or 0 = off"),
    "min_p": _served(f"{EXTENSION}; 0-1"),
    "repetition_penalty": _served(f"{EXTENSION}; 0.01-2"),
    "ignore_eos": _served(EXTENSION),
    "priority": _served("radixgate: a priority class name, at most the tenant's own"),
}

CHAT_FIELDS: dict[str, FieldRule] = {
    **_SAMPLING,
    "messages": _served(
        f"text content; up to {limits.MAX_MESSAGES} messages, {limits.MAX_CONTENT_PARTS} content parts each"
    ),
    "chat_template_kwargs": _served(
        "not OpenAI: SGLang / vLLM extension; variables for the model's chat template, which the gateway "
        f'renders (e.g. `{{"enable_thinking": false}}`): up to {template_kwargs.MAX_KWARGS} entries, '
        f"{template_kwargs.MAX_BYTES} bytes of JSON, values nested {template_kwargs.MAX_DEPTH} deep; "
        "names of the template's own variables (`messages`, `tools`, `add_generation_prompt`, ...) refused"
    ),
    "max_completion_tokens": _served("as max_tokens"),
    "audio": _off_only(valid=_typed(dict)),
    "function_call": _off_only(_one_of("none", "auto"), _typed(str, dict), 'null, "none", "auto"'),
    "functions": _off_only(_null_or_empty, _typed(list), "null, []"),
    "logprobs": _served(
        "token, logprob, bytes, top_logprobs per answer token (special and stop tokens left out); tokens "
        "join to the content"
    ),
    "top_logprobs": _served("0-20 alternatives per token; needs logprobs: true"),
    "metadata": _accepted(_typed(dict, check=_metadata), "not stored", METADATA_EXPECTED),
    "modalities": _off_only(
        lambda v: v is None or (isinstance(v, list) and all(m == "text" for m in v)),
        _typed(list, check=lambda v: all(m in ("text", "audio") for m in v)),
        'null, ["text"]',
    ),
    "moderation": _off_only(valid=_typed(dict)),
    "parallel_tool_calls": _served("default true; false: at most one call"),
    "prediction": _off_only(valid=_typed(dict)),
    "prompt_cache_key": _accepted(
        _short_text(limits.MAX_USER_CHARS),
        "prefix caching and cache-aware routing need no key",
        TEXT_EXPECTED,
    ),
    "prompt_cache_options": _accepted(
        _prompt_cache_options(("30m",)), "prefix caching is automatic", 'an object with "mode" and "ttl"'
    ),
    "prompt_cache_retention": _accepted(
        _one_of("in_memory", "24h"), "the engine's cache decides", '"in_memory" or "24h"'
    ),
    "reasoning_effort": _off_only(
        _one_of("none"),
        _typed(str, check=lambda v: v in ("none", "minimal", "low", "medium", "high", "xhigh")),
        'null, "none"',
        "the served models do not reason",
    ),
    "response_format": _served(
        "text, json_object, json_schema (strict or not, the engine's grammar holds the answer to the "
        "schema); schemas checked before the engine",
        valid=_typed(dict, check=_text_format),
    ),
    "safety_identifier": _accepted(_short_text(limits.MAX_USER_CHARS), expect=TEXT_EXPECTED),
    "service_tier": _off_only(
        _one_of("auto", "default"),
        _typed(str, check=lambda v: v in ("auto", "default", "flex", "scale", "priority", "fast")),
        'null, "auto", "default"',
        "radixgate's `priority` classes do this",
    ),
    "store": _off_only(_one_of(False), _typed(bool), "null, false", "nothing is stored"),
    "tool_choice": _served(
        "none, auto, required, or a named function; required and named are forced by the engine's "
        "grammar (structural tag); an answer with calls ends with `finish_reason` `tool_calls` for auto "
        "and required, `stop` for a named function (as OpenAI)",
        served=lambda v: not isinstance(v, dict) or v.get("type") == "function",
    ),
    "tools": _served(
        f"function tools (up to {MAX_TOOLS}); parameters checked as JSON schemas; the call format is "
        "`api.tool_call_format`",
        served=lambda v: all(isinstance(t, dict) and t.get("type") == "function" for t in v),
        valid=_typed(list),
    ),
    "verbosity": _off_only(
        _one_of("medium"), _typed(str, check=lambda v: v in ("low", "medium", "high")), 'null, "medium"'
    ),
    "web_search_options": _off_only(valid=_typed(dict)),
}

COMPLETION_FIELDS: dict[str, FieldRule] = {
    **_SAMPLING,
    "prompt": _served("one string (or a list of one)"),
    "best_of": _off_only(_one_of(1), _int_in(1, 2**63), "null, 1"),
    "echo": _off_only(_one_of(False), _typed(bool), "null, false"),
    "logprobs": _served("0-5 alternatives per token: tokens, token_logprobs, top_logprobs, text_offset"),
    "suffix": _off_only(_one_of(""), _typed(str), 'null, ""'),
}

ROLES = ("system", "developer", "user", "assistant", "tool")

MESSAGE_FIELDS: dict[str, FieldRule] = {
    "role": _served(
        "system, developer (as system), user, assistant, tool; not the deprecated function",
        served=lambda v: v != "function",
        valid=_typed(str, check=lambda v: v in (*ROLES, "function")),
    ),
    "content": _served("text, or text parts"),
    "name": _accepted(_short_text(limits.MAX_NAME_CHARS), "not rendered"),
    "tool_call_id": _served(
        "tool messages are rendered through the chat template; each answers a call of the assistant "
        "message before it (OpenAI's rules, service.protocol.conversation)"
    ),
    "tool_calls": _served("assistant calls, rendered through the chat template"),
    "function_call": _off_only(valid=_typed(dict)),
    "audio": _off_only(valid=_typed(dict)),
    "refusal": _off_only(valid=_typed(str)),
}

CONTENT_PART_TYPES: dict[str, FieldRule] = {
    "text": SERVED,
    "image_url": FieldRule(Support.REFUSED, note="text-only model"),
    "input_audio": FieldRule(Support.REFUSED, note="text-only model"),
    "file": FieldRule(Support.REFUSED, note="text-only model"),
    "refusal": FieldRule(Support.REFUSED),
}

TEXT_PART_FIELDS: dict[str, FieldRule] = {
    "type": SERVED,
    "text": SERVED,
    "prompt_cache_breakpoint": _accepted(
        _typed(
            dict,
            check=lambda v: (
                v.get("mode") == "explicit"
                and set(v) <= {"mode", "ttl"}
                and _one_of("30m", "12h")(v.get("ttl"))
            ),
        ),
        "prefix caching is automatic",
        '{"mode": "explicit"} and an optional "ttl" ("30m" or "12h")',
    ),
}

STREAM_OPTION_FIELDS: dict[str, FieldRule] = {
    "include_usage": SERVED,
    "include_obfuscation": _accepted(_typed(bool), "chunks are not padded"),
}


def _unsupported(param: str) -> InvalidRequest:
    return InvalidRequest(
        f"Unsupported parameter: '{param}' is not served by this gateway yet (only its default/off values "
        "are accepted).",
        code="unsupported_parameter",
        param=param,
    )


def _json_excerpt(value: Any, limit: int = 64) -> str:
    """``value`` as the client wrote it (JSON: ``true``, not Python's ``True``; nu13), cut to ``limit``
    characters."""
    try:
        return json.dumps(value, separators=(", ", ": "))[:limit]
    except (RecursionError, ValueError):  # deeper than json_object lets through; kept safe all the same
        return f"<a nested {type(value).__name__}>"


def screen(body: Mapping[str, Any], table: Mapping[str, FieldRule], prefix: str = "") -> dict[str, Any]:
    """Apply ``table`` to one JSON object: drop off/accepted fields and ``null`` served ones, refuse
    unserved values. Fields not in ``table`` are kept for the request model to refuse.

    Raises:
        InvalidRequest: 400 ``unsupported_parameter`` / ``unsupported_value`` / ``invalid_value`` naming the
            field (``prefix`` + name).
    """
    kept: dict[str, Any] = {}
    for name, value in body.items():
        rule = table.get(name)
        if rule is None:
            kept[name] = value
            continue
        param = f"{prefix}{name}"
        if rule.support is Support.SERVED:
            if value is None:
                continue
            if rule.valid(value) and not rule.served(value):
                raise InvalidRequest(
                    f"Unsupported value: '{param}' = {_json_excerpt(value)} is not served by this gateway "
                    "yet.",
                    code="unsupported_value",
                    param=param,
                )
            kept[name] = value
        elif rule.support is Support.OFF_ONLY and rule.off(value):
            continue
        elif not rule.valid(value):
            expected = f": expected {rule.expect}" if rule.expect else ""
            raise InvalidRequest(f"Invalid value for '{param}'{expected}.", code="invalid_value", param=param)
        elif rule.support is Support.OFF_ONLY:
            raise _unsupported(param)
    return kept


def _screen_content(content: Any, prefix: str) -> Any:
    if not isinstance(content, list):
        return content
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            parts.append(part)
            continue
        kind = part.get("type")
        rule = CONTENT_PART_TYPES.get(kind) if isinstance(kind, str) else None
        if rule is not None and rule.support is Support.REFUSED:
            raise InvalidRequest(
                f"Content parts of type '{kind}' are not served by this gateway (text only).",
                code="unsupported_parameter",
                param=f"{prefix}{j}",
            )
        parts.append(screen(part, TEXT_PART_FIELDS, f"{prefix}{j}.") if kind == "text" else part)
    return parts


def refuse_stream_options_without_stream(body: Mapping[str, Any]) -> None:
    """OpenAI's own answer to ``stream_options`` without ``stream: true``: they describe a stream, and
    without one they would go unheeded.

    Raises:
        InvalidRequest: 400 ``invalid_value``, param ``stream_options``.
    """
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise InvalidRequest(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            code="invalid_value",
            param="stream_options",
        )


def _screen_common(body: Mapping[str, Any], table: Mapping[str, FieldRule]) -> dict[str, Any]:
    kept = screen(body, table)
    refuse_stream_options_without_stream(kept)
    options = kept.get("stream_options")
    if isinstance(options, dict):
        kept["stream_options"] = screen(options, STREAM_OPTION_FIELDS, "stream_options.")
    return kept


def screen_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`screen` a ``/v1/chat/completions`` body, its messages and their content parts."""
    kept = _screen_common(body, CHAT_FIELDS)
    messages = kept.get("messages")
    limits.check_count(messages, limits.MAX_MESSAGES, "messages", "messages")
    limits.check_count(kept.get("tools"), MAX_TOOLS, "tools", "tools")
    if isinstance(messages, list):
        screened = []
        for i, message in enumerate(messages):
            if isinstance(message, dict):
                message = screen(message, MESSAGE_FIELDS, f"messages.{i}.")
                parts = message.get("content")
                limits.check_count(parts, limits.MAX_CONTENT_PARTS, f"messages.{i}.content", "content parts")
                if "content" in message:
                    message["content"] = _screen_content(message["content"], f"messages.{i}.content.")
            screened.append(message)
        kept["messages"] = screened
    return kept


def screen_completion(body: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`screen` a ``/v1/completions`` body."""
    return _screen_common(body, COMPLETION_FIELDS)


def parameters_table() -> str:
    """docs/api.md's table of request parameters (markdown), from the tables above."""
    names = sorted(set(CHAT_FIELDS) | set(COMPLETION_FIELDS))
    lines = [
        "| parameter | /v1/chat/completions | /v1/completions | notes |",
        "|---|---|---|---|",
    ]
    for name in names:
        chat, text = CHAT_FIELDS.get(name), COMPLETION_FIELDS.get(name)
        notes = dict.fromkeys(rule.note for rule in (chat, text) if rule is not None and rule.note)
        note = "; ".join(notes)
        cells = [rule.describe() if rule else "—" for rule in (chat, text)]
        lines.append(f"| `{name}` | {cells[0]} | {cells[1]} | {note} |")
    for name, rule in MESSAGE_FIELDS.items():
        lines.append(f"| `messages[].{name}` | {rule.describe()} | — | {rule.note} |")
    for kind, rule in CONTENT_PART_TYPES.items():
        lines.append(f'| `messages[].content[]` `"type": "{kind}"` | {rule.describe()} | — | {rule.note} |')
    return "\n".join(lines)


__all__ = [
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "CONTENT_PART_TYPES",
    "MESSAGE_FIELDS",
    "FieldRule",
    "Support",
    "parameters_table",
    "screen",
    "screen_chat",
    "screen_completion",
]

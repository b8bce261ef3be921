"""Structured outputs: ``response_format`` as a grammar for SGLang's grammar backend.

``json_object`` becomes ``sampling_params.json_schema = '{"type": "object"}'`` and ``json_schema`` the
caller's schema (SGLang 0.5.23 ``protocol.py`` ``to_sampling_params`` does the same; its xgrammar backend
compiles the schema and masks every token that would leave it). ``strict`` is accepted either way: the
grammar always holds the answer to the schema. The schema is checked against the JSON Schema
meta-schema first, so a malformed one is a 400 naming ``response_format.json_schema.schema``.
"""

from __future__ import annotations

import json

from service.errors import InvalidRequest
from service.protocol.features import ResponseFormat, check_schema

ANY_OBJECT = '{"type": "object"}'
"""The grammar of ``json_object``: any JSON object."""


def response_schema(fmt: ResponseFormat | None, param: str = "response_format") -> str | None:
    """The JSON schema text for ``sampling_params.json_schema``, or None for free text.

    Raises:
        InvalidRequest: ``json_schema`` without a schema object, or a schema that is not a JSON schema.
    """
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ANY_OBJECT
    spec = fmt.json_schema
    if spec is None:
        raise InvalidRequest(
            "response_format of type 'json_schema' needs 'json_schema'.",
            code="missing_required_parameter",
            param=f"{param}.json_schema",
        )
    schema = spec.schema_ if spec.schema_ is not None else {"type": "object"}
    problem = check_schema(schema)
    if problem is not None:
        raise InvalidRequest(
            f"Invalid schema for response_format '{spec.name}': {problem}",
            code="invalid_json_schema",
            param=f"{param}.json_schema.schema",
        )
    return json.dumps(schema, ensure_ascii=False)


__all__ = ["ANY_OBJECT", "response_schema"]

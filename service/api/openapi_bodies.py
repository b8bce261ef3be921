"""Request-body schemas of the OpenAI routes in the gateway's OpenAPI document (``/openapi.json``, ``/docs``).

The completion routes read their body themselves (no dependency solving on the hot path, see
:mod:`service.api.openai_routes`), so FastAPI does not know their body models. Each route declares its model
with :func:`json_body`, and :func:`install_body_schemas` adds the models' JSON Schemas (pydantic's, as
validated) to ``components.schemas``, so clients, ``/docs`` and schema-driven tools (the fuzz test uses
schemathesis) see what the gateway accepts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route whose required JSON body is ``model``."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_body_schemas(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` include the JSON Schemas of ``models`` (and the models they use).

    Raises:
        ValueError: (at the first ``openapi()`` call) a model's name is already a different schema there.
    """
    original: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        document = original()  # FastAPI's, cached in app.openapi_schema
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
        for name, schema in defs.get("$defs", {}).items():
            if schemas.setdefault(name, schema) != schema:
                raise ValueError(f"two different OpenAPI schemas named {name!r}")
        return document

    app.openapi = openapi  # type: ignore[method-assign]

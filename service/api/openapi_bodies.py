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

ADMIN_SUFFIX = "Input"
"""Appended to the schema names of the admin bodies: the admin routes answer with models of the same names
(a tenant's ``Quotas``, a key's ``BucketLimits``), whose output schemas differ from their input ones
(unknown fields refused), as FastAPI names its own ``-Input``/``-Output`` pairs."""


def json_body(model: type[BaseModel], suffix: str = "") -> dict[str, Any]:
    """``openapi_extra`` of a route whose required JSON body is ``model`` (its schema named with
    ``suffix``, as :func:`install_body_schemas` was given it)."""
    schema = {"$ref": REF.format(model=model.__name__ + suffix)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_body_schemas(app: FastAPI, models: list[type[BaseModel]], suffix: str = "") -> None:
    """Make ``app.openapi()`` include the JSON Schemas of ``models`` (and the models they use), each
    named with ``suffix`` after its model's name.

    Raises:
        ValueError: (at the first ``openapi()`` call) a model's name is already a different schema there.
    """
    original: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        document = original()  # FastAPI's, cached in app.openapi_schema
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        template = REF.replace("{model}", "{model}" + suffix)
        _, defs = models_json_schema([(m, "validation") for m in models], ref_template=template)
        for name, schema in defs.get("$defs", {}).items():
            if schemas.setdefault(name + suffix, schema) != schema:
                raise ValueError(f"two different OpenAPI schemas named {name + suffix!r}")
        return document

    app.openapi = openapi  # type: ignore[method-assign]

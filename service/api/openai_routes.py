"""OpenAI-compatible routes (thin: parse, then hand to :class:`service.pipeline.dispatch.Dispatcher`).

The two completion routes take only the request (no dependency solving): :class:`service.app.GatewayApp`
calls them straight from its ASGI entry (:data:`COMPLETION_ROUTES`); FastAPI keeps them for its schema.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ValidationError

from service.api.cancellation import ClientDisconnected, SendBoundedStreamingResponse, until_disconnect
from service.api.deps import (
    StateDep,
    TenantDep,
    authenticate,
    gateway_state,
    json_object,
    read_body,
    request_id,
)
from service.api.errors import FastJSONResponse, validation_error
from service.api.openapi_bodies import json_body
from service.api.rate_limit_headers import rate_limit_headers
from service.errors import GatewayError, NotFound
from service.observability.breakdown import RequestTiming
from service.openai.responses import ResponsesShaper
from service.openai.shapes import Shaper
from service.pipeline.prepare import PreparedRequest, may_use, may_use_models
from service.pipeline.request_trace import begin_trace
from service.protocol.completions import ChatCompletionRequest, CompletionRequest, now_s
from service.protocol.conversation import check_chat_references, check_responses_references
from service.protocol.fields import screen_chat, screen_completion
from service.protocol.responses import ResponsesRequest, parse_responses, responses_param, to_chat
from service.state import GatewayState
from tenancy.models import Tenant

router = APIRouter(prefix="/v1", tags=["openai"])

M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: dict[str, Any]) -> M:
    """Validate a JSON body; raises :class:`APIError` 400 in OpenAI's shape."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc, body) from exc


async def _serve(
    request: Request,
    state: GatewayState,
    tenant: Tenant,
    req: ChatCompletionRequest | CompletionRequest,
    body_bytes: int,
    timing: RequestTiming,
    shaper: Callable[[PreparedRequest], Shaper] | None = None,
) -> Response:
    """Prepare, admit and serve a request (of a ``body_bytes`` body, arrived at ``timing.start``);
    ``shaper`` makes the response format (default: chat or text completion). The answer carries the
    request's phases so far in a ``Server-Timing`` header (:mod:`service.observability.breakdown`) and its
    rate-limit state in OpenAI's ``x-ratelimit-*`` headers (:mod:`service.api.rate_limit_headers`; none
    when no bucket limits it)."""
    dispatcher = state.dispatcher
    scope_state = request.scope["state"]
    key = scope_state.get("api_key")  # its terms: models, quotas, cap (service.api.deps.authenticate)
    if body_bytes > state.settings.api.offload_body_bytes:
        try:  # a client that leaves while its long prompt waits for a slot gives up its place
            offloaded = dispatcher.prepare_offloaded(tenant, req, request_id(request), timing, key)
            prepared = await until_disconnect(request, offloaded)
        except ClientDisconnected:
            return Response(status_code=499)
    else:
        prepared = dispatcher.prepare(tenant, req, request_id(request), timing, key)
    timing.mark("prepare")
    # its key's buckets and concurrency cap ride on prepared.key
    reservation, rate_limits = await dispatcher.admit(prepared)
    key_id = scope_state.get("key_id", "")
    timing.mark("quota")
    scope_state["admitted"] = True  # the dispatcher's settle logs and counts it from here
    timing.client_request_id = scope_state.get("client_request_id")
    if (tracing := request.app.state.tracing) is not None:  # its span ends with its log line
        begin_trace(tracing, prepared, request.scope)
    shape = shaper(prepared) if shaper is not None else None
    if not prepared.stream:
        try:
            work = dispatcher.complete(prepared, reservation, shape, key_id)
            result = await until_disconnect(request, work)
        except ClientDisconnected:
            return Response(status_code=499)
        headers = {"Server-Timing": timing.server_timing()}
        if rate_limits:
            headers.update(rate_limit_headers(rate_limits))
        return FastJSONResponse(result, headers=headers)
    events = dispatcher.stream(prepared, reservation, shape, key_id)
    try:
        # The first event arrives with the first token: errors before it get a real HTTP status.
        first = await until_disconnect(request, events.__anext__())
    except ClientDisconnected:
        return Response(status_code=499)

    async def rest() -> AsyncGenerator[bytes, None]:
        try:
            yield first
            async for event in events:
                yield event
        finally:
            await events.aclose()

    return SendBoundedStreamingResponse(
        rest(),
        send_timeout_s=state.settings.api.stream_send_timeout_s,
        request_id=prepared.rid,
        timing=timing,
        media_type="text/event-stream",
        headers={
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            "Server-Timing": timing.server_timing(),
            **(rate_limit_headers(rate_limits) if rate_limits else {}),
        },
    )


@router.post("/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions`` (stream and non-stream)."""
    timing = RequestTiming()
    state = gateway_state(request)
    tenant = await authenticate(request, state)
    timing.mark("auth")
    raw = await read_body(request, state.settings.api.max_body_bytes, state.settings.api.body_timeout_s)
    req = parse(ChatCompletionRequest, screen_chat(json_object(raw)))
    check_chat_references(req.messages)
    return await _serve(request, state, tenant, req, len(raw), timing)


@router.post("/completions", openapi_extra=json_body(CompletionRequest))
async def completions(request: Request) -> Response:
    """``POST /v1/completions`` (one prompt; stream and non-stream)."""
    timing = RequestTiming()
    state = gateway_state(request)
    tenant = await authenticate(request, state)
    timing.mark("auth")
    raw = await read_body(request, state.settings.api.max_body_bytes, state.settings.api.body_timeout_s)
    req = parse(CompletionRequest, screen_completion(json_object(raw)))
    return await _serve(request, state, tenant, req, len(raw), timing)


@router.post("/responses", openapi_extra=json_body(ResponsesRequest))
async def responses(request: Request) -> Response:
    """``POST /v1/responses`` (stateless Responses API, stream and non-stream; see
    :mod:`service.protocol.responses`)."""
    timing = RequestTiming()
    state = gateway_state(request)
    tenant = await authenticate(request, state)
    timing.mark("auth")
    raw = await read_body(request, state.settings.api.max_body_bytes, state.settings.api.body_timeout_s)
    req = parse_responses(json_object(raw))
    check_responses_references(req)
    echo = req.echo()

    def shaper(prepared: PreparedRequest) -> Shaper:
        echo["max_output_tokens"] = prepared.max_tokens
        return ResponsesShaper(prepared.rid, prepared.model, now_s(), echo)

    try:
        return await _serve(request, state, tenant, to_chat(req), len(raw), timing, shaper)
    except GatewayError as err:  # raised on the chat form: name the Responses parameter
        chat_param, err.param = err.param, responses_param(err.param)
        if chat_param and err.param and chat_param != err.param and "." not in chat_param:
            err.message = re.sub(rf"\b{re.escape(chat_param)}\b", err.param, err.message)  # nu15
        raise


BODY_MODELS = (ChatCompletionRequest, CompletionRequest, ResponsesRequest)
"""JSON bodies of the routes below, in the OpenAPI document (:mod:`service.api.openapi_bodies`)."""

COMPLETION_ROUTES: dict[str, Callable[[Request], Awaitable[Response]]] = {
    "/v1/chat/completions": chat_completions,
    "/v1/completions": completions,
    "/v1/responses": responses,
}
"""``POST`` path -> handler of the routes served without dependency solving."""


def _models_of(tenant: Tenant, state: GatewayState, request: Request) -> list[dict[str, Any]]:
    """OpenAI model objects of the models ``tenant`` and the request's API key may use (a key's
    ``allowed_models`` narrows its tenant's): each id and alias, with ``root`` (the
    model's id: an alias's model), its ``context_length`` (tokens: the most prompt + ``max_tokens`` a
    request may ask for, :meth:`~service.pipeline.served_models.ServedModels.context_length`) and
    ``capabilities`` (``tools``, ``structured_outputs``)."""
    key = request.scope.get("state", {}).get("api_key")
    key_models = key.allowed_models if key is not None else None
    found = []
    for lane in state.models.lanes:
        model = lane.model
        context = state.models.context_length(model.id)
        capabilities = {"tools": model.tools, "structured_outputs": model.structured_outputs}
        found += [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": model.owned_by,
                "root": model.id,
                "context_length": context,
                "capabilities": capabilities,
            }
            for name in model.names
            if may_use(tenant, name, model)
            and (key_models is None or may_use_models(key_models, name, model))
        ]
    return found


@router.get("/models")
async def list_models(request: Request, tenant: TenantDep, state: StateDep) -> dict[str, Any]:
    """``GET /v1/models``: the models this tenant and key may use."""
    return {"object": "list", "data": _models_of(tenant, state, request)}


@router.get("/models/{model_id:path}")
async def retrieve_model(
    model_id: str, request: Request, tenant: TenantDep, state: StateDep
) -> dict[str, Any]:
    """``GET /v1/models/{model}`` (ids may hold '/'): one model, 404 when unknown or not this tenant's (or
    not its key's)."""
    for model in _models_of(tenant, state, request):
        if model["id"] == model_id:
            return model
    raise NotFound(f"The model '{model_id}' does not exist.", code="model_not_found", param="model")


@router.get("/usage")
async def own_usage(tenant: TenantDep, state: StateDep) -> dict[str, Any]:
    """``GET /v1/usage``: the caller's own tenant's usage counters and quotas (its answers this replica
    has sent counted: their settles are awaited, :meth:`service.pipeline.settlement.Settler.settled`)."""
    await state.dispatcher.settled(tenant.id)
    return await state.billing.usage_report(state.usage, tenant.id, tenant.quotas)

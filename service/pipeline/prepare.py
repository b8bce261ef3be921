"""Step 1 of the pipeline: validate a request against the served models and the tenant, render its prompt.

Nothing is charged here: every failure is a 4xx domain error (:mod:`service.errors`) before any quota is
touched and before anything reaches a worker.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

from policies.cost import reserved_tokens
from service.config.models import ServedModel
from service.config.settings import Settings
from service.errors import InvalidRequest, NotFound, PermissionDenied
from service.observability.breakdown import RequestTiming
from service.openai.choices import OutputSpec
from service.openai.structured import response_schema
from service.openai.tool_formats import FORMATS
from service.openai.tools import plan_tools, template_messages
from service.pipeline.prompting import PromptError, RenderedPrompt
from service.pipeline.served_models import ModelLane, ServedModels
from service.pipeline.tenant_classes import ClassResolver
from service.protocol.completions import ChatCompletionRequest, CompletionRequest
from service.workers.worker_info import TokenLimits
from tenancy.models import ApiKeyRecord, Tenant


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated request, ready to be admitted and sent.

    Attributes:
        rid: request id (also SGLang's ``rid`` and the ``x-request-id`` header).
        tenant: the caller's tenant.
        model: the model name the request gave (an id or an alias; echoed in the answer).
        chat: chat completion (True) or text completion.
        prompt: rendered prompt and its token count.
        max_tokens: completion limit, tokens.
        priority_class: the class the request runs in.
        body: the SGLang ``/generate`` body (without ``stream``).
        stream: answer as SSE.
        include_usage: end the stream with a usage chunk.
        arrival: ``time.perf_counter()`` at arrival, s.
        session_id: ``<tenant>:<user>`` when the request names a ``user`` (consistent-hash routing key).
        n: answers (choices) asked for; each may use ``max_tokens``.
        output: how answers are read (tool calls, logprobs).
        model_id: the canonical id of that model (its lane; the ``model`` label of metrics and logs).
        timing: where its time goes (its phases, :mod:`service.observability.breakdown`); its ``start`` is
            ``arrival``.
        key: the record of the API key it came with (its terms: models, quotas); None when not known.
    """

    rid: str
    tenant: Tenant
    model: str
    chat: bool
    prompt: RenderedPrompt
    max_tokens: int
    priority_class: str
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    arrival: float
    session_id: str | None = None
    n: int = 1
    output: OutputSpec = field(default_factory=OutputSpec)
    model_id: str = ""
    timing: RequestTiming = field(default_factory=RequestTiming)
    key: ApiKeyRecord | None = None

    @property
    def reserved_tokens(self) -> int:
        """Tokens reserved in the TPM bucket: prompt + n x max_tokens (the prompt is computed once)."""
        return reserved_tokens(self.prompt.num_tokens, self.n * self.max_tokens)


class RequestPreparer:
    """Turns a parsed OpenAI request into a :class:`PreparedRequest`.

    Args:
        settings: the app's settings (priority classes, limits).
        models: the served models: each request is rendered and counted with its model's template and
            tokenizer, and checked against its context length (the smaller of the model's setting and
            the token limits its workers reported).
    """

    def __init__(self, settings: Settings, models: ServedModels) -> None:
        self._settings = settings
        self._models = models
        self._classes = ClassResolver(settings)

    def limits(self, model_id: str | None = None) -> TokenLimits:
        """Prompt and prompt + completion limits of a model (tokens; default: the first): its context
        length setting and what its workers reported, whichever is smaller
        (:meth:`ServedModels.limits`: what ``/v1/models`` shows too)."""
        return self._models.limits(self._models.default.model.id if model_id is None else model_id)

    def prepare(
        self,
        tenant: Tenant,
        req: ChatCompletionRequest | CompletionRequest,
        rid: str,
        timing: RequestTiming,
        key: ApiKeyRecord | None = None,
    ) -> PreparedRequest:
        """Check a request against the served models, the tenant's limits and its API key's (``key``),
        and render its prompt; ``timing`` is the request's breakdown, started at its arrival.

        Raises:
            NotFound: unknown model.
            PermissionDenied: model (by the tenant or by the key) or priority class not allowed.
            InvalidRequest: bad max_tokens, unknown priority class, context length exceeded or template
                failure.
        """
        lane = self._models.lane(req.model)
        if lane is None:
            raise NotFound(f"The model '{req.model}' does not exist.", code="model_not_found", param="model")
        model = lane.model
        if not may_use(tenant, req.model, model):
            raise PermissionDenied(
                f"This API key may not use model '{req.model}'.", code="model_not_allowed", param="model"
            )
        if (
            key is not None
            and key.allowed_models is not None
            and not may_use_models(key.allowed_models, req.model, model)
        ):
            raise PermissionDenied(
                f"This API key (rg-{key.key_id}) is restricted to models {key.allowed_models[:8]}; "
                f"it may not use model '{req.model}'.",
                code="model_not_allowed",
                param="model",
            )
        priority_class = self._priority_class(tenant, req.priority)
        if req.n > self._settings.api.max_n:
            raise InvalidRequest(
                f"n is {req.n}; this gateway serves at most {self._settings.api.max_n} choices per request.",
                code="unsupported_value",
                param="n",
            )
        output = OutputSpec()
        constraint: dict[str, Any] = {}
        prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        try:
            renderer = lane.renderer
            if isinstance(req, ChatCompletionRequest):
                _check_features(req, model)
                plan = plan_tools(req, FORMATS[model.tool_call_format])
                messages, tools = template_messages(
                    req.messages, plan, renderer.renders_tools, renderer.renders_tool_calls
                )
                prompt = renderer.render_chat(messages, tools, req.chat_template_kwargs)
                output = OutputSpec(tools=plan, logprobs=self._chat_logprobs(req))
                constraint = self._constraint(plan.constraint(), response_schema(req.response_format))
                if constraint and not model.structured_outputs:
                    what = "structured outputs (a forced or strict tool call)"
                    raise _unserved(req.model, what, "tool_choice")
            else:
                prompt = renderer.render_text(req.prompt_text())
                output = OutputSpec(logprobs=req.logprobs)
        except PromptError as exc:
            raise InvalidRequest(str(exc), code="invalid_prompt", param=prompt_param) from exc
        max_tokens = self._max_tokens(
            tenant, req.requested_max_tokens(), prompt.num_tokens, prompt_param, req.n, lane
        )
        body = self._generate_body(req, prompt.text, max_tokens, rid, priority_class)
        body["sampling_params"].update(constraint)
        if output.logprobs is not None:
            body["return_logprob"] = True
            body["top_logprobs_num"] = output.logprobs
        return PreparedRequest(
            rid=rid,
            tenant=tenant,
            model=req.model,
            chat=isinstance(req, ChatCompletionRequest),
            prompt=prompt,
            max_tokens=max_tokens,
            priority_class=priority_class,
            body=body,
            stream=req.stream,
            include_usage=req.include_usage,
            arrival=timing.start,
            session_id=f"{tenant.id}:{req.user}" if req.user else None,
            n=req.n,
            output=output,
            model_id=model.id,
            timing=timing,
            key=key,
        )

    @staticmethod
    def _chat_logprobs(req: ChatCompletionRequest) -> int | None:
        """Alternatives per token when ``logprobs`` is on (``top_logprobs``, default 0), else None.

        Raises:
            InvalidRequest: ``top_logprobs`` without ``logprobs`` (OpenAI refuses it too).
        """
        if not req.logprobs:
            if req.top_logprobs:
                raise InvalidRequest(
                    "top_logprobs needs logprobs set to true.", code="invalid_value", param="top_logprobs"
                )
            return None
        return req.top_logprobs or 0

    @staticmethod
    def _constraint(tool_tag: dict[str, Any] | None, schema: str | None) -> dict[str, Any]:
        """The grammar for ``sampling_params``: a tool structural tag or a response JSON schema (SGLang takes
        one grammar per request).

        Raises:
            InvalidRequest: both a forced or strict tool call and a JSON ``response_format``.
        """
        if tool_tag is not None and schema is not None:
            raise InvalidRequest(
                "response_format cannot be combined with a required, named or strict tool call; use one.",
                code="unsupported_value",
                param="response_format",
            )
        if tool_tag is not None:
            return {"structural_tag": json.dumps(tool_tag, ensure_ascii=False)}
        if schema is not None:
            return {"json_schema": schema}
        return {}

    def _priority_class(self, tenant: Tenant, asked: str | None) -> str:
        """The request's class: the tenant's own (a stored class that is no longer configured is replaced
        by ``default_priority_class``: :mod:`service.pipeline.tenant_classes`), or the one it asks for, never
        above
        the tenant's highest. Only a class the request names is its error (``param: "priority"``)."""
        classes = self._settings.priority_classes
        tenant_classes = self._classes.classes_of(tenant)
        if asked is None:
            return tenant_classes.own
        if asked not in classes:
            raise InvalidRequest(
                f"Unknown priority class '{asked}'; known: {sorted(classes)}.",
                code="invalid_priority",
                param="priority",
            )
        if classes[asked].rank > classes[tenant_classes.ceiling].rank:
            raise PermissionDenied(
                f"This tenant may not use priority class '{asked}'.",
                code="priority_not_allowed",
                param="priority",
            )
        return asked

    def _max_tokens(
        self,
        tenant: Tenant,
        asked: int | None,
        prompt_tokens: int,
        prompt_param: str,
        n: int,
        lane: ModelLane,
    ) -> int:
        limits = self.limits(lane.model.id)
        context = limits.max_total_tokens
        room = context - prompt_tokens
        if room < 1 or prompt_tokens > limits.max_prompt_tokens:
            raise InvalidRequest(
                f"The prompt is {prompt_tokens} tokens; this model takes at most "
                f"{min(limits.max_prompt_tokens, context - 1)} prompt tokens (context {context}).",
                code="context_length_exceeded",
                param=prompt_param,
            )
        cap = tenant.max_tokens_cap
        if asked is None:
            default = self._settings.api.default_max_tokens
            return min(default, cap or room, room, _burst_room(tenant, prompt_tokens, n))
        if cap is not None and asked > cap:
            raise InvalidRequest(
                f"max_tokens is {asked}; this tenant's cap is {cap}.",
                code="max_tokens_above_cap",
                param="max_tokens",
            )
        if asked > room:
            raise InvalidRequest(
                f"prompt ({prompt_tokens}) + max_tokens ({asked}) exceeds the context length ({context}).",
                code="context_length_exceeded",
                param="max_tokens",
            )
        return asked

    def _generate_body(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        text: str,
        max_tokens: int,
        rid: str,
        priority_class: str,
    ) -> dict[str, Any]:
        sampling: dict[str, Any] = {"max_new_tokens": max_tokens}
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "ignore_eos",
        ):
            value = getattr(req, name)
            if value is not None:
                sampling[name] = value
        if req.top_k is not None and req.top_k > 0:  # -1 and 0 mean "off" (vLLM, SGLang)
            sampling["top_k"] = req.top_k
        if req.seed is not None:
            sampling["sampling_seed"] = req.seed
        if req.stop_list():
            sampling["stop"] = req.stop_list()
        body: dict[str, Any] = {"text": text, "sampling_params": sampling, "rid": rid}
        if self._settings.upstream.send_priority:
            body["priority"] = self._settings.priority_classes[priority_class].sglang_priority
        return body


def may_use(tenant: Tenant, name: str, model: ServedModel) -> bool:
    """Whether ``tenant`` may use model ``name`` (an id or alias of ``model``): every model without an
    ``allowed_models`` list; else when the list names ``name`` itself or the model's id (allowing an id
    allows its aliases; allowing an alias allows that name only)."""
    allowed = tenant.allowed_models
    return allowed is None or name in allowed or model.id in allowed


def may_use_models(allowed: list[str], name: str, model: ServedModel) -> bool:
    """Whether an ``allowed_models`` list (a key's) lets model ``name`` through, by :func:`may_use`'s
    rule."""
    return name in allowed or model.id in allowed


def _unserved(name: str, what: str, param: str) -> InvalidRequest:
    """The 400 of a feature the model is configured not to serve (``RADIXGATE_MODELS``' switches)."""
    return InvalidRequest(
        f"The model '{name}' does not serve {what}.", code="unsupported_parameter", param=param
    )


def _check_features(req: ChatCompletionRequest, model: ServedModel) -> None:
    """Refuse tools or a JSON ``response_format`` that ``model`` is configured not to serve.

    Raises:
        InvalidRequest: 400 ``unsupported_parameter``.
    """
    if req.tools and not model.tools:
        raise _unserved(req.model, "tools", "tools")
    fmt = req.response_format
    if fmt is not None and fmt.type != "text" and not model.structured_outputs:
        raise _unserved(req.model, "structured outputs", "response_format")


def _burst_room(tenant: Tenant, prompt_tokens: int, n: int) -> int:
    """The largest max_tokens whose reservation (prompt + n x max_tokens) fits the tenant's token burst, for
    a request that gives none (nu19: the default of 256 made every such request of a tenant with a smaller
    burst a 413 ``request_exceeds_burst`` telling it to lower a max_tokens it never sent); no bound (a large
    number) without a token quota or when even one token per choice does not fit (the 413 is then the
    prompt's)."""
    quotas = tenant.quotas
    burst = quotas.effective_token_burst
    if quotas.tokens_per_min is None or burst is None:
        return sys.maxsize
    fit = int((burst - prompt_tokens) // n)
    return fit if fit >= 1 else sys.maxsize

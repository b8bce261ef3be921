"""The model registry: every model the gateway serves, each with its workers, tokenizer, context length,
routing, scheduler settings and class goals (``RADIXGATE_MODELS``, :class:`ModelSettings`).

``models`` is a list of :class:`ModelSettings`, e.g. (JSON in the environment, ``[[models]]`` in TOML)::

    RADIXGATE_MODELS='[
      {"id": "smollm2", "aliases": ["small"], "workers": ["http://127.0.0.1:30000"],
       "tokenizer_path": "/models/SmolLM2-135M-Instruct",
       "priority_classes": {"interactive": {"ttft_goal_ms": 500}}},
      {"id": "llama-3.1-8b", "workers": ["http://10.0.0.7:30000"], "tokenizer_path": "/models/llama",
       "tool_call_format": "llama3_json", "routing": {"policy": "least_load"},
       "priority_classes": {"interactive": {"ttft_goal_ms": 2000}}}]'

Unset (the default), the gateway's single-model settings are the registry's one entry, unchanged:
``engine.served_model_name`` with ``extra_models`` as its aliases, ``upstream.workers``,
``api.tokenizer_path`` (else ``engine.model_path``), ``api.context_length``, ``api.tool_call_format``, and
the gateway's classes, scheduler and routing sections (:func:`build_registry`).

Each model's class goals, scheduler and routing settings default to the gateway's and are overridden field
by field; the class names and ranks stay the gateway's (a tenant's class applies to every model). The
context length is the smaller of the setting and what the model's workers report (``/server_info``);
:data:`DEFAULT_CONTEXT_LENGTH` only when neither says. Shapes: times in ms, lengths in tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from policies.admission_types import CoreConfig
from service.config.checks import TOGETHER, HttpUrls
from service.config.policies import PriorityClassSettings, RoutingSettings, SchedulerSettings

DEFAULT_CONTEXT_LENGTH = 8192
"""Prompt + completion limit of a model whose setting and workers both say nothing, tokens (the
gateway's historical default)."""

ToolCallFormatName = Literal["hermes", "llama3_json", "mistral"]
"""How a model family writes tool calls (:mod:`service.openai.tool_formats`)."""

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)


class ClassGoals(BaseModel):
    """One class's goals for one model; each unset field is the gateway's (``priority_classes``)."""

    model_config = _STRICT

    ttft_goal_ms: float | None = Field(None, gt=0, description="Time-to-first-token goal, ms.")
    serve_late: bool | None = Field(None, description="Queue predicted misses (with queue_wait_budget_ms).")
    queue_wait_budget_ms: float | None = Field(None, gt=0, description="Longest gateway queue wait, ms.")
    max_queue_len: int | None = Field(None, ge=1, description="Most requests waiting in this band.")
    min_share: float | None = Field(None, ge=0, lt=1, description="Guaranteed fraction of tokens.")
    window_share: float | None = Field(None, gt=0, le=1, description="Fraction of a worker's window.")


def _check_overrides(section: type[BaseModel], values: dict[str, Any], what: str) -> dict[str, Any]:
    """``values`` as overrides of ``section``'s fields: every key one of its fields, every value valid. A
    rule between fields (:data:`~service.config.checks.TOGETHER`) is not judged here, against the defaults,
    but once the overrides are laid over the gateway's section (:func:`build_registry`)."""
    unknown = sorted(set(values) - set(section.model_fields))
    if unknown:
        raise ValueError(f"unknown {what} setting(s) {unknown}; known: {sorted(section.model_fields)}")
    try:
        section.model_validate(values)
    except ValidationError as exc:
        if any(e["type"] != TOGETHER for e in exc.errors()):
            raise
    return values


_Section = TypeVar("_Section", bound=BaseModel)


def _overlaid(section: _Section, overrides: dict[str, Any], what: str) -> _Section:
    """``section`` with ``overrides`` laid over it, validated as a whole.

    Raises:
        ValueError: the result breaks a rule between fields (``what``: e.g. ``model 'm', scheduler``).
    """
    try:
        return type(section).model_validate({**section.model_dump(), **overrides})
    except ValidationError as exc:
        reason = "; ".join(f"{'.'.join(map(str, e['loc']))} {e['msg']}" for e in exc.errors())
        raise ValueError(f"{what}: {reason}") from None


class ModelSettings(BaseModel):
    """One served model (an entry of ``RADIXGATE_MODELS``)."""

    model_config = _STRICT

    id: str = Field(..., min_length=1, max_length=256, description="Model id clients send as `model`.")
    aliases: list[str] = Field(default_factory=list, description="Further names of the same model.")
    workers: HttpUrls = Field(default_factory=list, description="Base URLs of this model's SGLang workers.")
    tokenizer_path: Path | None = Field(
        None,
        description="Folder with tokenizer.json and the chat template (chat_template.jinja or "
        "tokenizer_config.json); required, except for the model named engine.served_model_name "
        "(default: api.tokenizer_path, else engine.model_path).",
    )
    context_length: int | None = Field(
        None, ge=16, description="Prompt + completion limit, tokens (unset: api.context_length, workers)."
    )
    owned_by: str = Field("radixgate", description="`owned_by` on /v1/models.")
    tool_call_format: ToolCallFormatName | None = Field(
        None, description="Tool-call format of the model family (unset: api.tool_call_format)."
    )
    tools: bool = Field(True, description="Serve requests with tools (false: 400).")
    structured_outputs: bool = Field(True, description="Serve JSON response formats (false: 400).")
    routing: dict[str, Any] = Field(
        default_factory=dict, description='Overrides of the routing section, e.g. {"policy": ...}.'
    )
    scheduler: dict[str, Any] = Field(default_factory=dict, description="Overrides of the scheduler section.")
    priority_classes: dict[str, ClassGoals] = Field(
        default_factory=dict, description="Per-class goal overrides: class name -> goals."
    )

    @field_validator("aliases")
    @classmethod
    def _aliases_named(cls, value: list[str]) -> list[str]:
        if any(not a or len(a) > 256 for a in value):
            raise ValueError("an alias is 1 to 256 characters")
        return list(dict.fromkeys(value))

    @field_validator("routing")
    @classmethod
    def _routing_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _check_overrides(RoutingSettings, value, "routing")

    @field_validator("scheduler")
    @classmethod
    def _scheduler_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _check_overrides(SchedulerSettings, value, "scheduler")


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model as the gateway serves it: every setting resolved (the gateway's where the model sets none).

    Attributes:
        id: canonical id (the ``model`` label of metrics and logs; aliases fold into it).
        aliases: further names clients may send.
        workers: its workers from settings (base URLs).
        tokenizer_path: folder of ``tokenizer.json`` and its chat template.
        context_length: the setting, tokens; None: what the workers report, else
            :data:`DEFAULT_CONTEXT_LENGTH`.
        classes: the gateway's classes with this model's goals.
        scheduler: scheduler settings.
        routing: routing settings.
        tool_call_format: its tool-call format.
        tools: serves requests with tools.
        structured_outputs: serves JSON response formats.
        owned_by: ``owned_by`` on ``/v1/models``.
    """

    id: str
    tokenizer_path: Path
    classes: Mapping[str, PriorityClassSettings]
    scheduler: SchedulerSettings
    routing: RoutingSettings
    aliases: tuple[str, ...] = ()
    workers: tuple[str, ...] = ()
    context_length: int | None = None
    tool_call_format: ToolCallFormatName = "hermes"
    tools: bool = True
    structured_outputs: bool = True
    owned_by: str = "radixgate"
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(dict.fromkeys([self.id, *self.aliases])))

    def core_config(self) -> CoreConfig:
        """The admission core's configuration for this model (its classes, windows, routing)."""
        s = self.scheduler
        return replace(
            CoreConfig(),
            classes={name: c.policy() for name, c in self.classes.items()},
            window=s.window_config(),
            routing=self.routing.policy,
            cache_aware=self.routing.cache_aware_config(),
            max_queue_total=s.max_queue_total,
            load_report_interval_s=s.load_poll_interval_s,
            estimates=s.estimate_config(),
            first_token_deadline_factor=s.first_token_deadline_factor,
        )


class ModelRegistry:
    """The served models by id and alias, and which model each settings worker belongs to.

    Args:
        models: the models, the default (first) one first.

    Raises:
        ValueError: no model, a name (id or alias) used twice, or a worker listed under two models.
    """

    def __init__(self, models: Sequence[ServedModel]) -> None:
        if not models:
            raise ValueError("at least one model is needed")
        self.models = tuple(models)
        self._by_name: dict[str, ServedModel] = {}
        self._worker_model: dict[str, str] = {}
        for m in self.models:
            for name in m.names:
                other = self._by_name.setdefault(name, m)
                if other is not m:
                    raise ValueError(f"model name '{name}' is used by '{other.id}' and '{m.id}'")
            for url in m.workers:
                url = url.rstrip("/")
                owner = self._worker_model.setdefault(url, m.id)
                if owner != m.id:
                    raise ValueError(f"worker {url} is listed under models '{owner}' and '{m.id}'")

    @property
    def default(self) -> ServedModel:
        """The first model (the one a single-model gateway serves)."""
        return self.models[0]

    @property
    def names(self) -> list[str]:
        """Every id and alias, each once, model by model (what ``/v1/models`` lists)."""
        return list(self._by_name)

    def resolve(self, name: str) -> ServedModel | None:
        """The model an id or alias names; None when unknown."""
        return self._by_name.get(name)

    def get(self, model_id: str) -> ServedModel:
        """The model of a canonical id. Raises KeyError when unknown."""
        found = self._by_name[model_id]
        if found.id != model_id:
            raise KeyError(model_id)
        return found

    def worker_models(self) -> dict[str, str]:
        """Worker URL -> model id, for the workers the models list in settings."""
        return dict(self._worker_model)

    def place(self, expected: str | None, reported: str | None) -> tuple[str | None, str | None]:
        """The model a worker serves, or why it serves none of the gateway's: ``(model id, None)`` or
        ``(None, reason)``.

        ``expected``: the model it is listed under (None: discovered, e.g. added over the admin API);
        ``reported``: the model it names on ``/server_info`` or ``/v1/models`` (None: it names none). A
        listed worker that names none is taken at its word; a discovered one joins the model it names, or
        the only model.
        """
        if expected is not None:
            model = self.get(expected)
            if reported is None or reported in model.names:
                return model.id, None
            if len(self.models) == 1:
                return None, (
                    f"reports model '{reported}' but the gateway serves {', '.join(model.names)}: set "
                    "RADIXGATE_ENGINE__SERVED_MODEL_NAME (or RADIXGATE_EXTRA_MODELS), or start SGLang with "
                    "--served-model-name"
                )
            return None, (
                f"reports model '{reported}' but is listed under model '{model.id}' "
                f"({', '.join(model.names)}): add '{reported}' to its aliases in RADIXGATE_MODELS, or start "
                f"SGLang with --served-model-name {model.id}"
            )
        if reported is not None:
            found = self.resolve(reported)
            if found is not None:
                return found.id, None
            return None, (
                f"reports model '{reported}', which the gateway does not serve ({', '.join(self.names)})"
            )
        if len(self.models) == 1:
            return self.default.id, None
        return None, (
            "reports no model name; with several models served, list it under its model's workers in "
            "RADIXGATE_MODELS"
        )


def merged_classes(
    base: Mapping[str, PriorityClassSettings], goals: Mapping[str, ClassGoals], model_id: str
) -> dict[str, PriorityClassSettings]:
    """The gateway's classes with ``goals`` laid over them field by field.

    Raises:
        ValueError: a class the gateway does not have, or goals that are invalid together (a late class
            without a wait budget).
    """
    unknown = sorted(set(goals) - set(base))
    if unknown:
        raise ValueError(f"model '{model_id}': unknown priority class(es) {unknown}; known: {sorted(base)}")
    out = dict(base)
    for name, g in goals.items():
        try:
            out[name] = PriorityClassSettings.model_validate(
                {**base[name].model_dump(), **g.model_dump(exclude_unset=True)}
            )
        except ValidationError as exc:
            reason = "; ".join(str(e["msg"]) for e in exc.errors())
            raise ValueError(f"model '{model_id}', class '{name}': {reason}") from None
    return out


def build_registry(
    models: Sequence[ModelSettings],
    *,
    served_model_name: str,
    extra_models: Sequence[str],
    workers: Sequence[str],
    tokenizer_path: Path,
    context_length: int | None,
    tool_call_format: ToolCallFormatName,
    classes: Mapping[str, PriorityClassSettings],
    scheduler: SchedulerSettings,
    routing: RoutingSettings,
) -> ModelRegistry:
    """The registry of a gateway's settings (:meth:`service.config.settings.Settings.model_registry`).

    Without ``models``, its one entry is the single-model settings: ``served_model_name`` with
    ``extra_models`` as aliases, ``workers``, ``tokenizer_path``, ``context_length`` and
    ``tool_call_format``. With ``models``, each entry is laid over the gateway's sections; ``workers``
    (``upstream.workers``) are then discovered: each joins the model it reports.

    Raises:
        ValueError: ``extra_models`` beside ``models``, a model other than ``served_model_name`` without a
            tokenizer, an unknown class, a name or worker used twice.
    """
    if not models:
        return ModelRegistry(
            [
                ServedModel(
                    id=served_model_name,
                    aliases=tuple(a for a in dict.fromkeys(extra_models) if a != served_model_name),
                    workers=tuple(workers),
                    tokenizer_path=tokenizer_path,
                    context_length=context_length,
                    classes=dict(classes),
                    scheduler=scheduler,
                    routing=routing,
                    tool_call_format=tool_call_format,
                )
            ]
        )
    if extra_models:
        raise ValueError(
            "extra_models names aliases of the single model; with models set, give each model its aliases"
        )
    served = []
    for m in models:
        path = m.tokenizer_path
        if path is None:
            if m.id != served_model_name:
                raise ValueError(f"model '{m.id}' needs tokenizer_path (its tokenizer and chat template)")
            path = tokenizer_path
        served.append(
            ServedModel(
                id=m.id,
                aliases=tuple(a for a in m.aliases if a != m.id),
                workers=tuple(m.workers),
                tokenizer_path=path,
                context_length=m.context_length if m.context_length is not None else context_length,
                classes=merged_classes(classes, m.priority_classes, m.id),
                scheduler=_overlaid(scheduler, m.scheduler, f"model '{m.id}', scheduler"),
                routing=_overlaid(routing, m.routing, f"model '{m.id}', routing"),
                tool_call_format=m.tool_call_format or tool_call_format,
                tools=m.tools,
                structured_outputs=m.structured_outputs,
                owned_by=m.owned_by,
            )
        )
    return ModelRegistry(served)


__all__ = [
    "DEFAULT_CONTEXT_LENGTH",
    "ClassGoals",
    "ModelRegistry",
    "ModelSettings",
    "ServedModel",
    "build_registry",
    "merged_classes",
]

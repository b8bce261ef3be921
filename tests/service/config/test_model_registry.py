"""The model registry (``RADIXGATE_MODELS``, service/config/models.py): the single-model settings as its one
entry, per-model overrides laid over the gateway's sections, context lengths, where a worker belongs, and
bad registries refused in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from service import __main__ as service_main
from service.__main__ import cli
from service.config.models import ModelRegistry, ServedModel
from service.config.policies import RoutingSettings, SchedulerSettings, default_priority_classes
from service.config.settings import Settings


def two_models(tokenizer: Path, **second: Any) -> list[dict[str, Any]]:
    return [
        {
            "id": "small",
            "aliases": ["small-latest", "small"],
            "workers": ["http://127.0.0.1:30000/"],
            "tokenizer_path": str(tokenizer),
            "priority_classes": {"interactive": {"ttft_goal_ms": 500}},
        },
        {
            "id": "large",
            "workers": ["http://127.0.0.1:30001"],
            "tokenizer_path": str(tokenizer / "large"),
            "context_length": 65536,
            "tool_call_format": "llama3_json",
            "tools": False,
            "routing": {"policy": "least_load"},
            "scheduler": {"window_max": 64},
            "priority_classes": {"interactive": {"ttft_goal_ms": 2000, "max_queue_len": 7}},
            **second,
        },
    ]


def test_the_single_model_settings_are_the_one_entry_unchanged(tmp_path: Path) -> None:
    settings = Settings.model_validate(
        {
            "engine": {"served_model_name": "m"},
            "extra_models": ["m", "alias", "alias", "other"],
            "upstream": {"workers": ["http://w1:30000", "http://w2:30000"]},
            "api": {"tokenizer_path": str(tmp_path), "context_length": 4096, "tool_call_format": "mistral"},
            "routing": {"policy": "round_robin"},
        }
    )
    registry = settings.model_registry()
    (model,) = registry.models
    assert (model.id, model.aliases, model.workers) == (
        "m",
        ("alias", "other"),
        ("http://w1:30000", "http://w2:30000"),
    )
    assert (model.tokenizer_path, model.context_length, model.tool_call_format) == (tmp_path, 4096, "mistral")
    assert model.classes == settings.priority_classes and model.scheduler == settings.scheduler
    assert model.routing == settings.routing and model.core_config() == settings.core_config()
    assert registry.names == settings.served_models == ["m", "alias", "other"]
    assert registry.worker_models() == {"http://w1:30000": "m", "http://w2:30000": "m"}
    assert (model.tools, model.structured_outputs, model.owned_by) == (True, True, "radixgate")


def test_defaults_give_one_model_with_the_engine_model_folder() -> None:
    settings = Settings()
    (model,) = settings.model_registry().models
    assert model.id == settings.engine.served_model_name
    assert model.tokenizer_path == settings.engine.model_path
    assert model.context_length is None  # what the workers report, else DEFAULT_CONTEXT_LENGTH


def test_each_model_lays_its_settings_over_the_gateways(tmp_path: Path) -> None:
    settings = Settings.model_validate(
        {"models": two_models(tmp_path), "api": {"context_length": 8000}, "scheduler": {"window_max": 32}}
    )
    registry = settings.model_registry()
    small, large = registry.models
    assert registry.names == ["small", "small-latest", "large"]
    assert registry.resolve("small-latest") is small and registry.resolve("nope") is None
    assert registry.worker_models() == {"http://127.0.0.1:30000": "small", "http://127.0.0.1:30001": "large"}
    gateway = default_priority_classes()
    # per class, only the fields a model names change; the rest, and the other classes, are the gateway's
    assert small.classes["interactive"] == gateway["interactive"].model_copy(update={"ttft_goal_ms": 500.0})
    assert large.classes["interactive"] == gateway["interactive"].model_copy(
        update={"ttft_goal_ms": 2000.0, "max_queue_len": 7}
    )
    assert small.classes["batch"] == large.classes["batch"] == gateway["batch"]
    assert small.core_config().classes["interactive"].ttft_goal_s == 0.5
    assert large.core_config().classes["interactive"].ttft_goal_s == 2.0
    assert (small.routing.policy, large.routing.policy) == (settings.routing.policy, "least_load")
    assert (small.scheduler.window_max, large.scheduler.window_max) == (32, 64)
    assert large.core_config().window.maximum == 64 and large.core_config().routing == "least_load"
    assert (small.context_length, large.context_length) == (8000, 65536)  # api.context_length is the default
    assert (small.tool_call_format, large.tool_call_format) == ("hermes", "llama3_json")
    assert (small.tools, large.tools, large.structured_outputs) == (True, False, True)


def registry_of(*models: tuple[str, tuple[str, ...]]) -> ModelRegistry:
    classes, sched, routing = default_priority_classes(), SchedulerSettings(), RoutingSettings()
    return ModelRegistry([ServedModel(m, Path("."), classes, sched, routing, aliases=a) for m, a in models])


@pytest.mark.parametrize(
    ("models", "expected", "reported", "model", "says"),
    [
        # listed under a model: taken at its word when it names none, kept out when it names another
        ([("a", ("a1",)), ("b", ())], "a", None, "a", None),
        ([("a", ("a1",)), ("b", ())], "a", "a1", "a", None),
        ([("a", ("a1",)), ("b", ())], "a", "b", None, "listed under model 'a' (a, a1)"),
        ([("a", ("a1",))], "a", "other", None, "reports model 'other' but the gateway serves a, a1"),
        # discovered (admin API, upstream.workers beside models): joins the model it names
        ([("a", ("a1",)), ("b", ())], None, "a1", "a", None),
        ([("a", ()), ("b", ())], None, "c", None, "which the gateway does not serve (a, b)"),
        ([("a", ()), ("b", ())], None, None, None, "reports no model name"),
        ([("a", ())], None, None, "a", None),  # one model: it is that one's
    ],
)
def test_where_a_worker_belongs(
    models: list[tuple[str, tuple[str, ...]]],
    expected: str | None,
    reported: str | None,
    model: str | None,
    says: str | None,
) -> None:
    placed, why = registry_of(*models).place(expected, reported)
    assert placed == model
    assert (why is None) == (says is None) and (says is None or says in str(why)), why


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"aliases": ["small-latest"]}, "model name 'small-latest' is used by 'small' and 'large'"),
        ({"workers": ["http://127.0.0.1:30000"]}, "listed under models 'small' and 'large'"),
        ({"priority_classes": {"gold": {"ttft_goal_ms": 1}}}, "unknown priority class(es) ['gold']"),
        ({"priority_classes": {"interactive": {"serve_late": True}}}, "needs queue_wait_budget_ms"),
        ({"priority_classes": {"interactive": {"rank": 9}}}, "RADIXGATE_MODELS"),
        ({"scheduler": {"window_maxx": 3}}, "unknown scheduler setting(s) ['window_maxx']"),
        ({"scheduler": {"window_max": 0}}, "RADIXGATE_MODELS"),
        ({"routing": {"policy": "nope"}}, "RADIXGATE_MODELS"),
        ({"tokenizer_path": None}, "model 'large' needs tokenizer_path"),
        ({"tool_call_format": "xml"}, "RADIXGATE_MODELS"),
    ],
)
def test_a_bad_registry_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, stub_model_dir: Path, change: dict[str, Any], says: str
) -> None:
    monkeypatch.setattr(service_main, "serve_one", _refuse)
    monkeypatch.setenv("RADIXGATE_MODELS", json.dumps(two_models(stub_model_dir, **change)))
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.splitlines()) <= 3, result.output
    assert result.output.startswith("invalid setting") and says in result.output, result.output


def test_extra_models_beside_models_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="with models set, give each model its aliases"):
        Settings.model_validate({"models": two_models(tmp_path), "extra_models": ["x"]})


def test_a_model_without_its_tokenizer_stops_serve(
    monkeypatch: pytest.MonkeyPatch, stub_model_dir: Path
) -> None:
    monkeypatch.setattr(service_main, "serve_one", _refuse)
    monkeypatch.setenv("RADIXGATE_MODELS", json.dumps(two_models(stub_model_dir)))  # large/ has none
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("invalid setting RADIXGATE_MODELS (1, 'large'): no tokenizer.json in")


def test_models_come_from_a_toml_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "radixgate.toml"
    path.write_text(
        f"""
[[models]]
id = "small"
tokenizer_path = "{tmp_path}"
workers = ["http://127.0.0.1:30000"]
[models.priority_classes.interactive]
ttft_goal_ms = 500

[[models]]
id = "large"
aliases = ["big"]
tokenizer_path = "{tmp_path}"
"""
    )
    settings = Settings(config_file=path)
    small, large = settings.model_registry().models
    assert small.classes["interactive"].ttft_goal_ms == 500 and large.names == ("large", "big")


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("the gateway started with a bad setting")

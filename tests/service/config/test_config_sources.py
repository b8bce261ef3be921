"""Misspelled settings, ``config check`` and settings files (issue 25, item 8).

``RADIXGATE_API__CONTEXT_LENGHT=131072``, ``RADIXGATE_ROUTNG__POLICY=round_robin`` and ``RADIXGATE_REDIS_URL``
(one underscore) started the gateway without a word (the last silently used 127.0.0.1:6379). Now each name
that is no setting gets a warning naming the closest one; ``python -m service config check`` prints the
effective settings with secrets masked and exits 2 on an error; settings may come from a TOML or YAML file
(``--config``), with the environment on top.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from service import __main__ as service_main
from service.__main__ import cli
from service.config.doc import settings_rows
from service.config.settings import Settings
from service.config.sources import OTHER_VARIABLES, unknown_settings


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, stub_model_dir: Path) -> pytest.MonkeyPatch:
    """No RADIXGATE_* variable but the stub tokenizer; ``serve`` never listens (serve_one records its
    call), and the app is not built (its logging would bind to CliRunner's stream)."""
    for name in list(os.environ):
        if name.upper().startswith("RADIXGATE_"):
            monkeypatch.delenv(name)
    # `serve --config` with workers > 1 sets it for its processes: set first, so that undo removes it
    monkeypatch.setenv("RADIXGATE_CONFIG_FILE", "")
    monkeypatch.delenv("RADIXGATE_CONFIG_FILE")
    monkeypatch.setenv("RADIXGATE_API__TOKENIZER_PATH", str(stub_model_dir))
    served: list[Any] = []
    monkeypatch.setattr(service_main, "create_app", lambda settings: settings)
    monkeypatch.setattr(
        service_main, "serve_one", lambda app, options, operator=None: served.append(app) or 0
    )
    monkeypatch.setattr(service_main, "configure_logging", lambda level: None)
    monkeypatch.served = served  # type: ignore[attr-defined]
    return monkeypatch


@pytest.mark.parametrize(
    ("name", "closest"),
    [
        ("RADIXGATE_API__CONTEXT_LENGHT", "RADIXGATE_API__CONTEXT_LENGTH"),
        ("RADIXGATE_ROUTNG__POLICY", "RADIXGATE_ROUTING__POLICY"),
        ("RADIXGATE_REDIS_URL", "RADIXGATE_REDIS__URL"),
        ("radixgate_redis_url", "RADIXGATE_REDIS__URL"),  # pydantic-settings matches names in any case
        ("RADIXGATE_WORKER", "RADIXGATE_WORKERS"),
    ],
)
def test_a_misspelled_setting_warns_at_startup_naming_the_closest(
    clean_env: pytest.MonkeyPatch, name: str, closest: str
) -> None:
    clean_env.setenv(name, "131072")
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 0, result.output
    assert clean_env.served, "the gateway still starts"  # type: ignore[attr-defined]
    assert f"warning: {name} (environment) is not a setting and is ignored; did you mean {closest}?" in (
        result.output
    )


def test_every_real_setting_and_known_variable_passes_without_a_warning() -> None:
    environ = {env: "x" for env, _, _ in settings_rows()}
    environ |= dict.fromkeys(OTHER_VARIABLES, "x")
    # a section as one JSON object, a priority class's field, any case
    environ |= {"RADIXGATE_REDIS": "{}", "RADIXGATE_PRIORITY_CLASSES__GOLD__RANK": "1", "radixgate_port": "1"}
    assert unknown_settings(Settings, environ) == []
    entry = unknown_settings(Settings, {"RADIXGATE_PRIORITY_CLASSES__GOLD__RNK": "1"})
    assert [u.closest for u in entry] == ["RADIXGATE_PRIORITY_CLASSES__GOLD__RANK"]
    far = unknown_settings(Settings, {"RADIXGATE_ZZZZZZ": "1"})
    assert [(u.name, u.closest) for u in far] == [("RADIXGATE_ZZZZZZ", None)]
    assert far[0].message() == "warning: RADIXGATE_ZZZZZZ (environment) is not a setting and is ignored"


def test_config_check_prints_effective_settings_with_secrets_masked(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RADIXGATE_ADMIN_TOKEN", "admin-secret-0123456789")
    clean_env.setenv("RADIXGATE_KEY_PEPPER", "pepper-secret-value")
    clean_env.setenv("RADIXGATE_REDIS__URL", "redis://user:redis-pass@10.0.0.7:6390/2")
    clean_env.setenv("RADIXGATE_PORT", "8123")
    result = CliRunner().invoke(cli, ["config", "check"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "RADIXGATE_PORT=8123  [env]" in lines
    assert "RADIXGATE_REDIS__URL=redis://user:***@10.0.0.7:6390/2  [env]" in lines
    assert "RADIXGATE_ADMIN_TOKEN=********  [env]" in lines
    assert "RADIXGATE_HOST=127.0.0.1" in lines  # a default: no source named
    for secret in ("admin-secret-0123456789", "pepper-secret-value", "redis-pass"):
        assert secret not in result.output
    names = {line.split("=", 1)[0] for line in lines if line.startswith("RADIXGATE_")}
    assert names == {env for env, _, _ in settings_rows()}  # every setting, once


def test_config_check_prints_a_list_of_models(clean_env: pytest.MonkeyPatch, stub_model_dir: Path) -> None:
    """With RADIXGATE_MODELS set, config check crashed (TypeError: ModelSettings is not JSON serializable)."""
    models = [{"id": "m", "tokenizer_path": str(stub_model_dir), "scheduler": {"window_max": 64}}]
    clean_env.setenv("RADIXGATE_ENGINE__SERVED_MODEL_NAME", "m")
    clean_env.setenv("RADIXGATE_MODELS", json.dumps(models))
    result = CliRunner().invoke(cli, ["config", "check"])
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("RADIXGATE_MODELS=")]
    value, _, source = line.removeprefix("RADIXGATE_MODELS=").rpartition("  ")
    assert source == "[env]"
    (shown,) = json.loads(value)
    assert (shown["id"], shown["tokenizer_path"], shown["scheduler"]) == (
        "m",
        str(stub_model_dir),
        {"window_max": 64},
    )


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("RADIXGATE_PORT", "abc", "invalid setting RADIXGATE_PORT"),
        ("RADIXGATE_CONFIG_FILE", "/nonexistent/radixgate.toml", "no such file"),
        ("RADIXGATE_CONFIG_FILE", "/etc/hostname", "a settings file is .toml, .yaml or .yml"),
        ("RADIXGATE_API__TOKENIZER_PATH", "/nonexistent/model", "no tokenizer.json"),
    ],
)
def test_config_check_exits_2_on_an_error(
    clean_env: pytest.MonkeyPatch, name: str, value: str, says: str
) -> None:
    clean_env.setenv(name, value)
    result = CliRunner().invoke(cli, ["config", "check"])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output, result.output


TOML = """
port = 8101
extra_models = ["alias-a"]

[redis]
url = "redis://10.0.0.9:6379/0"
key_prefix = "file:"

[api]
context_lenght = 4096
"""

YAML = """
port: 8101
extra_models: [alias-a]
redis:
  url: redis://10.0.0.9:6379/0
  key_prefix: "file:"
api:
  context_lenght: 4096
"""


@pytest.mark.parametrize(("suffix", "text"), [(".toml", TOML), (".yaml", YAML), (".yml", YAML)])
def test_settings_come_from_a_file_with_the_environment_on_top(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, suffix: str, text: str
) -> None:
    path = tmp_path / f"radixgate{suffix}"
    path.write_text(text)
    clean_env.setenv("RADIXGATE_REDIS__KEY_PREFIX", "env:")
    result = CliRunner().invoke(cli, ["serve", "--config", str(path)])
    assert result.exit_code == 0, result.output
    settings = clean_env.served[-1]  # type: ignore[attr-defined]
    assert settings.port == 8101 and settings.extra_models == ["alias-a"]
    assert settings.redis.url == "redis://10.0.0.9:6379/0"  # nested, from the file
    assert settings.redis.key_prefix == "env:"  # the environment wins
    hint = f"warning: api.context_lenght ({path}) is not a setting and is ignored"
    assert f"{hint}; did you mean api.context_length?" in result.output
    # the same file through RADIXGATE_CONFIG_FILE (what each of several gateway processes reads)
    clean_env.setenv("RADIXGATE_CONFIG_FILE", str(path))
    assert Settings().port == 8101


def test_a_bad_value_in_the_file_names_the_file(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('port = "abc"\n')
    result = CliRunner().invoke(cli, ["config", "check", "--config", str(path)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"invalid setting RADIXGATE_PORT (in {path}): "), result.output
    broken = tmp_path / "broken.yaml"
    broken.write_text("- a list\n")
    result = CliRunner().invoke(cli, ["config", "check", "--config", str(broken)])
    assert result.exit_code == 2 and "must be a table" in result.output, result.output


def test_serve_hands_the_file_to_every_gateway_process(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "two.toml"
    path.write_text("workers = 2\n")
    seen: list[str | None] = []
    clean_env.setattr(
        service_main,
        "serve_processes",
        lambda n, options, environ, operator=None: seen.append(environ.get("RADIXGATE_CONFIG_FILE")),
    )
    result = CliRunner().invoke(cli, ["serve", "--config", str(path)])
    assert result.exit_code == 0, result.output
    assert seen == [str(path.resolve())]

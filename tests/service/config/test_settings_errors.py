"""Bad ``RADIXGATE_*`` values stop ``python -m service serve`` with one short line per fault (exit 2), never a
traceback, before anything listens or connects."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from service import __main__ as service_main
from service.__main__ import cli
from service.config.settings import Settings
from service.workers.launcher import WorkerStartError


def refuse_to_serve(*args: object, **kwargs: object) -> None:
    raise AssertionError("the gateway started with a bad setting")


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("RADIXGATE_PORT", "abc", "RADIXGATE_PORT"),
        ("RADIXGATE_REDIS__URL", "http://127.0.0.1:6379/0", "RADIXGATE_REDIS__URL"),
        ("RADIXGATE_REDIS__URL", "127.0.0.1:6379", "RADIXGATE_REDIS__URL"),
        ("RADIXGATE_UPSTREAM__WORKERS", "notjson", "RADIXGATE_UPSTREAM"),
        ("RADIXGATE_UPSTREAM__WORKERS", "http://w:30000", "not valid JSON"),
        ("RADIXGATE_UPSTREAM__WORKERS", '["ftp://w:30000"]', "RADIXGATE_UPSTREAM__WORKERS"),
        ("RADIXGATE_UPSTREAM__WORKERS", '["w:30000"]', "RADIXGATE_UPSTREAM__WORKERS"),
        ("RADIXGATE_UPSTREAM__WORKERS", '["http://u:pw@w:30000"]', "RADIXGATE_UPSTREAM__WORKERS"),
        ("RADIXGATE_EXTRA_MODELS", "alias", "RADIXGATE_EXTRA_MODELS"),
        ("RADIXGATE_PRIORITY_CLASSES", "{}", "RADIXGATE_PRIORITY_CLASSES"),
        ("RADIXGATE_OBSERVABILITY__LOG_LEVEL", "LOUD", "RADIXGATE_OBSERVABILITY__LOG_LEVEL"),
        ("RADIXGATE_API__TOKENIZER_PATH", "/nonexistent/model", "RADIXGATE_API__TOKENIZER_PATH"),
    ],
)
def test_a_bad_setting_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, stub_model_dir: Path, name: str, value: str, says: str
) -> None:
    assert_one_clear_line(monkeypatch, stub_model_dir, name, value, says)


@pytest.mark.parametrize("level", ["debug", "WARNING", "error"])
def test_good_log_levels_pass(monkeypatch: pytest.MonkeyPatch, level: str) -> None:
    from service.config.settings import Settings

    monkeypatch.setenv("RADIXGATE_OBSERVABILITY__LOG_LEVEL", level)
    assert Settings().observability.log_level == level.upper()


def test_an_alias_repeating_a_served_name_is_listed_once() -> None:
    """RADIXGATE_EXTRA_MODELS='["<served name>"]' made /v1/models list the model twice."""
    settings = Settings.model_validate(
        {"engine": {"served_model_name": "m"}, "extra_models": ["m", "alias", "alias", "other"]}
    )
    assert settings.served_models == ["m", "alias", "other"]


def test_a_rule_across_settings_names_no_empty_variable(
    monkeypatch: pytest.MonkeyPatch, stub_model_dir: Path
) -> None:
    """It printed 'invalid setting RADIXGATE_: Value error, workers > 1 needs ...'."""
    monkeypatch.setattr(service_main, "serve_one", refuse_to_serve)
    monkeypatch.setenv("RADIXGATE_API__TOKENIZER_PATH", str(stub_model_dir))
    monkeypatch.setenv("RADIXGATE_WORKERS", "2")
    monkeypatch.setenv("RADIXGATE_ENGINE__LAUNCH", "true")
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("invalid settings: workers > 1 needs engine.launch false"), result.output


@pytest.mark.parametrize("port", ["0", "-1", "65536", "99999"])
def test_a_worker_port_out_of_range_is_one_clear_line(monkeypatch: pytest.MonkeyPatch, port: str) -> None:
    """``python -m service worker --port 99999`` started SGLang, then died in a traceback (OverflowError)."""

    def refuse_to_start(self: object) -> None:
        raise AssertionError("the worker started with a bad port")

    monkeypatch.setattr(service_main.WorkerProcess, "start", refuse_to_start)
    result = CliRunner().invoke(cli, ["worker", "--port", port])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "--port" in result.output, result.output


@pytest.mark.parametrize("flag", ["--doc", "--readme"])
@pytest.mark.parametrize("command", ["config-table", "params-table"])
@pytest.mark.parametrize("what", ["missing", "folder", "no markers"])
def test_a_readme_that_cannot_take_the_table_is_one_clear_line(
    tmp_path: Path, command: str, what: str, flag: str
) -> None:
    """``config-table --readme`` with a missing file, a folder or a file without the markers ended in a
    traceback (FileNotFoundError, IsADirectoryError, ValueError: substring not found); ``--doc`` is the
    option's name now that the tables live in docs/, ``--readme`` its old one."""
    readme = {"missing": tmp_path / "nope.md", "folder": tmp_path, "no markers": tmp_path / "r.md"}[what]
    if what == "no markers":
        readme.write_text("# a readme without table markers\n")
    result = CliRunner().invoke(cli, [command, flag, str(readme)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.splitlines()) <= 2, result.output
    assert str(readme) in result.output, result.output
    if what == "no markers":
        assert readme.read_text() == "# a readme without table markers\n"


def no_logging(level: str) -> None:
    """The CLI's logging set-up would bind structlog to CliRunner's stream, closed after the test (later
    tests' log lines then fail)."""


class SlowWorker:
    """Stands in for :class:`service.workers.launcher.WorkerProcess`: starts at once, is ready after
    ``ready_after_s`` (or fails to start when ``fails``), records whether it was stopped."""

    ready_after_s = 30.0
    fails = False
    stopped = False

    def __init__(self, *args: object) -> None:
        pass

    def start(self) -> None:
        pass

    async def wait_ready(self) -> None:
        if SlowWorker.fails:
            raise WorkerStartError("worker on port 30000 exited with 1")
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the engine loads its model
        await asyncio.sleep(SlowWorker.ready_after_s)

    def stop(self) -> None:
        SlowWorker.stopped = True


def test_ctrl_c_while_a_worker_starts_stops_it_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m service worker`` took Ctrl-C only once the engine was ready (minutes for a large model)."""
    monkeypatch.setattr(service_main, "WorkerProcess", SlowWorker)
    monkeypatch.setattr(service_main, "configure_logging", no_logging)
    SlowWorker.fails, SlowWorker.stopped = False, False
    started = time.monotonic()
    result = CliRunner().invoke(cli, ["worker"])
    assert time.monotonic() - started < SlowWorker.ready_after_s / 2, "it waited for the worker to be ready"
    assert result.exit_code == 0 and SlowWorker.stopped, result.output


def test_a_worker_that_does_not_start_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that exited while starting (a wrong model path) ended in a 70-line WorkerStartError trace."""
    monkeypatch.setattr(service_main, "WorkerProcess", SlowWorker)
    monkeypatch.setattr(service_main, "configure_logging", no_logging)
    SlowWorker.fails, SlowWorker.stopped = True, False
    result = CliRunner().invoke(cli, ["worker"])
    assert result.exit_code == 1 and SlowWorker.stopped, result.output
    assert "Traceback" not in result.output and "exited with 1" in result.output, result.output


def _float_settings(model: type[BaseModel], prefix: str) -> list[str]:
    """The environment names of every float setting under ``model``."""
    names: list[str] = []
    for name, field in model.model_fields.items():
        kinds = typing.get_args(field.annotation) or (field.annotation,)
        nested = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
        if nested:
            names += _float_settings(nested[0], f"{prefix}{name.upper()}__")
        elif float in kinds:
            names.append(prefix + name.upper())
    return names


FLOAT_SETTINGS = _float_settings(Settings, "RADIXGATE_")


def test_every_float_setting_is_listed() -> None:
    assert len(FLOAT_SETTINGS) > 30 and "RADIXGATE_REDIS__SOCKET_TIMEOUT_S" in FLOAT_SETTINGS


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize("name", FLOAT_SETTINGS)
def test_a_non_finite_number_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, stub_model_dir: Path, name: str, value: str
) -> None:
    """``inf`` passed every ``ge``/``gt`` bound of 28 settings, and the gateway then failed at startup
    with a traceback (``RADIXGATE_REDIS__SOCKET_TIMEOUT_S=inf``: aiohttp/redis-py ``ceil(inf)``,
    OverflowError, "Application startup failed") or ran with a timeout that never fires."""
    assert_one_clear_line(monkeypatch, stub_model_dir, name, value, name)


def assert_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, stub_model_dir: Path, name: str, value: str, says: str
) -> None:
    """``serve`` with setting ``name`` = ``value`` exits 2 with one line (no traceback) naming ``says``."""
    monkeypatch.setattr(service_main, "serve_one", refuse_to_serve)
    monkeypatch.setenv("RADIXGATE_API__TOKENIZER_PATH", str(stub_model_dir))
    monkeypatch.setenv(name, value)
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.splitlines()) <= 3, result.output
    assert result.output.startswith("invalid setting") and says in result.output, result.output


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("RADIXGATE_UPSTREAM__WORKERS", "http://w:30000"),
        ("RADIXGATE_PRIORITY_CLASSES", '{"interactive": {rank: 1}}'),
        ("RADIXGATE_MODELS", "[{id: 1}]"),
        ("RADIXGATE_EXTRA_MODELS", "alias"),
    ],
)
def test_a_setting_that_is_not_json_is_named_with_an_example_of_its_own(
    monkeypatch: pytest.MonkeyPatch, stub_model_dir: Path, name: str, value: str
) -> None:
    """The line said 'RADIXGATE_UPSTREAM__*' for RADIXGATE_UPSTREAM__WORKERS, and gave a worker URL list as
    the example for the priority classes. It names the variable, and its example is a value that setting
    takes."""
    monkeypatch.setattr(service_main, "serve_one", refuse_to_serve)
    monkeypatch.setenv("RADIXGATE_API__TOKENIZER_PATH", str(stub_model_dir))
    monkeypatch.setenv(name, value)
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 2 and len(result.output.splitlines()) == 1, result.output
    assert result.output.startswith(f"invalid setting {name}: not valid JSON"), result.output
    assert "__*" not in result.output
    example = result.output.split(f"e.g. {name}=", 1)[1].strip()
    assert example.startswith("'") and example.endswith("'")
    monkeypatch.setenv(name, example[1:-1])
    if name == "RADIXGATE_MODELS":  # its example's model counts prompts with its own tokenizer
        monkeypatch.setenv(
            name, example[1:-1].replace('"workers"', f'"tokenizer_path": "{stub_model_dir}", "workers"')
        )
    Settings()  # the example is a value the setting takes

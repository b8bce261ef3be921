"""``python -m loadgen <command> --help`` at 80 columns names every option in full (rich's help table cut
``--worker-drain-deadline`` to ``--worker-drain-deadli…``, issue 31's new-user faults)."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from loadgen.cli import app

COMMANDS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_is_named_in_full_at_80_columns(command: str) -> None:
    result = CliRunner().invoke(
        app, [command, "--help"], env={"COLUMNS": "80"}, prog_name="python -m loadgen"
    )
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    group: Any = typer.main.get_command(app)
    for param in group.commands[command].params:
        for name in param.opts if param.param_type_name == "option" else ():
            assert name in result.output, (command, name)


def test_rolling_restart_names_its_drain_deadline() -> None:
    result = CliRunner().invoke(app, ["rolling-restart", "--help"], env={"COLUMNS": "80"})
    assert "--worker-drain-deadline" in result.output and "upstream.worker_drain_deadline_s" in result.output

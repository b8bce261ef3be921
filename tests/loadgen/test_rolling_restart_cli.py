"""``python -m loadgen rolling-restart``'s exit status (the run itself: tests/service/runtime/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import loadgen.rolling_restart
from loadgen.cli import app
from loadgen.rolling_restart import RestartFigures


@pytest.mark.parametrize(("after_load", "code"), [(0, 0), (5, 1)])
def test_restarts_after_the_load_ended_fail_the_run(
    monkeypatch: pytest.MonkeyPatch, after_load: int, code: int
) -> None:
    def fake_run(run_dir: Path, **kwargs: Any) -> RestartFigures:
        return RestartFigures(
            streams=100,
            ok=100,
            gateway_restarts=4,
            worker_restarts=3,
            duration_s=2.0,
            restarts_after_load=after_load,
        )

    monkeypatch.setattr(loadgen.rolling_restart, "run_rolling_restart", fake_run)
    result = CliRunner().invoke(app, ["rolling-restart", "--streams", "100", "--json"])
    assert result.exit_code == code
    assert f'"restarts_after_load": {after_load}' in result.stdout
    assert ("raise --streams" in result.output) == bool(after_load)

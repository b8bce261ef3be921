"""``RADIXGATE_HOME`` is read by every part (issue 25, item 1).

The README says the engine virtualenv and the model live under ``~/.cache/radixgate`` "(override with
``RADIXGATE_HOME``)"; only ``scripts/engine/setup.sh`` read it: ``RADIXGATE_HOME=/some/dir make demo`` built
the engine there, then the gateway exited with "no tokenizer.json in ~/.cache/radixgate/...", and the engine
tests errored with "SGLang engine or model missing (~/.cache/radixgate/...)". Now the gateway's ``home``
setting (:class:`service.config.engine.HomeSettings`) gives engine.python and engine.model_path their
defaults, the shell scripts read the same variable in one place (``scripts/home.sh``), and the demo, the
bench and the test fixtures follow it. The engine test runs the demo from a fresh home while ``HOME`` points
at an empty folder, so nothing can fall back to ``~/.cache/radixgate``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadgen.bench.runner import BenchConfig, resolve_tokenizer
from loadgen.bench.targets import default_peers_dir
from service.config.doc import settings_rows
from service.config.engine import home_engine_paths
from service.config.settings import Settings, configured_home
from tests.support.engine import engine_settings
from tests.support.model_stub import write_stub_model
from tests.support.paths import REPO
from tests.support.servers import free_port

ROOT = REPO


@pytest.fixture
def fresh_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """``RADIXGATE_HOME`` at an empty folder, ``HOME`` at another (no ``~/.cache/radixgate`` to fall back
    to), no other ``RADIXGATE_*`` variable."""
    for name in list(os.environ):
        if name.upper().startswith("RADIXGATE_"):
            monkeypatch.delenv(name)
    home = tmp_path / "rg-home"
    home.mkdir()
    (tmp_path / "user").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("RADIXGATE_HOME", str(home))
    return home


def test_the_engine_defaults_follow_the_home_setting(
    fresh_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings()
    assert settings.home == fresh_home == configured_home()
    assert settings.engine.python == fresh_home / "engine-venv" / "bin" / "python"
    assert settings.engine.model_path == fresh_home / "models" / "SmolLM2-135M-Instruct"
    assert settings.tokenizer_path == settings.engine.model_path  # what the gateway counts prompts with
    monkeypatch.setenv("RADIXGATE_ENGINE__TP", "2")  # another engine setting keeps the defaults under home
    assert Settings().engine.python == fresh_home / "engine-venv" / "bin" / "python"
    monkeypatch.setenv("RADIXGATE_ENGINE__MODEL_PATH", "/models/mine")  # a path given wins
    assert Settings().engine.model_path == Path("/models/mine")
    assert Settings().engine.python == fresh_home / "engine-venv" / "bin" / "python"
    monkeypatch.setenv("RADIXGATE_HOME", "~/rg")  # quoted, unexpanded by the shell
    assert Settings().home == Path(os.environ["HOME"]) / "rg"
    monkeypatch.delenv("RADIXGATE_HOME")
    assert Settings().engine.python == Path(os.environ["HOME"]) / ".cache/radixgate/engine-venv/bin/python"


def test_the_config_table_names_the_home_setting() -> None:
    rows = {env: default for env, default, _ in settings_rows()}
    assert rows["RADIXGATE_HOME"] == "`~/.cache/radixgate`"
    assert rows["RADIXGATE_ENGINE__PYTHON"] == "`$RADIXGATE_HOME/engine-venv/bin/python`"
    assert rows["RADIXGATE_ENGINE__MODEL_PATH"] == "`$RADIXGATE_HOME/models/SmolLM2-135M-Instruct`"


def shell_paths(env: dict[str, str]) -> list[str]:
    script = '. scripts/home.sh; printf "%s\\n" "$RG_HOME" "$RG_ENGINE_VENV/bin/python" "$RG_MODEL_DIR"'
    script += ' "$RG_PEERS_DIR"'
    out = subprocess.run(
        ["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


@pytest.mark.parametrize("given", [True, False])
def test_the_shell_scripts_and_the_gateway_agree_on_every_path(fresh_home: Path, given: bool) -> None:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"]}
    if given:
        env["RADIXGATE_HOME"] = str(fresh_home)
    else:
        os.environ.pop("RADIXGATE_HOME")
    home = configured_home()
    paths = home_engine_paths(home)
    assert shell_paths(env) == [
        str(home),
        str(paths["python"]),
        str(paths["model_path"]),
        str(paths["peers"]),
    ]
    settings = Settings()
    assert (settings.engine.python, settings.engine.model_path) == (paths["python"], paths["model_path"])


BUILDS_THE_DEFAULT = ("HOME/.cache/radixgate", "HOME}/.cache/radixgate", '".cache" / "radixgate"')
"""Code that spells the default folder itself (shell, compose, Python); prose that names it is fine."""


def test_no_other_part_builds_the_default_folder() -> None:
    """The fault's kind: a part that builds ~/.cache/radixgate itself ignores RADIXGATE_HOME (the bench's
    peers folder, the engine fixture's paths)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    # the places that define it: the shell's, the gateway's, and compose's own (checked in test_compose.py)
    allowed = {
        "scripts/home.sh",
        "service/config/engine.py",
        "compose.yaml",
        "tests/service/config/test_home_setting.py",
    }
    offenders = []
    for name in tracked.stdout.splitlines():
        path = ROOT / name
        if name in allowed or name.endswith((".md", ".png")) or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        offenders += [f"{name}: {pattern}" for pattern in BUILDS_THE_DEFAULT if pattern in text]
    assert offenders == []
    for script in ("scripts/engine/setup.sh", "scripts/peers/setup.sh"):
        assert ". " in (ROOT / script).read_text() and "home.sh" in (ROOT / script).read_text()


def test_the_bench_looks_for_peers_and_the_model_under_home(fresh_home: Path, tmp_path: Path) -> None:
    assert default_peers_dir() == fresh_home / "peers"
    cfg = BenchConfig(targets=["radixgate"], modes=["c1"], out=tmp_path / "bench")
    assert cfg.peers_dir == fresh_home / "peers"
    model = fresh_home / "models" / "SmolLM2-135M-Instruct"
    assert resolve_tokenizer(cfg) != model  # not converted there: a stub
    write_stub_model(model)
    assert resolve_tokenizer(cfg) == model


def test_the_engine_fixture_reads_the_home_setting(fresh_home: Path) -> None:
    with pytest.raises(RuntimeError, match=str(fresh_home / "engine-venv")):
        engine_settings()  # nothing built in the fresh home: the error names where it looked
    python = fresh_home / "engine-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    (fresh_home / "models" / "SmolLM2-135M-Instruct").mkdir(parents=True)
    (fresh_home / "models" / "SmolLM2-135M-Instruct" / "config.json").write_text("{}")
    engine = engine_settings()
    assert engine.python == python and engine.model_path.parent == fresh_home / "models"


@pytest.mark.engine
def test_the_demo_runs_from_a_fresh_home(tmp_path: Path) -> None:
    """``RADIXGATE_HOME=<a folder> make demo`` built the engine there, then the gateway exited with 2."""
    built = configured_home()  # where this machine's engine and model are (RADIXGATE_HOME or the default)
    home = tmp_path / "fresh-home"
    home.mkdir()
    for part in ("engine-venv", "models"):  # a fresh folder holding the same builds (no rebuild)
        (home / part).symlink_to(built / part, target_is_directory=True)
    user = tmp_path / "user"  # no ~/.cache/radixgate to fall back to
    user.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("RADIXGATE_")}
    env |= {"HOME": str(user), "RADIXGATE_HOME": str(home)}
    proc = subprocess.run(
        [sys.executable, "scripts/demo.py", "--port", str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    log = ROOT / ".run" / "gateway.log"
    assert proc.returncode == 0, out + (log.read_text(errors="replace")[-3000:] if log.exists() else "")
    assert f"(engine and model under {home}:" in out
    assert out.count("usage: prompt=") == 3 and "429" in out
    assert not (user / ".cache" / "radixgate").exists()

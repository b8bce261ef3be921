"""``compose.yaml`` as documented can start (issue 25, item 8): Docker is not here, so the file and its
defaults are checked as Docker Compose would read them.

The model mount defaulted to ``./models/SmolLM2-135M-Instruct``, which nothing creates (``make engine`` puts
the model under ``$RADIXGATE_HOME/models``), ``RADIXGATE_MODEL_DIR`` was documented nowhere, the SGLang image
was ``:latest``, and with no ``.dockerignore`` a 494 MB ``.venv`` went into the build context.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.config.settings import Settings
from service.config.sources import OTHER_VARIABLES, unknown_settings
from tests.support.paths import REPO

ROOT = REPO
COMPOSE = ROOT / "compose.yaml"
SECRETS = {"RADIXGATE_ADMIN_TOKEN": "compose-admin-token-0123", "RADIXGATE_KEY_PEPPER": "compose-pepper"}


class Missing(Exception):
    """A ``${VAR:?message}`` whose variable is unset or empty."""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Docker Compose's variable interpolation (compose-spec "Interpolation"): ``$$``, ``$VAR``, ``${VAR}``,
    ``${VAR:-default}`` / ``${VAR-default}``, ``${VAR:?error}`` / ``${VAR?error}``; defaults may nest."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            depth, j = 1, i + 2
            while depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            out.append(_expression(text[i + 2 : j - 1], env))
            i = j
        elif m := re.match(r"\$([A-Za-z_][A-Za-z0-9_]*)", text[i:]):
            out.append(env.get(m.group(1), ""))
            i += m.end()
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _expression(body: str, env: Mapping[str, str]) -> str:
    m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(:?[-?])?(.*)\Z", body, re.S)
    assert m, body
    name, op, rest = m.groups()
    value = env.get(name)
    unset = value is None or (op is not None and op.startswith(":") and value == "")
    if op is None or not unset:
        return value or ""
    if op.endswith("?"):
        raise Missing(f"{name}: {rest}")
    return interpolate(rest, env)


def variables(text: str) -> set[str]:
    """Every variable the file refers to."""
    return set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text.replace("$$", "")))


def walk(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


def resolved(env: Mapping[str, str]) -> dict[str, Any]:
    """The file as Compose sees it under ``env`` (YAML first, then interpolation of each string)."""

    def fill(node: Any) -> Any:
        if isinstance(node, str):
            return interpolate(node, env)
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(v) for v in node]
        return node

    data: dict[str, Any] = fill(yaml.safe_load(COMPOSE.read_text()))
    return data


def shell_model_dir(env: Mapping[str, str]) -> str:
    """Where ``make engine`` converts the model under ``env`` (``scripts/home.sh``, sourced by setup.sh)."""
    run = subprocess.run(
        ["bash", "-c", '. scripts/home.sh; printf %s "$RG_MODEL_DIR"'],
        cwd=ROOT,
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return run.stdout


def bind_sources(data: Mapping[str, Any]) -> dict[tuple[str, str], str]:
    """(service, target) -> host source of every bind mount (long and short syntax)."""
    found = {}
    for name, service in data["services"].items():
        for volume in service.get("volumes", []):
            if isinstance(volume, dict):
                if volume.get("type") == "bind":
                    found[name, volume["target"]] = volume["source"]
            elif volume.split(":")[0].startswith((".", "/", "~", "$")):
                found[name, volume.split(":")[1]] = volume.split(":")[0]
    return found


@pytest.mark.parametrize(
    "env",
    [
        {"HOME": "/home/op"},
        {"HOME": "/home/op", "RADIXGATE_HOME": "/srv/radixgate"},
        {"HOME": "/home/op", "RADIXGATE_HOME": "/srv/radixgate", "RADIXGATE_MODEL_DIR": "/models/mine"},
    ],
    ids=["defaults", "RADIXGATE_HOME", "RADIXGATE_MODEL_DIR"],
)
def test_the_model_mount_is_where_make_engine_puts_the_model(env: dict[str, str]) -> None:
    sources = bind_sources(resolved({**env, **SECRETS}))
    model_mounts = {k for k in sources if k[1] == "/model"}
    assert model_mounts == {(s, "/model") for s in ("worker", "worker-cpu", "gateway-1", "gateway-2")}
    sources = {k: v for k, v in sources.items() if k in model_mounts}  # the others are deploy/ config files
    expected = env.get("RADIXGATE_MODEL_DIR") or shell_model_dir(env)
    assert set(sources.values()) == {expected}
    if "RADIXGATE_MODEL_DIR" not in env:  # the gateway's own default model path, too
        home = env.get("RADIXGATE_HOME") or f"{env['HOME']}/.cache/radixgate"
        assert Settings.model_validate({"home": home}).engine.model_path == Path(expected)


def test_the_documented_command_names_every_variable_compose_requires() -> None:
    text = COMPOSE.read_text()
    with pytest.raises(Missing, match="RADIXGATE_ADMIN_TOKEN"):
        resolved({"HOME": "/home/op"})
    required = set(re.findall(r"\$\{([A-Z_]+):?\?", text))
    assert required == set(SECRETS)
    documented = [line for line in text.splitlines() if "docker compose --profile" in line]
    assert {p for line in documented for p in ("gpu", "cpu", "sim") if f"--profile {p} " in line} == {
        "gpu",
        "cpu",
        "sim",
    }
    for line in documented:  # the sim line continues the one before it
        context = text[: text.index(line) + len(line)].splitlines()[-2:]
        assert all(any(f"{name}=" in part for part in context) for name in required), line
    assert "make engine" in text  # the step that creates the model folder
    for name in variables(text) - {"HOME"}:  # each a gateway setting, or a Compose-only one that is named
        assert not unknown_settings(Settings, {name: "x"}) or name in OTHER_VARIABLES, name
        assert name in text.split("name: radixgate")[0], f"{name} is not explained in the header"


def test_every_image_is_pinned_and_sglang_matches_the_engine_pin() -> None:
    data = yaml.safe_load(COMPOSE.read_text())
    for name, service in data["services"].items():
        if "build" in service:
            continue
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag and tag not in ("", "latest"), f"{name}: {image}"
    pin = re.search(r"^SGLANG_VERSION=(\S+)", (ROOT / "scripts/engine/setup.sh").read_text(), re.M)
    assert pin and data["services"]["worker"]["image"] == f"lmsysorg/sglang:v{pin.group(1)}"
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            tag = line.split()[1].rpartition(":")[2]
            assert tag and tag != "latest" and ":" in line, line


@pytest.mark.parametrize("gateway", ["gateway-1", "gateway-2"])
def test_the_gateway_services_set_only_real_settings_and_find_the_workers(
    gateway: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = resolved({"HOME": "/home/op", **SECRETS})
    env = {k: str(v) for k, v in data["services"][gateway]["environment"].items()}
    assert unknown_settings(Settings, env) == []
    for name in list(os.environ):
        if name.upper().startswith("RADIXGATE_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    worker = data["services"]["worker"]
    assert settings.upstream.workers == []  # found by DNS: every worker service's network alias
    for name in ("worker", "worker-cpu", "sim-worker"):
        assert data["services"][name]["networks"]["default"]["aliases"] == [settings.discovery.dns_name]
    assert settings.tokenizer_path == Path("/model")  # the mount's target
    assert settings.admin_token.get_secret_value() == SECRETS["RADIXGATE_ADMIN_TOKEN"]
    command = " ".join(worker["command"].split())
    assert f"--served-model-name {settings.engine.served_model_name}" in command  # the gateway's model id
    assert f"--port {settings.discovery.port}" in command and "--enable-priority-scheduling" in command
    assert "--enable-metrics" in command  # the scheduler polls the worker's load from /metrics
    assert data["services"][gateway]["command"] == ["python", "-m", "service", "serve"]


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    return any(
        fnmatch.fnmatch(path, p.removeprefix("**/"))
        or fnmatch.fnmatch(Path(path).name, p.removeprefix("**/"))
        or path.startswith(p.rstrip("/") + "/")
        for p in patterns
    )


def test_the_build_context_leaves_out_the_virtualenv_git_and_caches() -> None:
    patterns = dockerignore()
    for heavy in (
        ".venv",
        ".git",
        ".run",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        "service/__pycache__",
    ):
        assert ignored(heavy, patterns), heavy
    dockerfile = (ROOT / "Dockerfile").read_text().splitlines()
    sources = [src for line in dockerfile if line.startswith("COPY ") for src in line.split()[1:-1]]
    assert {"pyproject.toml", "README.md", "service", "tenancy", "policies", "loadgen"} <= set(sources)
    for source in sources:  # what the image is built from stays in the context
        assert not ignored(source, patterns), source
        assert (ROOT / source).exists(), source


def test_the_docs_document_the_compose_variables() -> None:
    page = (ROOT / "docs" / "scaling.md").read_text()
    for name in ("RADIXGATE_MODEL_DIR", "RADIXGATE_TP", "docker compose --profile gpu up", "make engine"):
        assert name in page, name

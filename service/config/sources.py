"""Where settings come from besides the environment, and what the command line says about them.

- :class:`ConfigFileSource`: the TOML or YAML file named by ``config_file`` (``--config`` or
  ``RADIXGATE_CONFIG_FILE``), read through pydantic-settings' own ``TomlConfigSettingsSource`` /
  ``YamlConfigSettingsSource``; the environment overrides it (:meth:`service.config.settings.Settings.
  settings_customise_sources`).
- :func:`unknown_settings`: ``RADIXGATE_*`` variables and file keys that name no setting (a misspelled
  ``RADIXGATE_API__CONTEXT_LENGHT`` or ``RADIXGATE_REDIS_URL`` was ignored without a word), each with the
  closest setting's name (:func:`difflib.get_close_matches`).
- :func:`effective_settings`: every setting's value as ``python -m service config check`` prints it, secrets
  masked, with where it came from.

Takes the settings class as an argument (no import of :mod:`service.config.settings`, which imports this
module).
"""

from __future__ import annotations

import difflib
import json
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)

PREFIX = "RADIXGATE_"
NESTED = "__"

OTHER_VARIABLES: dict[str, str] = {
    "RADIXGATE_MODEL_DIR": "compose.yaml: the host's model folder both containers mount",
    "RADIXGATE_TP": "compose.yaml: --tp of the SGLang worker container",
    "RADIXGATE_WRITE_DOCS": "tests/loadgen/test_fleet_crosscheck.py: also write docs/experiments.md",
}
"""``RADIXGATE_*`` variables that are not settings but are read by another tool (Docker Compose, a test):
not reported as unknown."""

FILE_SUFFIXES = (".toml", ".yaml", ".yml")


class ConfigFileError(ValueError):
    """The settings file is missing, unreadable, not TOML/YAML, or not a table of settings."""


def read_config_file(settings_cls: type[BaseSettings], path: Path) -> dict[str, Any]:
    """The settings in ``path`` (``.toml``, ``.yaml`` or ``.yml``) as nested dicts, keys as in the tree.

    Raises:
        ConfigFileError: with a one-line reason (pydantic-settings' sources skip a missing file silently).
    """
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise ConfigFileError(f"{path}: a settings file is .toml, .yaml or .yml")
    if not path.is_file():
        raise ConfigFileError(f"{path}: no such file")
    try:
        source: PydanticBaseSettingsSource = (
            TomlConfigSettingsSource(settings_cls, toml_file=path)
            if suffix == ".toml"
            else YamlConfigSettingsSource(settings_cls, yaml_file=path)
        )
        data = source()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigFileError(f"{path}: not valid {suffix[1:].upper()} ({reason})") from None
    except (TypeError, ValueError):  # a YAML list or scalar at the top
        raise ConfigFileError(f"{path}: the file must be a table (mapping) of settings") from None
    return dict(data)


class ConfigFileSource(PydanticBaseSettingsSource):
    """The file named by ``config_file`` in the sources above it (the constructor's arguments or
    ``RADIXGATE_CONFIG_FILE``); nothing when none names one.

    Raises (when called):
        ConfigFileError: see :func:`read_config_file`.
    """

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        """Unused: :meth:`__call__` reads the whole file."""
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        """The file's settings."""
        named = self.current_state.get("config_file")
        return read_config_file(self.settings_cls, Path(named)) if named else {}


def _model_of(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _map_value_model(annotation: Any) -> type[BaseModel] | None:
    """``Model`` of a ``dict[str, Model]`` field (the priority classes: free names, then the fields)."""
    if typing.get_origin(annotation) is dict:
        args = typing.get_args(annotation)
        return _model_of(args[1]) if len(args) == 2 else None
    return None


def _known(model: type[BaseModel], path: list[str]) -> bool:
    """Whether ``path`` (field names, lower case) names a setting or a whole section of ``model``."""
    field = model.model_fields.get(path[0]) if path[0] else None
    if field is None:
        return False
    rest = path[1:]
    if not rest:
        return True
    sub = _model_of(field.annotation)
    if sub is not None:
        return _known(sub, rest)
    values = _map_value_model(field.annotation)
    if values is not None and rest[0]:
        return len(rest) == 1 or _known(values, rest[1:])
    return False


def _leaves(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of every leaf setting (a section's fields, not the section)."""
    for name, field in model.model_fields.items():
        sub = _model_of(field.annotation)
        if sub is not None:
            yield from _leaves(sub, (*prefix, name))
        else:
            yield (*prefix, name)


def _map_entries(model: type[BaseModel], path: list[str]) -> list[tuple[str, ...]]:
    """For a path into a ``dict[str, Model]`` field (``priority_classes.gold.rnk``): the fields of that
    entry (``priority_classes.gold.rank``, ...), candidates for the closest setting."""
    field = model.model_fields.get(path[0])
    values = _map_value_model(field.annotation) if field is not None else None
    if values is None or len(path) < 3:
        return []
    return [(path[0], path[1], *leaf) for leaf in _leaves(values)]


def env_name(path: tuple[str, ...]) -> str:
    """``("redis", "url")`` -> ``RADIXGATE_REDIS__URL``."""
    return PREFIX + NESTED.join(part.upper() for part in path)


@dataclass(frozen=True)
class UnknownSetting:
    """A name that is no setting: ``name`` as given, where (``environment`` or the file), and the closest
    setting (None when nothing is close)."""

    name: str
    where: str
    closest: str | None

    def message(self) -> str:
        """One line for the operator."""
        hint = f"; did you mean {self.closest}?" if self.closest else ""
        return f"warning: {self.name} ({self.where}) is not a setting and is ignored{hint}"


def _closest(name: str, candidates: list[str], strip: str = "") -> str | None:
    """The candidate most like ``name`` (difflib's ratio, on the part after ``strip``), if close enough."""
    pool = {c.removeprefix(strip): c for c in candidates}
    found = difflib.get_close_matches(name.removeprefix(strip), list(pool), n=1, cutoff=0.75)
    return pool[found[0]] if found else None


def _file_unknowns(
    model: type[BaseModel], data: Mapping[str, Any], prefix: tuple[str, ...] = ()
) -> Iterator[tuple[str, ...]]:
    for key, value in data.items():
        path = (*prefix, str(key))
        field = model.model_fields.get(str(key))
        if field is None:
            yield path
            continue
        sub = _model_of(field.annotation)
        values = _map_value_model(field.annotation)
        if sub is not None and isinstance(value, Mapping):
            yield from _file_unknowns(sub, value, path)
        elif values is not None and isinstance(value, Mapping):
            for name, entry in value.items():
                if isinstance(entry, Mapping):
                    yield from _file_unknowns(values, entry, (*path, str(name)))


def unknown_settings(
    settings_cls: type[BaseModel],
    environ: Mapping[str, str],
    file_data: Mapping[str, Any] | None = None,
    file_name: str = "the settings file",
) -> list[UnknownSetting]:
    """``RADIXGATE_*`` variables of ``environ`` (any case, as pydantic-settings matches them) and keys of
    ``file_data`` that name no setting of ``settings_cls``, in order, each with its closest setting.

    :data:`OTHER_VARIABLES` are not reported. A variable naming a whole section (``RADIXGATE_REDIS`` as a
    JSON object) is a setting.
    """
    leaves = list(_leaves(settings_cls))
    env_names = [env_name(p) for p in leaves] + list(OTHER_VARIABLES)
    found: list[UnknownSetting] = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith(PREFIX) or upper in OTHER_VARIABLES:
            continue
        path = upper.removeprefix(PREFIX).lower().split(NESTED)
        if not _known(settings_cls, path):
            nearby = env_names + [env_name(p) for p in _map_entries(settings_cls, path)]
            found.append(UnknownSetting(name, "environment", _closest(upper, nearby, PREFIX)))
    dotted = [".".join(p) for p in leaves]
    for keys in _file_unknowns(settings_cls, file_data or {}):
        key = ".".join(keys)
        nearby = dotted + [".".join(p) for p in _map_entries(settings_cls, list(keys))]
        found.append(UnknownSetting(key, file_name, _closest(key, nearby)))
    return found


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (``redis://:pw@h:6379/0`` -> ``redis://:***@h:6379/0``)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port is not None else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _shown(value: Any) -> str:
    if isinstance(value, SecretStr):
        return "********" if value.get_secret_value() else ""
    if isinstance(value, BaseModel | dict | list | tuple):  # as JSON, models inside too (RADIXGATE_MODELS)
        return json.dumps(to_jsonable_python(value))
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    return mask_url(text) if "://" in text else text


def effective_settings(
    settings: BaseSettings, environ: Mapping[str, str], file: Path | None = None
) -> list[tuple[str, str, str]]:
    """``(RADIXGATE_ name, value, source)`` of every leaf setting of ``settings``: the value as the
    environment would give it (lists and maps as JSON; secrets as ``********``, a URL's password as
    ``***``), the source ``env``, the file's name or ``default``.

    Raises:
        ConfigFileError: ``file`` cannot be read (see :func:`read_config_file`).
    """
    file_data = read_config_file(type(settings), file) if file is not None else {}
    file_name = str(file)
    env_upper = {name.upper() for name in environ}
    rows: list[tuple[str, str, str]] = []
    for path in _leaves(type(settings)):
        value: Any = settings
        for part in path:
            value = getattr(value, part)
        node: Any = file_data
        for part in path:
            node = node.get(part) if isinstance(node, Mapping) else None
        name = env_name(path)
        sections = {env_name(path[:i]) for i in range(1, len(path))}  # a section given as JSON
        from_env = name in env_upper or bool(sections & env_upper)
        source = "env" if from_env else file_name if node is not None else "default"
        rows.append((name, _shown(value), source))
    return rows


CONFIG_FILE_ENV = "RADIXGATE_CONFIG_FILE"


def config_file_in(environ: Mapping[str, str], given: Path | None = None) -> Path | None:
    """The settings file in use: ``given`` (``--config``), else ``RADIXGATE_CONFIG_FILE`` (any case, as
    pydantic-settings matches it), else None."""
    if given is not None:
        return given
    named = next((v for k, v in environ.items() if k.upper() == CONFIG_FILE_ENV and v), None)
    return Path(named) if named else None


def startup_warnings(
    settings_cls: type[BaseSettings], environ: Mapping[str, str], file: Path | None
) -> list[str]:
    """One line for each ``RADIXGATE_*`` variable and file key that names no setting (the file was read
    already by the settings, so it is readable)."""
    data = read_config_file(settings_cls, file) if file is not None else None
    return [u.message() for u in unknown_settings(settings_cls, environ, data, str(file))]


def origin(
    settings_cls: type[BaseSettings],
    loc: tuple[int | str, ...],
    environ: Mapping[str, str],
    file: Path | None,
) -> str:
    """`` (in FILE)`` when the setting at ``loc`` (a validation error's location) came from the settings
    file and not from the environment; else empty."""
    if file is None or not loc:
        return ""
    names = {name.upper() for name in environ}
    path = tuple(str(p) for p in loc)
    if any(env_name(path[:i]) in names for i in range(1, len(path) + 1)):
        return ""
    try:
        node: Any = read_config_file(settings_cls, file)
    except ConfigFileError:
        return ""
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return ""
        node = node[part]
    return f" (in {file})"


JSON_EXAMPLES = {
    "workers": """'["http://10.0.0.5:30000", "http://10.0.0.6:30000"]'""",
    "priority_classes": """'{"interactive": {"rank": 2, "sglang_priority": 10, "ttft_goal_ms": 500}, """
    """"standard": {"rank": 1, "sglang_priority": 0, "ttft_goal_ms": 2000}}'""",
    "models": """'[{"id": "llama-3.1-8b", "workers": ["http://10.0.0.5:30000"]}]'""",
    "extra_models": """'["my-alias"]'""",
}
"""An example value of each list or map setting, by field name, for the error of one that is not JSON."""


def _unwrapped(annotation: Any) -> Any:
    """``annotation`` without ``Annotated[...]`` and ``| None``."""
    while True:
        origin = typing.get_origin(annotation)
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if origin is typing.Annotated or (origin in (typing.Union, types.UnionType) and len(args) == 1):
            annotation = args[0]
        else:
            return annotation


def _json_example(name: str, annotation: Any) -> str | None:
    """An example of a setting that the environment gives as JSON (a list, a map, a section), or None for
    a plain value."""
    kind = _unwrapped(annotation)
    origin = typing.get_origin(kind) or kind
    if name in JSON_EXAMPLES:
        return JSON_EXAMPLES[name]
    if origin in (list, tuple, set):
        return """'["a", "b"]'"""
    if origin is dict or _model_of(kind) is not None:
        return """'{"name": "value"}'"""
    return None


def non_json_variables(
    settings_cls: type[BaseModel], environ: Mapping[str, str], field: str
) -> list[tuple[str, str]]:
    """The variables under setting ``field`` (``RADIXGATE_UPSTREAM`` and ``RADIXGATE_UPSTREAM__*``) that must
    be JSON (a list, a map, a whole section) and are not: (variable, an example of the setting), in name
    order. pydantic-settings names only the top field (``upstream``) of such an error.
    """
    found = []
    top = env_name((field,))
    for name in sorted(environ):
        upper = name.upper()
        if upper != top and not upper.startswith(top + NESTED):
            continue
        model: type[BaseModel] | None = settings_cls
        annotation: Any = None
        path = upper.removeprefix(PREFIX).lower().split(NESTED)
        for part in path:
            info = model.model_fields.get(part) if model is not None else None
            if info is None:
                annotation = None
                break
            annotation, model = info.annotation, _model_of(_unwrapped(info.annotation))
        example = _json_example(path[-1], annotation) if annotation is not None else None
        if example is None:
            continue
        try:
            json.loads(environ[name])
        except ValueError:
            found.append((upper, example))
    return found

"""Markdown table of every setting (env var, default, description), for docs/configuration.md."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from service.config.settings import Settings, default_home


def _default(field_default: object, factory: object) -> str:
    value = factory() if field_default is PydanticUndefined and callable(factory) else field_default
    if isinstance(value, Path) and value != default_home() and value.is_relative_to(default_home()):
        return f"`$RADIXGATE_HOME/{value.relative_to(default_home())}`"  # follows the home setting
    if isinstance(value, Path):
        repo = str(Path(__file__).resolve().parents[2])
        return f"`{str(value).replace(repo, '<repo>').replace(str(Path.home()), '~')}`"
    if isinstance(value, BaseModel):
        return "(see rows below)"
    if hasattr(value, "get_secret_value"):
        secret = value.get_secret_value()
        return "*(empty)*" if not secret else "*(built-in)*"
    if isinstance(value, dict):
        return ", ".join(value) if value else "{}"
    if value in (None, "", []):
        return "*(none)*" if value is None else "*(empty)*"
    return f"`{value}`"


def settings_rows(
    model: type[BaseModel] = Settings, prefix: str = "RADIXGATE_"
) -> list[tuple[str, str, str]]:
    """(env var, default, description) for every leaf setting, nested models flattened with ``__``."""
    rows: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        env = f"{prefix}{name.upper()}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.extend(settings_rows(annotation, env + "__"))
            continue
        description = (field.description or "").replace("|", "\\|")
        rows.append((env, _default(field.default, field.default_factory), description))
    return rows


def settings_table() -> str:
    """docs/configuration.md's configuration table (markdown)."""
    lines = ["| env var | default | meaning (units) |", "|---|---|---|"]
    lines += [f"| `{env}` | {default} | {desc} |" for env, default, desc in settings_rows()]
    return "\n".join(lines)

"""Where the repository lies, for tests at any depth of ``tests/`` that read its files."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository root (the folder holding ``pyproject.toml``)."""

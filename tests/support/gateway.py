"""Settings of a test gateway in front of a :class:`~tests.support.fake_worker.FakeWorker`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.config.settings import Settings
from tests.conftest import ADMIN_TOKEN
from tests.service.api.test_api import MODEL


def fake_worker_settings(
    redis_url: str, stub_model_dir: Path, worker_url: str, prefix: str, **sections: Any
) -> Settings:
    """Settings of a gateway on Redis ``redis_url`` (keys under ``prefix``) with the stub tokenizer and one
    worker at ``worker_url``; ``sections`` add or replace whole settings sections (``api`` is merged)."""
    api = {"tokenizer_path": str(stub_model_dir), **sections.pop("api", {})}
    return Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": prefix},
            "engine": {"served_model_name": MODEL},
            "upstream": {"workers": [worker_url], "health_interval_s": 0.2},
            "api": api,
            **sections,
        }
    )

"""Shared fixtures: a real redis-server per session, a stub tokenizer folder, gateway factories."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from service.app import create_app
from service.config.settings import Settings
from service.workers.launcher import WorkerProcess
from tests.support.engine import running_worker
from tests.support.fake_worker import FakeWorker
from tests.support.model_stub import write_stub_model
from tests.support.redis_cluster import redis_cluster
from tests.support.servers import ThreadedServer, redis_server

ADMIN_TOKEN = "test-admin-token-0123456789"


MODEL = "test-model"
_ids = itertools.count()


def gateway_settings(redis_url: str, model_dir: Path, workers: list[str], **api: Any) -> Settings:
    return Settings.model_validate(
        {
            "admin_token": ADMIN_TOKEN,
            "redis": {"url": redis_url, "key_prefix": f"api{next(_ids)}:"},
            "engine": {"served_model_name": MODEL},
            "extra_models": ["test-model-b"],
            "upstream": {
                "workers": workers,
                "health_interval_s": 0.2,
                "max_attempts": 2,
                "breaker_cooldown_s": 0.3,
            },
            "api": {"tokenizer_path": str(model_dir), "max_body_bytes": 4096, "context_length": 512, **api},
        }
    )


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a redis-server started for this test session."""
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of one node of a three-node Redis Cluster started for this test session."""
    with redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as url:
        yield url


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """An async client on a flushed database."""
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def stub_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder with a word-level tokenizer and a ChatML template."""
    return write_stub_model(tmp_path_factory.mktemp("stub-model"))


@pytest.fixture(scope="session")
def engine_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """One real SGLang CPU worker (SmolLM2-135M-Instruct) shared by the engine tests of a session."""
    with running_worker(tmp_path_factory.mktemp("engine")) as proc:
        yield proc


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeWorker, str]]:
    """A fake SGLang worker (one per test module) and its URL."""
    worker = FakeWorker()
    with ThreadedServer(worker.app) as server:
        yield worker, server.url


@pytest.fixture(scope="module")
def gateway(redis_url: str, stub_model_dir: Path, fake: tuple[FakeWorker, str]) -> Iterator[str]:
    """A gateway in front of :func:`fake` with the stub model (one per test module); its base URL. A module
    that needs other settings defines its own ``gateway``."""
    settings = gateway_settings(redis_url, stub_model_dir, [fake[1]], max_body_bytes=65536)
    with ThreadedServer(create_app(settings)) as server:
        yield server.url

"""Shared fixtures: a real redis-server per session, a stub tokenizer folder, gateway factories."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from service.workers.launcher import WorkerProcess
from tests.support.engine import running_worker
from tests.support.model_stub import write_stub_model
from tests.support.servers import redis_server

ADMIN_TOKEN = "test-admin-token-0123456789"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a redis-server started for this test session."""
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
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

"""Automatic pipelining of script calls (tenancy/script_batch.py): concurrent calls share one pipeline and
each gets its own reply or error, exactly as if sent alone."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from tenancy.script_batch import ScriptBatcher
from tests.support.servers import free_port

ECHO = """
if ARGV[1] == 'bad' then return redis.error_reply('bad input') end
redis.call('INCR', KEYS[1])
return {ARGV[1], redis.call('GET', KEYS[1])}
"""


class CountingPipelines:
    """Counts the pipelines a client opens."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.opened = 0
        self._pipeline = client.pipeline

        def pipeline(*args: Any, **kwargs: Any) -> Any:
            self.opened += 1
            return self._pipeline(*args, **kwargs)

        client.pipeline = pipeline  # type: ignore[method-assign]


async def test_concurrent_calls_share_one_pipeline_and_keep_their_order(redis_client: aioredis.Redis) -> None:
    pipes = CountingPipelines(redis_client)
    batcher = ScriptBatcher(redis_client)
    script = redis_client.register_script(ECHO)
    replies = await asyncio.gather(*(batcher.run(script, ["counter"], [f"v{i}"]) for i in range(20)))
    assert replies == [[f"v{i}", str(i + 1)] for i in range(20)]  # run one after another, in call order
    assert pipes.opened == 1
    assert await batcher.run(script, ["counter"], ["alone"]) == ["alone", "21"]
    assert pipes.opened == 1  # a batch of one is a plain call


async def test_a_script_error_fails_only_its_own_call(redis_client: aioredis.Redis) -> None:
    batcher = ScriptBatcher(redis_client)
    script = redis_client.register_script(ECHO)
    replies = await asyncio.gather(
        *(batcher.run(script, ["k"], [arg]) for arg in ("a", "bad", "c")), return_exceptions=True
    )
    assert replies[0] == ["a", "1"] and replies[2] == ["c", "2"]
    assert isinstance(replies[1], redis.exceptions.ResponseError) and "bad input" in str(replies[1])


async def test_scripts_flushed_from_redis_are_loaded_again(redis_client: aioredis.Redis) -> None:
    batcher = ScriptBatcher(redis_client)
    script = redis_client.register_script(ECHO)
    await batcher.run(script, ["k"], ["warm"])
    await redis_client.script_flush()
    replies = await asyncio.gather(*(batcher.run(script, ["k"], [str(i)]) for i in range(3)))
    assert sorted(r[1] for r in replies) == ["2", "3", "4"]


async def test_an_unreachable_redis_fails_every_call_of_the_batch() -> None:
    client = aioredis.Redis(port=free_port(), socket_connect_timeout=1)
    try:
        batcher = ScriptBatcher(client)
        script = client.register_script(ECHO)
        replies = await asyncio.gather(
            *(batcher.run(script, ["k"], [str(i)]) for i in range(3)), return_exceptions=True
        )
        assert all(isinstance(r, redis.exceptions.ConnectionError) for r in replies), replies
        with pytest.raises(redis.exceptions.ConnectionError):
            await batcher.run(script, ["k"], ["alone"])
    finally:
        await client.aclose()

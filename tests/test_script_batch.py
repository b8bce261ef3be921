"""Automatic pipelining of script calls (tenancy/script_batch.py): concurrent calls share one write and
each gets its own reply or error, exactly as if sent alone; the hand-packed EVALSHA is byte-identical to
redis-py's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions

from tenancy.script_batch import ScriptBatcher, pack_evalsha
from tests.support.servers import free_port

ECHO = """
if ARGV[1] == 'bad' then return redis.error_reply('bad input') end
redis.call('INCR', KEYS[1])
return {ARGV[1], redis.call('GET', KEYS[1])}
"""


class CountingWrites:
    """Counts the connection checkouts of a client's pool (one per write of a batch)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.writes = 0
        pool = client.connection_pool
        get_connection = pool.get_connection

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.writes += 1
            return await get_connection(*args, **kwargs)

        pool.get_connection = counted  # type: ignore[method-assign]


async def test_concurrent_calls_share_one_write_and_keep_their_order(redis_client: aioredis.Redis) -> None:
    batcher = ScriptBatcher(redis_client)
    script = redis_client.register_script(ECHO)
    await redis_client.script_load(ECHO)
    writes = CountingWrites(redis_client)
    replies = await asyncio.gather(*(batcher.run(script, ["counter"], [f"v{i}"]) for i in range(20)))
    assert replies == [[f"v{i}", str(i + 1)] for i in range(20)]  # run one after another, in call order
    # the first call finds nothing in progress and goes at once; the 19 made meanwhile go together
    assert writes.writes == 2
    assert await batcher.run(script, ["counter"], ["alone"]) == ["alone", "21"]
    assert writes.writes == 3  # a call alone is one write, sent without waiting a loop round


@pytest.mark.parametrize(
    ("keys", "args"),
    [
        ([], []),
        (["k"], ["v"]),
        (["t:{a}", "b:{a}"], ["", "take", 0, -7, 1.5, 1e300, 0.1 + 0.2, "ünïcode ✓", "with\r\nnewline"]),
        (["k"] * 3, [2**63, -(2**63), 123456789.125]),
    ],
)
def test_evalsha_is_packed_byte_for_byte_as_redis_py_packs_it(
    redis_client: aioredis.Redis, keys: list[str], args: list[Any]
) -> None:
    conn = redis_client.connection_pool.make_connection()
    expected = b"".join(conn.pack_command("EVALSHA", "f" * 40, len(keys), *keys, *args))
    assert pack_evalsha("f" * 40, keys, args) == expected


@pytest.mark.parametrize("bad", [True, None, b"bytes", [1]])
def test_an_argument_redis_py_would_refuse_is_refused(bad: Any) -> None:
    with pytest.raises(TypeError):
        pack_evalsha("f" * 40, ["k"], [bad])


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

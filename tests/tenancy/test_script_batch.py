"""Automatic pipelining of script calls (tenancy/script_batch.py): concurrent calls share one write and
each gets its own reply or error, exactly as if sent alone; the hand-packed EVALSHA is byte-identical to
redis-py's."""

from __future__ import annotations

import asyncio
import tomllib
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions
from packaging.requirements import Requirement

from tenancy.script_batch import ScriptBatcher, pack_evalsha
from tests.support.paths import REPO
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


async def test_concurrent_calls_share_one_write_and_keep_their_order(
    one_redis_client: aioredis.Redis,
) -> None:
    batcher = ScriptBatcher(one_redis_client)
    script = one_redis_client.register_script(ECHO)
    await one_redis_client.script_load(ECHO)
    writes = CountingWrites(one_redis_client)
    replies = await asyncio.gather(*(batcher.run(script, ["counter"], [f"v{i}"]) for i in range(20)))
    assert replies == [[f"v{i}", str(i + 1)] for i in range(20)]  # run one after another, in call order
    # the first call finds nothing in progress and goes at once; the 19 made meanwhile go together
    assert writes.writes == 2
    assert await batcher.run(script, ["counter"], ["alone"]) == ["alone", "21"]
    assert writes.writes == 3  # a call alone is one write, sent without waiting a loop round


async def test_a_lingering_batcher_gathers_calls_made_apart_into_one_write(
    one_redis_client: aioredis.Redis,
) -> None:
    """With ``linger_s`` (settles: off the answer's path) calls a few ms apart share one exchange, where
    without it each call alone would be its own."""
    script = one_redis_client.register_script(ECHO)
    await one_redis_client.script_load(ECHO)
    writes = CountingWrites(one_redis_client)

    batcher = ScriptBatcher(one_redis_client)
    loop = asyncio.get_running_loop()

    async def apart(linger_s: float) -> list[Any]:
        async def call(i: int) -> Any:
            await asyncio.sleep(0.01 * i)
            return await batcher.run(script, ["apart"], [f"v{i}"], linger_s)

        return await asyncio.gather(*(call(i) for i in range(4)))

    assert [r[0] for r in await apart(0.0)] == ["v0", "v1", "v2", "v3"]
    assert writes.writes == 4
    started = loop.time()
    assert [r[0] for r in await apart(0.1)] == ["v0", "v1", "v2", "v3"]
    assert writes.writes == 5  # one more write for all four
    assert loop.time() - started >= 0.1  # the first call waited its linger
    # a call without linger ends the wait: it goes out at once, after the lingering call, in one write
    started = loop.time()
    settle = asyncio.ensure_future(batcher.run(script, ["apart"], ["settle"], 5.0))
    await asyncio.sleep(0.01)
    reserve = await batcher.run(script, ["apart"], ["reserve"])
    assert (await settle)[1] == "9" and reserve[1] == "10"
    assert writes.writes == 6 and loop.time() - started < 1.0


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
    one_redis_client: aioredis.Redis, keys: list[str], args: list[Any]
) -> None:
    conn = one_redis_client.connection_pool.make_connection()
    expected = b"".join(conn.pack_command("EVALSHA", "f" * 40, len(keys), *keys, *args))
    assert pack_evalsha("f" * 40, keys, args) == expected


@pytest.mark.parametrize("bad", [True, None, [1], {"a": 1}])
def test_an_argument_redis_py_would_refuse_is_refused(bad: Any) -> None:
    with pytest.raises(TypeError):
        pack_evalsha("f" * 40, ["k"], [bad])


async def test_a_script_error_fails_only_its_own_call(one_redis_client: aioredis.Redis) -> None:
    batcher = ScriptBatcher(one_redis_client)
    script = one_redis_client.register_script(ECHO)
    replies = await asyncio.gather(
        *(batcher.run(script, ["k"], [arg]) for arg in ("a", "bad", "c")), return_exceptions=True
    )
    assert replies[0] == ["a", "1"] and replies[2] == ["c", "2"]
    assert isinstance(replies[1], redis.exceptions.ResponseError) and "bad input" in str(replies[1])


async def test_scripts_flushed_from_redis_are_loaded_again(one_redis_client: aioredis.Redis) -> None:
    batcher = ScriptBatcher(one_redis_client)
    script = one_redis_client.register_script(ECHO)
    await batcher.run(script, ["k"], ["warm"])
    await one_redis_client.script_flush()
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


async def test_a_call_does_not_linger_while_an_exchange_is_in_progress(
    one_redis_client: aioredis.Redis,
) -> None:
    """Under load (an exchange in progress) calls batch by themselves: a lingering call waits one loop
    round, not its linger (in saturated streams a linger cost 8-17% more CPU per stream)."""
    script = one_redis_client.register_script(ECHO)
    await one_redis_client.script_load(ECHO)
    batcher = ScriptBatcher(one_redis_client)
    batcher._busy = 1  # as while another batch's exchange is under way
    try:
        reply = await asyncio.wait_for(batcher.run(script, ["busy"], ["v"], 5.0), 1.0)
    finally:
        batcher._busy -= 1
    assert reply == ["v", "1"]


def test_the_packer_is_a_declared_dependency() -> None:
    """pack_evalsha calls hiredis.pack_command (hiredis 2.2.1+): hiredis is a dependency of its own with
    that floor. ``redis[hiredis]>=5.0`` alone allowed hiredis 1.x or 2.0 (redis 5's extra: >=1.0.0), under
    which every reservation and settle raised AttributeError."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "hiredis"]
    assert declared, "hiredis is not a declared dependency"
    for old in ("1.1.0", "2.0.0", "2.2.0"):
        assert not declared[0].specifier.contains(old), old

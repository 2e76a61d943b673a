"""The pipelined Redis client against a real redis-server: order, errors, scripts, reconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from gateway.redis_pipeline import RedisPipeline, encode_command, parse_reply


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[RedisPipeline]:
    pipeline = RedisPipeline(redis_url)
    yield pipeline
    await pipeline.aclose()


def test_commands_are_resp_arrays_of_bulk_strings() -> None:
    assert encode_command(["SET", "k", 12, b"\x00", 1.5]) == (
        b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n$1\r\n\x00\r\n$3\r\n1.5\r\n"
    )
    with pytest.raises(TypeError):
        encode_command(["SET", "k", True])


def test_replies_parse_only_once_complete() -> None:
    reply = b"*4\r\n:1\r\n$5\r\nhello\r\n$-1\r\n*2\r\n+OK\r\n:-7\r\n"
    assert parse_reply(reply, 0) == ([1, b"hello", None, [b"OK", -7]], len(reply))
    for cut in range(len(reply)):
        assert parse_reply(reply[:cut], 0) is None
    parsed = parse_reply(b"-ERR wrong\r\n", 0)
    assert parsed is not None and isinstance(parsed[0], ResponseError)
    with pytest.raises(ValueError):
        parse_reply(b"?what\r\n", 0)


async def test_concurrent_calls_get_their_own_replies(client: RedisPipeline) -> None:
    replies = await asyncio.gather(*(client.execute_command("INCR", "n") for _ in range(1000)))
    assert sorted(replies) == list(range(1, 1001))
    values = await asyncio.gather(
        *(client.execute_command("SET", f"k{n}", n) for n in range(200)),
        *(client.execute_command("GET", f"k{n}") for n in range(200)),
    )
    assert values[200:] == [str(n).encode() for n in range(200)]


async def test_errors_reach_the_caller_and_the_connection_goes_on(client: RedisPipeline) -> None:
    await client.execute_command("SET", "s", "text")
    with pytest.raises(ResponseError):
        await client.execute_command("INCR", "s")
    assert await client.execute_command("GET", "s") == b"text"


async def test_a_cancelled_call_does_not_shift_the_replies(client: RedisPipeline) -> None:
    slow = asyncio.ensure_future(client.execute_command("DEBUG", "SLEEP", "0.2"))
    await asyncio.sleep(0.05)
    slow.cancel()
    assert await client.execute_command("ECHO", "after") == b"after"


async def test_scripts_survive_a_script_flush(client: RedisPipeline, redis_url: str) -> None:
    script = client.register_script("return {KEYS[1], tonumber(ARGV[1]) + 1}")
    assert await script(["a"], [41]) == [b"a", 42]
    with redis.Redis.from_url(redis_url) as admin:
        admin.script_flush()
    assert await script(["b"], [1]) == [b"b", 2]


async def test_a_lost_connection_fails_pending_calls_then_reconnects(
    client: RedisPipeline, redis_url: str
) -> None:
    assert await client.execute_command("CLIENT", "SETNAME", "victim") == b"OK"
    pending = asyncio.ensure_future(client.execute_command("BLPOP", "never", 5))
    await asyncio.sleep(0.05)
    with redis.Redis.from_url(redis_url) as admin:
        assert admin.client_kill_filter(skipme=True, _type="normal") >= 1
    with pytest.raises(RedisConnectionError):
        await pending
    assert await client.execute_command("PING") == b"PONG"


async def test_the_url_selects_the_database(redis_url: str) -> None:
    client = RedisPipeline(redis_url + "?db=3")
    try:
        await client.execute_command("SET", "where", "db3")
    finally:
        await client.aclose()
    with redis.Redis.from_url(redis_url, db=3) as other:
        assert other.get("where") == b"db3"


def test_it_runs_on_uvloop_as_the_gateway_serves(redis_url: str) -> None:
    uvloop = pytest.importorskip("uvloop")

    async def round_trips() -> list[object]:
        client = RedisPipeline(redis_url)
        try:
            script = client.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
            return await asyncio.gather(script(["u"], [2]), client.execute_command("PING"))
        finally:
            await client.aclose()

    assert uvloop.run(round_trips()) == [2, b"PONG"]

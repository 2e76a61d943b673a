"""The lean Redis client against a real redis-server (on a unix socket): order, errors,
scripts, cancellation, reconnects, URL options, time limits."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.storage.redis_client import LeanRedis
from tests.gateway.redis_server_state import until_blocked_in
from tests.support.polling import eventually
from tests.support.redis_server import RedisServer

HANG_S = 30.0  # a wait that ends only if the client hangs: the failure, not a time limit


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[LeanRedis]:
    lean = LeanRedis(redis_url)
    yield lean
    await lean.aclose()


def kill_normal_clients(redis_url: str) -> None:
    with redis.Redis.from_url(redis_url) as admin:
        assert admin.client_kill_filter(skipme=True, _type="normal") >= 1


async def test_concurrent_calls_get_their_own_replies_on_one_connection(
    client: LeanRedis, redis_url: str
) -> None:
    replies = await asyncio.gather(*(client.execute_command("INCR", "n") for _ in range(1000)))
    assert sorted(replies) == list(range(1, 1001))
    values = await asyncio.gather(
        *(client.execute_command("SET", f"k{n}", n) for n in range(200)),
        *(client.execute_command("GET", f"k{n}") for n in range(200)),
    )
    assert values[200:] == [str(n).encode() for n in range(200)]
    with redis.Redis.from_url(redis_url) as admin:  # no pool to run dry: all on one
        assert len(admin.client_list(_type="normal")) == 1 + 1


async def test_errors_are_redis_py_exceptions_and_the_connection_goes_on(
    client: LeanRedis,
) -> None:
    await client.execute_command("SET", "s", "text")
    with pytest.raises(ResponseError, match="not an integer"):
        await client.execute_command("INCR", "s")
    assert await client.execute_command("GET", "s") == b"text"


async def test_a_cancelled_call_does_not_shift_the_replies(
    client: LeanRedis, redis_url: str
) -> None:
    slow = asyncio.ensure_future(client.execute_command("BLPOP", "never", "0.2"))
    await until_blocked_in(redis_url, "blpop")  # sent: its reply comes in 0.2 s
    slow.cancel()
    after = await asyncio.gather(*(client.execute_command("ECHO", n) for n in range(50)))
    assert after == [str(n).encode() for n in range(50)]
    assert slow.cancelled()


async def test_scripts_survive_a_script_flush(client: LeanRedis, redis_url: str) -> None:
    script = client.register_script("return {KEYS[1], tonumber(ARGV[1]) + 1, false}")
    assert await script(["a"], [41]) == [b"a", 42, None]  # RESP2, as the stores expect
    with redis.Redis.from_url(redis_url) as admin:
        admin.script_flush()
    assert await script(keys=["b"], args=[1]) == [b"b", 2, None]


async def test_a_lost_connection_fails_pending_calls_then_reconnects(
    client: LeanRedis, redis_url: str
) -> None:
    assert await client.execute_command("CLIENT", "SETNAME", "victim") == b"OK"
    pending = asyncio.ensure_future(client.execute_command("BLPOP", "never", 5))
    await until_blocked_in(redis_url, "blpop")
    kill_normal_clients(redis_url)
    with pytest.raises(RedisConnectionError):
        await pending
    assert await client.execute_command("PING") == b"PONG"
    assert await client.execute_command("CLIENT", "GETNAME") is None  # a new connection


async def test_an_idle_connection_closed_by_the_server_is_replaced(
    client: LeanRedis, redis_url: str
) -> None:
    assert await client.execute_command("PING") == b"PONG"
    pipe = client._pipe
    assert pipe is not None
    assert not pipe.is_closed
    kill_normal_clients(redis_url)
    await eventually(lambda: pipe.is_closed, what="the reader sees the end of the stream")
    assert await client.execute_command("PING") == b"PONG"


async def test_aclose_fails_calls_in_flight_and_later_calls_reconnect(
    client: LeanRedis, redis_url: str
) -> None:
    pending = asyncio.ensure_future(client.execute_command("BLPOP", "never", 5))
    await until_blocked_in(redis_url, "blpop")
    await client.aclose()
    with pytest.raises(RedisConnectionError):
        await pending
    assert await client.execute_command("PING") == b"PONG"


async def test_connection_failures_are_redis_py_connection_errors(tmp_path: object) -> None:
    client = LeanRedis(f"unix://{tmp_path}/nothing-here.sock")
    with pytest.raises(RedisConnectionError):
        await client.execute_command("PING")


async def test_the_url_selects_the_database(redis_url: str) -> None:
    client = LeanRedis(redis_url + "?db=3")
    try:
        await client.execute_command("SET", "where", "db3")
    finally:
        await client.aclose()
    with redis.Redis.from_url(redis_url, db=3) as other:
        assert other.get("where") == b"db3"


def test_it_runs_on_uvloop_as_the_gateway_serves(redis_url: str) -> None:
    uvloop = pytest.importorskip("uvloop")

    async def round_trips() -> list[object]:
        client = LeanRedis(redis_url)
        try:
            script = client.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
            return await asyncio.gather(script(["u"], [2]), client.execute_command("PING"))
        finally:
            await client.aclose()

    assert uvloop.run(round_trips()) == [2, b"PONG"]


async def test_a_stalled_server_fails_calls_at_the_timeout_and_later_replies_stay_aligned(
    redis_server: RedisServer, redis_url: str
) -> None:
    loop = asyncio.get_running_loop()
    client = LeanRedis(redis_url, timeout_s=0.2)
    try:
        assert await client.execute_command("PING") == b"PONG"
        with redis_server.paused():  # it answers nothing until the block ends
            started = loop.time()
            late = [client.execute_command("ECHO", f"late-{n}") for n in range(5)]
            results = await asyncio.wait_for(asyncio.gather(*late, return_exceptions=True), HANG_S)
            assert all(isinstance(r, RedisTimeoutError) for r in results), results
            assert loop.time() - started >= 0.2  # not before their deadline
        # The late calls' replies arrive now on the old connection: none may answer these.
        replies = await asyncio.gather(*(client.execute_command("ECHO", n) for n in range(20)))
        assert replies == [str(n).encode() for n in range(20)]
    finally:
        await client.aclose()


async def test_calls_still_writing_to_a_stalled_server_fail_at_the_timeout(
    redis_server: RedisServer, redis_url: str
) -> None:
    # Large commands fill the socket's buffer of a server that reads nothing: their writes
    # wait for room, and must give up with the call at its deadline, not when it wakes.
    loop = asyncio.get_running_loop()
    client = LeanRedis(redis_url, timeout_s=0.3)
    try:
        assert await client.execute_command("PING") == b"PONG"
        with redis_server.paused():  # it wakes only after the calls have ended
            started = loop.time()
            value = b"v" * (8 << 20)
            calls = [client.execute_command("SET", f"big-{n}", value) for n in range(4)]
            results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), HANG_S)
            assert all(isinstance(r, RedisTimeoutError | RedisConnectionError) for r in results)
            assert loop.time() - started >= 0.3
        assert await client.execute_command("PING") == b"PONG"  # a new connection
    finally:
        await client.aclose()


async def test_calls_that_keep_coming_on_a_healthy_server_never_time_out(redis_url: str) -> None:
    client = LeanRedis(redis_url, timeout_s=0.2)
    try:
        for _ in range(40):  # the watchdog moves on from answered calls, 2 deadlines and more
            replies = await asyncio.gather(
                *(client.execute_command("INCR", "n") for _ in range(50))
            )
            assert len(replies) == 50
            await asyncio.sleep(0.01)
        assert await client.execute_command("GET", "n") == b"2000"
    finally:
        await client.aclose()


@pytest.fixture
def silent_server() -> Iterator[socket.socket]:
    """A listening TCP socket whose kernel completes connections but nobody reads or answers
    (a frozen or overloaded redis-server looks like this)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    try:
        yield listener
    finally:
        listener.close()


def num_connections_made(listener: socket.socket) -> int:
    """The connections the kernel completed on ``listener`` so far (each accepted, then closed)."""
    listener.setblocking(False)
    count = 0
    while True:
        try:
            connection, _ = listener.accept()
        except BlockingIOError:
            return count
        connection.close()
        count += 1


async def test_connecting_is_bounded_and_one_attempt_serves_every_waiting_caller(
    silent_server: socket.socket,
) -> None:
    loop = asyncio.get_running_loop()
    url = f"redis://:secret@127.0.0.1:{silent_server.getsockname()[1]}"  # AUTH on connect
    client = LeanRedis(url, connect_timeout_s=0.2, timeout_s=0.2)
    try:
        started = loop.time()
        calls = [client.execute_command("PING") for _ in range(20)]
        results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), HANG_S)
        assert all(isinstance(r, RedisTimeoutError) for r in results), results
        assert loop.time() - started >= 0.2
        assert num_connections_made(silent_server) == 1  # one attempt, not one per caller
    finally:
        await client.aclose()


def test_timeouts_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeouts must be > 0"):
        LeanRedis("redis://localhost", timeout_s=0)
    with pytest.raises(ValueError, match="timeouts must be > 0"):
        LeanRedis("redis://localhost", connect_timeout_s=-1)


async def test_a_busy_event_loop_is_not_taken_for_a_stalled_redis(redis_url: str) -> None:
    # A burst of requests can hold the event loop past a call's deadline while its reply
    # already waits in the socket: that is not Redis stalling, and must not fail the call.
    lean = LeanRedis(redis_url, timeout_s=0.05)
    try:
        assert await lean.execute_command("PING") == b"PONG"  # connected
        calls = [asyncio.ensure_future(lean.execute_command("PING")) for _ in range(3)]
        await asyncio.sleep(0)  # written
        time.sleep(0.3)  # noqa: ASYNC251 (the loop is busy well past every deadline)
        assert await asyncio.gather(*calls) == [b"PONG"] * 3
    finally:
        await lean.aclose()

"""How long the gateway's Redis client waits on a Redis that cannot answer (README's bound).

The README promises a Redis outage never holds a request longer than
``redis_connect_timeout_s`` + ``redis_timeout_s``.

    python -m bench.redis_stall_timeouts                  # the defaults: 0.5 s and 0.5 s
    python -m bench.redis_stall_timeouts --timeout-s 0.2 --connect-timeout-s 0.2 --repeats 20

Three stalls, each ``--repeats`` times, on a real redis-server (`tests.support.redis_server`)
and the gateway's client (`gateway.storage.redis_client.LeanRedis`):

- ``stalled``: the server is paused (SIGSTOP) with a connection open; 5 small calls wait.
- ``writing``: the same with 4 calls of 8 MiB each, whose writes fill the socket's buffer.
- ``connecting``: a port whose kernel accepts connections but nobody answers (AUTH waits);
  20 calls wait on one connection attempt.

For each: the wall time from the calls' start until every one has failed (median, max), and
how late that is past the timeout the mechanism sets (``timeout_s``; ``connect_timeout_s``
when connecting). The unit tests (``tests/gateway/storage/test_redis_client.py``) check that
the calls fail by the timeout and never before it; this bench measures by how much later.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from bench.workloads import command_line
from gateway.defaults import DEFAULT_REDIS_CONNECT_TIMEOUT_S, DEFAULT_REDIS_TIMEOUT_S
from gateway.storage.redis_client import LeanRedis
from tests.support.redis_server import RedisServer, redis_server

Stall = Callable[[LeanRedis], Awaitable[float]]


async def _all_fail(calls: list[Awaitable[object]]) -> float:
    """Seconds until every call has failed with a time-out (or the connection closed by one)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)
    waited = loop.time() - started
    if not all(isinstance(r, RedisTimeoutError | RedisConnectionError) for r in results):
        raise RuntimeError(f"a call did not fail: {results}")
    return waited


async def stalled(server: RedisServer, client: LeanRedis, num_bytes: int, num_calls: int) -> float:
    await client.execute_command("PING")  # connected
    with server.paused():
        value = b"v" * num_bytes
        calls = [client.execute_command("SET", f"k{n}", value) for n in range(num_calls)]
        waited = await _all_fail(calls)
    await client.execute_command("PING")  # the next call connects again
    return waited


async def connecting(connect_timeout_s: float, timeout_s: float) -> float:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        url = f"redis://:secret@127.0.0.1:{listener.getsockname()[1]}"  # AUTH on connect
        client = LeanRedis(url, connect_timeout_s=connect_timeout_s, timeout_s=timeout_s)
        try:
            return await _all_fail([client.execute_command("PING") for _ in range(20)])
        finally:
            await client.aclose()


async def run(args: argparse.Namespace, server: RedisServer) -> dict[str, list[float]]:
    waits: dict[str, list[float]] = {"stalled": [], "writing": [], "connecting": []}
    client = LeanRedis(
        server.url, connect_timeout_s=args.connect_timeout_s, timeout_s=args.timeout_s
    )
    try:
        for _ in range(args.repeats):
            waits["stalled"].append(await stalled(server, client, 16, 5))
            waits["writing"].append(await stalled(server, client, 8 << 20, 4))
            waits["connecting"].append(await connecting(args.connect_timeout_s, args.timeout_s))
    finally:
        await client.aclose()
    return waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_REDIS_TIMEOUT_S)
    parser.add_argument("--connect-timeout-s", type=float, default=DEFAULT_REDIS_CONNECT_TIMEOUT_S)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tw-redis-") as tmp, redis_server(tmp) as server:
        waits = asyncio.run(run(args, server))

    bound = args.connect_timeout_s + args.timeout_s
    print(f"command: {command_line()}")
    print(
        f"redis_timeout_s {args.timeout_s} s, redis_connect_timeout_s {args.connect_timeout_s} s,"
        f" {args.repeats} repeats; target: every wait <= {bound:.2f} s"
    )
    is_met = True
    for name, waited in waits.items():
        timeout = args.connect_timeout_s if name == "connecting" else args.timeout_s
        worst = max(waited)
        is_met = is_met and worst <= bound
        print(
            f"  {name:10}: waited median {statistics.median(waited):.3f} s, max {worst:.3f} s; "
            f"late past the timeout: median {(statistics.median(waited) - timeout) * 1000:.0f} ms,"
            f" max {(worst - timeout) * 1000:.0f} ms ({'met' if worst <= bound else 'MISSED'})"
        )
    sys.exit(0 if is_met else 1)


if __name__ == "__main__":
    main()

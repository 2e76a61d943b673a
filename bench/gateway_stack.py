"""The processes a gateway benchmark runs against, each its own process on this machine:
engines (one per model, each on TCP for direct calls and on a unix socket for the gateway:
`tests.support.stand_in_engine`, or a real engine on a checkpoint), a real redis-server, the gateway
(uvicorn, one worker, uvloop + httptools; budgets and rate limits in Redis, keys in SQLite)
and, served the same way, the floor proxy (`bench.floor_proxy`). Plus the /proc readings
that charge CPU to them.
"""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.child_process import child_process, wait_http
from tests.support.gateway_process import gateway_server
from tests.support.redis_server import redis_server

QUOTA = {"budget_tokens": 10**15, "budget_period": "month", "rpm": 10**9, "tpm": 10**15}


@dataclass(frozen=True)
class EngineSpec:
    """One stand-in engine: the model the gateway serves from it, and its pacing (0: instant)."""

    model: str
    num_chunks: int
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    checkpoint: str | None = None  # a real engine (CPU) on this checkpoint, not a stand-in


@dataclass(frozen=True)
class Stack:
    engine_urls: dict[str, str]  # model -> its engine's TCP base URL, for direct calls
    gateway_url: str
    gateway_pid: int
    redis_pid: int
    floor_url: str  # bench.floor_proxy: the least a Python proxy on this stack does
    floor_pid: int
    api_key: str  # a key of a tenant whose quota allows every model, without real limits
    engine_pids: dict[str, int]  # model -> its engine's pid
    database_url: str  # the gateway's (SQLite), to add tenants and keys


@contextmanager
def gateway_stack(
    engines: list[EngineSpec],
    profile: str | None = None,
    gateway_settings: dict[str, Any] | None = None,
    context_window: int = 8192,
) -> Iterator[Stack]:
    """Start the engines, redis-server and the gateway (one model per engine); stop them on
    exit. ``profile``: write the gateway process's cProfile stats there;
    ``gateway_settings``: settings of the gateway's to set or replace (``routing``, or
    ``redis_url: None`` for budgets and rate limits in process); ``context_window``: every
    model's, as the gateway is told."""
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="tw-ovh-"))  # short: <108
        engine_urls, engine_pids, models, uds_paths = {}, [], {}, {}
        for i, spec in enumerate(engines):
            uds_path = f"{tmp}/engine{i}.sock"
            tcp, uds = tcp_socket(), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            uds.bind(uds_path)
            pid = stack.enter_context(child_process(_serve_engine, [tcp, uds], spec))
            engine_pids.append(pid)
            engine_urls[spec.model] = f"http://127.0.0.1:{tcp.getsockname()[1]}"
            uds_paths[spec.model] = uds_path
            models[spec.model] = {
                "upstreams": [f"unix:{uds_path}"],
                "context_window": context_window,
                "checkpoint": spec.checkpoint,
                "prices": {"input": 100_000, "output": 400_000},
            }
        redis = stack.enter_context(redis_server(tmp))
        redis_url, redis_pid = redis.url, redis.pid
        db_url = f"sqlite:///{tmp}/tollway.db"
        api_key = make_tenant_key(db_url)
        settings = {"data_dir": tmp, "database_url": db_url, "redis_url": redis_url}
        settings.update(gateway_settings or {})
        gateway_sock = tcp_socket()
        gateway_pid = stack.enter_context(
            child_process(serve_gateway, {**settings, "models": models}, gateway_sock, profile)
        )
        gateway_url = f"http://127.0.0.1:{gateway_sock.getsockname()[1]}"
        floor_sock = tcp_socket()
        floor_pid = stack.enter_context(
            child_process(_serve_floor_proxy, uds_paths, redis_url, floor_sock)
        )
        floor_url = f"http://127.0.0.1:{floor_sock.getsockname()[1]}"
        for url, pid in zip(engine_urls.values(), engine_pids, strict=True):
            wait_http(f"{url}/health", pid, timeout_s=600)  # a real engine loads its model
        wait_http(f"{gateway_url}/health", gateway_pid)
        wait_http(f"{floor_url}/health", floor_pid)
        pids = dict(zip(engine_urls, engine_pids, strict=True))
        yield Stack(
            engine_urls,
            gateway_url,
            gateway_pid,
            redis_pid,
            floor_url,
            floor_pid,
            api_key,
            pids,
            db_url,
        )


# --- CPU ---------------------------------------------------------------------------------------


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


# --- processes ---------------------------------------------------------------------------------


def _serve_engine(sockets: list[socket.socket], spec: EngineSpec) -> None:
    from bench.memory_probe import install_from_environment

    install_from_environment("engine")
    if spec.checkpoint is None:
        from tests.support.stand_in_engine import serve

        serve(sockets, spec.num_chunks, spec.ttft_ms, spec.itl_ms)
        return
    import gc

    import uvicorn

    from backend_engine.async_engine import AsyncEngine
    from backend_engine.config import EngineConfig
    from backend_engine.server.app import build_app, uvicorn_config

    engine = AsyncEngine(EngineConfig(model=spec.checkpoint, device="cpu"), spec.model)
    config = uvicorn_config(build_app(engine), log_level="warning")
    config.access_log = False
    gc.collect()  # as `tollway engine` does
    gc.freeze()
    uvicorn.Server(config).run(sockets=sockets)


def serve_gateway(
    settings_data: dict[str, Any],
    sock: socket.socket,
    profile: str | None,
    hosts_file: str | None = None,
) -> None:
    """The gateway on ``sock`` (`tests.support.gateway_process`), with the memory probe the
    environment asks for; ``profile``: write its cProfile stats there."""
    import cProfile

    from bench.memory_probe import install_from_environment

    server = gateway_server(settings_data, hosts_file)
    install_from_environment("gateway")
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


def _serve_floor_proxy(upstreams: dict[str, str], redis_url: str, sock: socket.socket) -> None:
    from bench.floor_proxy import FloorProxy
    from gateway.launcher.serve import tune_gc_for_serving
    from tests.support.stand_in_engine import bench_server

    app = FloorProxy(upstreams, redis_url)
    tune_gc_for_serving()
    bench_server(app).run(sockets=[sock])


def tcp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def make_tenant_key(db_url: str) -> str:
    """Migrate the database; create a tenant with a generous quota (no ``allowed_models``:
    every model) and one key for it."""
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

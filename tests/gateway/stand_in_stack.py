"""A torch-free request path for gateway tests: the benchmarks' stand-in engine
(`bench.stand_in_engine`) on a unix socket, and real gateways in front of it on 127.0.0.1,
each served by uvicorn on a thread of the test process.

    with stand_in_engine(num_chunks=4) as socket_path, gateway(settings) as base_url:
        httpx.post(f"{base_url}/v1/chat/completions", ...)
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn

from bench.stand_in_engine import MODEL, StandInEngine
from gateway.app import build_gateway
from gateway.settings import GatewaySettings
from gateway.storage.api_keys import create_key
from gateway.storage.database import Database
from gateway.storage.tenants import create_tenant
from tests.uvicorn_thread import start_in_thread, stop_thread

CONTEXT_WINDOW = 4096


def _serve(app: Any, sock: socket.socket) -> tuple[uvicorn.Server, Any]:
    config = uvicorn.Config(app, loop="asyncio", http="h11", lifespan="on", log_level="warning")
    server = uvicorn.Server(config)
    return server, start_in_thread(server, [sock])


@contextmanager
def stand_in_engine(
    num_chunks: int = 4, ttft_ms: float = 0.0, itl_ms: float = 0.0
) -> Iterator[str]:
    """The unix socket path of a stand-in engine answering ``num_chunks`` completion tokens."""
    tmp = tempfile.mkdtemp(prefix="tw-stand-in-")  # short: socket paths stay under 108 bytes
    path = f"{tmp}/engine.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    running = _serve(StandInEngine(num_chunks=num_chunks, ttft_ms=ttft_ms, itl_ms=itl_ms), sock)
    try:
        yield path
    finally:
        stop_thread(*running)
        shutil.rmtree(tmp, ignore_errors=True)


def stand_in_settings(
    engine_socket: str, data_dir: Path, database_url: str, **overrides: Any
) -> GatewaySettings:
    """One model, the stand-in's (``MODEL``), priced 1 micro per input token, 2 per output."""
    data: dict[str, Any] = {
        "data_dir": str(data_dir),
        "database_url": database_url,
        "models": {
            MODEL: {
                "upstreams": [f"unix:{engine_socket}"],
                "context_window": CONTEXT_WINDOW,
                "prices": {"input": 1_000_000, "cached_input": 500_000, "output": 2_000_000},
            }
        },
        **overrides,
    }
    return GatewaySettings.from_dict(data)


@contextmanager
def gateway(settings: GatewaySettings, **kwargs: Any) -> Iterator[str]:
    """The base URL of `build_gateway(settings, **kwargs)`, serving until the block ends."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    running = _serve(build_gateway(settings, **kwargs), sock)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop_thread(*running)


def tenant_key(database_url: str, **quota: Any) -> tuple[str, str]:
    """A new tenant with ``quota`` and one API key for it: ``(tenant_id, key)``."""
    tenant_id = f"t-{uuid.uuid4().hex[:8]}"
    database = Database(database_url)
    try:
        with database.transaction() as session:
            create_tenant(session, tenant_id, name=tenant_id, tier="standard", quota=quota)
            created = create_key(session, tenant_id)
    finally:
        database.dispose()
    return tenant_id, created.key

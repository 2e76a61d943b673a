"""A torch-free request path for gateway tests: the benchmarks' stand-in engine
(`tests.support.stand_in_engine`) on a unix socket, and real gateways in front of it on 127.0.0.1,
each served by uvicorn on a thread of the test process.

    with stand_in_engine(num_chunks=4) as engine, gateway(settings) as base_url:
        httpx.post(f"{base_url}/v1/chat/completions", ...)
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import uvicorn
from starlette.types import Message, Receive, Scope, Send

from gateway.app import build_gateway
from gateway.settings import GatewaySettings
from gateway.storage.api_keys import create_key
from gateway.storage.database import Database
from gateway.storage.tenants import create_tenant
from tests.support.stand_in_engine import MODEL, StandInEngine
from tests.support.uvicorn_thread import start_in_thread, stop_thread

CONTEXT_WINDOW = 4096


def _serve(app: Any, sock: socket.socket) -> tuple[uvicorn.Server, threading.Thread]:
    config = uvicorn.Config(app, loop="asyncio", http="h11", lifespan="on", log_level="warning")
    server = uvicorn.Server(config)
    return server, start_in_thread(server, [sock])


class TappedEngine:
    """The stand-in engine behind a tap: it records each POST that reaches it (path, JSON
    body), and can hold every answer until ``release()`` or answer ``fail_with`` instead.

    The tap is what a test checks the gateway's decisions against: what was forwarded, with
    which ``max_tokens``, and that a refused request never reached the engine."""

    def __init__(self, engine: StandInEngine, socket_path: str) -> None:
        self.socket_path = socket_path
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.fail_with: int | None = None  # an HTTP status to answer with instead
        self.num_held = 0  # answers waiting at the gate now
        self._engine = engine
        self._gate = threading.Event()
        self._gate.set()

    @property
    def upstream(self) -> str:
        return f"unix:{self.socket_path}"

    def hold(self) -> None:
        """Answers wait from now on (their requests are recorded first)."""
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self._engine(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.requests.append((scope["path"], json.loads(body)))
        if not self._gate.is_set():
            self.num_held += 1
            await asyncio.get_running_loop().run_in_executor(None, self._gate.wait)
            self.num_held -= 1
        if self.fail_with is not None:
            error = {"error": {"message": "the stand-in fails", "type": "server_error"}}
            await send(
                {
                    "type": "http.response.start",
                    "status": self.fail_with,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": json.dumps(error).encode()})
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self._engine(scope, replay, send)


@contextmanager
def stand_in_engine(
    num_chunks: int = 4, ttft_ms: float = 0.0, itl_ms: float = 0.0
) -> Iterator[TappedEngine]:
    """A stand-in engine answering ``num_chunks`` completion tokens, on a unix socket."""
    tmp = tempfile.mkdtemp(prefix="tw-stand-in-")  # short: socket paths stay under 108 bytes
    path = f"{tmp}/engine.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    engine = TappedEngine(StandInEngine(num_chunks, ttft_ms, itl_ms), path)
    running = _serve(engine, sock)
    try:
        yield engine
    finally:
        engine.release()
        stop_thread(*running)
        shutil.rmtree(tmp, ignore_errors=True)


def stand_in_settings(
    engine: TappedEngine, data_dir: Path, database_url: str, **overrides: Any
) -> GatewaySettings:
    """One model, the stand-in's (``MODEL``), priced 1 micro per input token, 2 per output."""
    data: dict[str, Any] = {
        "data_dir": str(data_dir),
        "database_url": database_url,
        "models": {
            MODEL: {
                "upstreams": [engine.upstream],
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


def tenant_key(database_url: str, tenant_id: str | None = None, **quota: Any) -> tuple[str, str]:
    """A new tenant with ``quota`` and one API key for it: ``(tenant_id, key)``."""
    tenant_id = tenant_id or f"t-{uuid.uuid4().hex[:8]}"
    database = Database(database_url)
    try:
        with database.transaction() as session:
            create_tenant(session, tenant_id, name=tenant_id, tier="standard", quota=quota)
            created = create_key(session, tenant_id)
    finally:
        database.dispose()
    return tenant_id, created.key

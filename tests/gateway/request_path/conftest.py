"""Request-path fixtures: real tiny engines on Unix sockets, real gateways on 127.0.0.1.

- ``engines``: two in-process engines (``tiny`` and ``tiny-large``, the same tiny
  checkpoint under two names) served by uvicorn on Unix sockets, once per session. Where the
  engine is not installed (a gateway-only install, no torch) they are the same engines with
  a stand-in for the model (``demo_engine_model``): everything but the forward pass is the
  engine's own code, so every test here runs in both environments.
- ``gateway``: ``gateway(settings) -> base_url`` runs `build_gateway` under uvicorn in a
  thread (lifespan included) and stops it after the test; every chat and completion answer
  it sends is checked against the openai SDK's response types and OpenAI's required fields
  (`tests.support.schema_checked_app`), failing the test at teardown if one does not pass.
- ``db_url``: a migrated SQLite database per test (tenants and keys:
  ``tests.support.stand_in_stack.tenant_key``).
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from starlette.types import ASGIApp

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.server.app import build_app
from gateway.app import build_gateway
from gateway.settings import GatewaySettings
from gateway.storage.api_keys import hash_key
from tests.support.schema_checked_app import SchemaCheckedApp
from tests.support.stand_in_runner import DemoEngineModel
from tests.support.uvicorn_thread import start_in_thread, stop_thread

SMALL, LARGE = "tiny", "tiny-large"
CONTEXT_WINDOW = 2048
METRICS_TOKEN = "metrics-" + "s" * 40
METRICS_AUTH = {"authorization": f"Bearer {METRICS_TOKEN}"}  # GET /metrics needs a token


@dataclass(frozen=True)
class Engines:
    sockets: dict[str, str]
    checkpoint: Path


def _serve(
    app: ASGIApp, *, uds: str | None = None, sock: socket.socket | None = None
) -> tuple[uvicorn.Server, threading.Thread]:
    config = uvicorn.Config(
        app, uds=uds, loop="asyncio", http="h11", lifespan="on", log_level="warning"
    )
    server = uvicorn.Server(config)
    return server, start_in_thread(server, [sock] if sock is not None else None)


@pytest.fixture(scope="session")
def engines(demo_engine_model: Callable[..., DemoEngineModel]) -> Iterator[Engines]:
    model = demo_engine_model(architecture="LlamaForCausalLM", size="tiny")
    tmp = tempfile.mkdtemp(prefix="tw-eng-")  # short: a socket path must stay under 108 bytes
    running = []
    sockets: dict[str, str] = {}
    try:
        for name in (SMALL, LARGE):
            config = EngineConfig(
                model=str(model.checkpoint),
                max_model_len=CONTEXT_WINDOW,
                num_kv_blocks=512,
                max_num_seqs=64,
                show_progress=False,
            )
            path = f"{tmp}/{name}.sock"
            app = build_app(AsyncEngine(config, model_name=name, plan_runner=model.plan_runner))
            running.append(_serve(app, uds=path))
            sockets[name] = path
        yield Engines(sockets, model.checkpoint)
    finally:
        for server, thread in running:
            stop_thread(server, thread)
        shutil.rmtree(tmp, ignore_errors=True)


def settings_for(
    engines: Engines, data_dir: Path, db_url: str, **overrides: Any
) -> GatewaySettings:
    models = {
        name: {
            "upstreams": [f"unix:{path}"],
            "context_window": CONTEXT_WINDOW,
            "checkpoint": str(engines.checkpoint),
            "prices": {"input": 1_000_000, "cached_input": 500_000, "output": 2_000_000},
        }
        for name, path in engines.sockets.items()
    }
    data: dict[str, Any] = {
        "data_dir": str(data_dir),
        "database_url": db_url,
        "models": models,
        "routing": {"aliases": {"auto": {"small": SMALL, "large": LARGE}}},
        "metrics_token_hash": hash_key(METRICS_TOKEN),
        **overrides,
    }
    return GatewaySettings.from_dict(data)


@pytest.fixture
def db_url(sqlite_db_url: str) -> str:
    return sqlite_db_url


@pytest.fixture
def gateway() -> Iterator[Callable[..., str]]:
    """Every chat and completion answer these gateways send (whole or streamed) is checked
    against the openai SDK's types and OpenAI's required fields: a test whose answers do not
    pass fails at teardown, naming them."""
    running: list[tuple[uvicorn.Server, threading.Thread]] = []
    checked: list[SchemaCheckedApp] = []

    def start(settings: GatewaySettings, **kwargs: Any) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        checked.append(SchemaCheckedApp(build_gateway(settings, **kwargs)))
        running.append(_serve(checked[-1], sock=sock))
        return f"http://127.0.0.1:{port}"

    yield start
    for server, thread in running:
        stop_thread(server, thread)
    failures = [failure for app in checked for failure in app.failures]
    assert not failures, "answers OpenAI's clients cannot read:\n" + "\n".join(failures)

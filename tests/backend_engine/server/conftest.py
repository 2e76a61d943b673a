"""The engine's HTTP server on the shipped SmolLM2 GGUF, once per module that asks for it."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.server.app import build_app, uvicorn_config
from tests.support.uvicorn_thread import start_in_thread, stop_thread

SMOLLM2_NAME = "smollm2"


@pytest.fixture(scope="module")
def smollm2_url(smollm2_gguf: Path) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of an engine server on SmolLM2 (model name ``smollm2``)."""
    config = EngineConfig(model=str(smollm2_gguf), num_kv_blocks=512, show_progress=False)
    engine = AsyncEngine(config, model_name=SMOLLM2_NAME)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn_config(build_app(engine), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = start_in_thread(server, [sock])
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_thread(server, thread)
        sock.close()

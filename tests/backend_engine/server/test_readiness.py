"""The engine server's readiness and drain, in process over real HTTP: it answers while the
model loads (``/health`` yes, ``/ready`` and generation no), and a drain lets the requests in
flight finish, refuses new ones, and stops the server after the last one or at its grace."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.server.app import build_app, serve, uvicorn_config
from backend_engine.server.engine_host import EngineHost
from tests.backend_engine.server.response_schema import check_answer, checked_client
from tests.support.polling import wait_until
from tests.support.stand_in_runner import DemoEngineModel
from tests.support.uvicorn_thread import start_in_thread, stop_thread

MODEL_NAME = "tiny-demo"
CHAT = "/v1/chat/completions"


@dataclass
class Served:
    base_url: str
    host: EngineHost
    stopped: threading.Event  # the host asked the server to stop

    def client(self) -> httpx.Client:
        return checked_client(self.base_url, timeout=60.0)


ServeApp = Callable[..., Served]


@pytest.fixture
def serve_app(demo_engine_model: Callable[..., DemoEngineModel]) -> Iterator[ServeApp]:
    """``serve_app(drain_grace_s=30, loader=None)``: a server on a free port, for its engine
    as built (or as ``loader(config, plan_runner)`` builds it, in the background)."""
    model = demo_engine_model(size="tiny")
    running: list[tuple[uvicorn.Server, threading.Thread, socket.socket]] = []

    def start(
        drain_grace_s: float = 30.0,
        loader: Callable[[EngineConfig, Any], Awaitable[AsyncEngine]] | None = None,
    ) -> Served:
        config = EngineConfig(
            model=str(model.checkpoint),
            max_model_len=2048,
            num_kv_blocks=256,
            show_progress=False,
            drain_grace_s=drain_grace_s,
        )
        stopped = threading.Event()
        host = EngineHost(drain_grace_s, stop_server=stopped.set)
        if loader is None:
            engine = AsyncEngine(config, MODEL_NAME, model.plan_runner)
            app = build_app(engine, host=host)
        else:

            async def load() -> AsyncEngine:
                return await loader(config, model.plan_runner)

            app = build_app(load, host=host)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn_config(app, log_level="warning"))
        running.append((server, start_in_thread(server, [sock]), sock))
        return Served(f"http://127.0.0.1:{sock.getsockname()[1]}", host, stopped)

    yield start
    for server, thread, sock in running:
        stop_thread(server, thread)
        sock.close()


def _chat(max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Count."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def _error_code(response: httpx.Response) -> tuple[int, str, str]:
    error = response.json()["error"]
    return response.status_code, error["type"], error["code"]


class StreamReader:
    """A streamed chat request read on its own thread: its events, as they come."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        self.events: list[Any] = []
        self.has_token = threading.Event()
        self.status_code = 0
        self._thread = threading.Thread(target=self._read, args=(base_url, max_tokens))
        self._thread.start()

    def _read(self, base_url: str, max_tokens: int) -> None:
        with (
            httpx.Client(base_url=base_url, timeout=120.0) as client,
            client.stream("POST", CHAT, json=_chat(max_tokens, stream=True)) as response,
        ):
            self.status_code = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data = line.removeprefix("data: ")
                    self.events.append(data if data == "[DONE]" else json.loads(data))
                    if data != "[DONE]":
                        check_answer(self.events[-1], is_chunk=True)
                    if any(c.get("delta", {}).get("content") for c in _choices(self.events[-1])):
                        self.has_token.set()
        self.has_token.set()

    def join(self) -> list[Any]:
        self._thread.join(timeout=120)
        assert not self._thread.is_alive()
        return self.events


def _choices(event: Any) -> list[dict[str, Any]]:
    return event.get("choices", []) if isinstance(event, dict) else []


def test_it_answers_while_the_model_loads_and_is_ready_after(serve_app: ServeApp) -> None:
    gate = threading.Event()

    async def load(config: EngineConfig, plan_runner: Any) -> AsyncEngine:
        await asyncio.to_thread(gate.wait, 120)
        return await AsyncEngine.load(config, MODEL_NAME, plan_runner)

    served = serve_app(loader=load)
    try:
        with served.client() as client:
            assert client.get("/health").json() == {"status": "ok"}
            ready = client.get("/ready")
            assert (ready.status_code, ready.json()) == (503, {"status": "loading"})
            for path, body in ((CHAT, _chat(4, False)), ("/v1/completions", {"prompt": "Hi"})):
                refused = client.post(path, json={"model": MODEL_NAME, **body})
                assert _error_code(refused) == (503, "server_error", "engine_not_ready")
            assert _error_code(client.get("/kv_events")) == (
                503,
                "server_error",
                "engine_not_ready",
            )
            assert _error_code(client.get("/v1/models"))[2] == "engine_not_ready"
            metrics = client.get("/metrics")
            assert metrics.status_code == 200
            assert "tollway_engine_kv_blocks_total" not in metrics.text

            gate.set()
            wait_until(lambda: client.get("/ready").status_code == 200, 120, "ready")
            assert client.get("/ready").json() == {"status": "ready"}
            answer = client.post(CHAT, json=_chat(4, False))
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 4
            assert "tollway_engine_kv_blocks_total 256.0" in client.get("/metrics").text
    finally:
        gate.set()
    assert not served.stopped.is_set()


def test_a_failed_load_stops_the_server_with_its_error(serve_app: ServeApp) -> None:
    async def load(config: EngineConfig, plan_runner: Any) -> AsyncEngine:
        raise ValueError("kv_cache_memory_bytes=1 is too small")

    served = serve_app(loader=load)
    assert served.stopped.wait(60)
    assert isinstance(served.host.load_error, ValueError)
    with served.client() as client:
        assert client.get("/ready").json() == {"status": "loading"}


def test_serve_raises_what_building_the_engine_raised(
    tmp_path: Path, demo_engine_model: Callable[..., DemoEngineModel]
) -> None:
    # The engine command prints these errors in one line and exits 1 (`backend_engine.cli`).
    model = demo_engine_model(size="tiny")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(FileNotFoundError, match=r"config\.json"):  # refused before serving
        serve(EngineConfig(model=str(tmp_path)), port=port, plan_runner=model.plan_runner)
    too_small = EngineConfig(model=str(model.checkpoint), kv_cache_memory_bytes=1)
    with pytest.raises(ValueError, match="too small for one KV block"):  # while serving
        serve(too_small, port=port, plan_runner=model.plan_runner)


def test_a_drain_finishes_the_requests_in_flight_and_refuses_new_ones(
    serve_app: ServeApp,
) -> None:
    served = serve_app(drain_grace_s=60)
    stream = StreamReader(served.base_url, max_tokens=600)
    assert stream.has_token.wait(60)
    assert served.host.request_drain()
    with served.client() as client:
        wait_until(lambda: client.get("/ready").status_code == 503, 10, "draining")
        assert client.get("/ready").json() == {"status": "draining"}
        assert client.get("/health").json() == {"status": "ok"}
        for stream_it in (False, True):
            refused = client.post(CHAT, json=_chat(4, stream_it))
            assert _error_code(refused) == (503, "server_error", "engine_draining")
        assert not served.stopped.is_set()  # the stream is still running
    events = stream.join()
    assert stream.status_code == 200
    assert events[-1] == "[DONE]"
    finishes = [c["finish_reason"] for e in events for c in _choices(e) if c.get("finish_reason")]
    assert finishes == ["length"]
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    assert served.stopped.wait(30)


def test_requests_still_running_at_the_grace_end_are_aborted(serve_app: ServeApp) -> None:
    served = serve_app(drain_grace_s=0.3)
    stream = StreamReader(served.base_url, max_tokens=1900)
    assert stream.has_token.wait(60)
    answers: list[httpx.Response] = []
    with served.client() as client:
        collector = threading.Thread(
            target=lambda: answers.append(client.post(CHAT, json=_chat(1900, False)))
        )
        collector.start()
        wait_until(lambda: served.host.num_in_flight == 2, 60, "both requests admitted")
        served.host.request_drain()
        collector.join(timeout=60)
    events = stream.join()
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "engine_draining"
    (answer,) = answers
    assert _error_code(answer) == (503, "server_error", "engine_draining")
    assert served.stopped.wait(30)
    assert served.host.num_in_flight == 0

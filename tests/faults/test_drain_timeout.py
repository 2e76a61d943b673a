"""A gateway told to stop (SIGTERM), against real processes: ``tollway serve`` in front of an
engine process, budgets in Redis, records in PostgreSQL.

- It keeps listening for ``drain_delay_s`` (5 s by default) while ``/ready`` says 503: a
  request sent just after SIGTERM is served.
- At the end of ``drain_grace_s`` it ends what is still in flight itself, instead of
  uvicorn's plain-text 500: a non-streamed request gets OpenAI's 503
  ``server_shutting_down`` with ``Retry-After`` and its request id, a stream an error event
  and ``[DONE]``; each is recorded with what its engine produced (the engine's usage once it
  stopped the request; what was relayed), the ledger charges exactly the records, and no
  reservation is left to its TTL.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml

from backend_engine.async_engine import AsyncEngine
from backend_engine.config import EngineConfig
from backend_engine.server.app import build_app
from gateway.settings import GatewaySettings
from gateway.storage.api_keys import hash_key
from gateway.storage.database import Database
from gateway.storage.models import UsageStatus
from gateway.storage.usage_store import UsageEntry, list_usage
from tests.faults.conftest import PostgresProcess
from tests.faults.processes import CLIENT_TIMEOUT, Tollway, short_dir
from tests.support.polling import wait_until
from tests.support.redis_server import RedisServer
from tests.support.stand_in_runner import plan_stand_in_runner
from tests.support.uvicorn_thread import start_in_thread, stop_thread

pytestmark = pytest.mark.timeout(240)

MODEL = "chat"
LONG = 1000  # tokens asked for, every one generated: 20 s at STEP_S, far past the grace
STEP_S = 0.02
BUDGET = 100_000
PROMPT = [{"role": "user", "content": "Write a long story"}]


@dataclass(frozen=True)
class Engine:
    url: str
    checkpoint: Path


@pytest.fixture(scope="module")
def engine(demo_model_files: Callable[..., Path]) -> Iterator[Engine]:
    """The engine's own server and scheduler (its ``/abort_request``, its usage) on TCP,
    with the stand-in runner paced at ``STEP_S`` a token, so that answers last seconds."""
    checkpoint = demo_model_files(size="tiny")
    config = EngineConfig(
        model=str(checkpoint), max_model_len=2048, num_kv_blocks=512, show_progress=False
    )
    app = build_app(
        AsyncEngine(config, model_name=MODEL, plan_runner=plan_stand_in_runner(step_s=STEP_S))
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(app, loop="asyncio", http="h11", lifespan="on", log_level="warning")
    )
    thread = start_in_thread(server, [sock])
    try:
        yield Engine(f"http://127.0.0.1:{sock.getsockname()[1]}", checkpoint)
    finally:
        stop_thread(server, thread)


@pytest.fixture
def start_gateway(
    engine: Engine, redis_process: RedisServer, postgres_process: PostgresProcess
) -> Iterator[Callable[..., Tollway]]:
    """``start_gateway(**settings) -> Tollway``: ``tollway serve`` on this module's engine,
    Redis and PostgreSQL; killed at the end if it still runs."""
    started: list[tuple[Tollway, Path]] = []

    def start(**settings: Any) -> Tollway:
        config = {
            **shared_settings(engine, redis_process, postgres_process),
            "admin_key_hash": hash_key("tw-admin-drain-test"),  # no first-run keys
            **settings,
        }
        root = short_dir("tw-drain-")
        started.append((Tollway.launch(root, yaml.safe_dump(config)), root))
        return started[-1][0]

    yield start
    for tollway, root in started:
        if tollway.process is not None and tollway.process.poll() is None:
            tollway.kill()
        shutil.rmtree(root, ignore_errors=True)


def shared_settings(
    engine: Engine, redis_process: RedisServer, postgres_process: PostgresProcess
) -> dict[str, Any]:
    return {
        "database_url": postgres_process.url,
        "redis_url": redis_process.url,
        "models": {
            MODEL: {
                "upstreams": [engine.url],
                "checkpoint": str(engine.checkpoint),
                "context_window": 2048,
            }
        },
    }


def chat(max_tokens: int, *, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


class StreamReader:
    """A streamed chat read on a thread: its events as parsed JSON (``[DONE]`` as is), the
    chunks with content relayed (the tokens it is charged for), its request id."""

    def __init__(self, base: str, headers: dict[str, str], body: dict[str, Any]) -> None:
        self.events: list[Any] = []
        self.request_id = ""
        self.num_content_chunks = 0
        self.first_token = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(base, headers, body))
        self._thread.start()

    def _read(self, base: str, headers: dict[str, str], body: dict[str, Any]) -> None:
        try:
            with httpx.stream(
                "POST",
                f"{base}/v1/chat/completions",
                json=body,
                headers=headers,
                timeout=CLIENT_TIMEOUT,
            ) as response:
                self.request_id = response.headers["x-request-id"]
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    self.events.append(data if data == "[DONE]" else json.loads(data))
                    choices = self.events[-1].get("choices") if data != "[DONE]" else None
                    if choices and choices[0]["delta"].get("content"):
                        self.num_content_chunks += 1
                        self.first_token.set()
        finally:
            self.first_token.set()

    def join(self) -> None:
        self._thread.join(timeout=60)
        assert not self._thread.is_alive()


def records(database_url: str, tenant_id: str) -> dict[str, UsageEntry]:
    database = Database(database_url)
    try:
        with database.session() as session:
            page = list_usage(session, tenant_id=tenant_id, limit=1000)
    finally:
        database.dispose()
    return {entry.request_id: entry for entry in page.records}


def engine_running(engine: Engine) -> float:
    text = httpx.get(f"{engine.url}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("tollway_engine_requests_running "))
    return float(line.rpartition(" ")[2])


def test_requests_in_flight_at_the_deadline_get_a_503_or_an_error_event_and_are_billed(
    engine: Engine,
    redis_process: RedisServer,
    postgres_process: PostgresProcess,
    start_gateway: Callable[..., Tollway],
    make_tenant: Callable[..., tuple[str, str]],
    serve_gateway: Callable[[GatewaySettings], str],
    tmp_path: Path,
) -> None:
    database_url = postgres_process.url
    tenant_id, key = make_tenant(database_url, budget_tokens=BUDGET, budget_period="total")
    headers = {"authorization": f"Bearer {key}"}
    gateway = start_gateway(drain_delay_s=0, drain_grace_s=1)
    assert gateway.process is not None

    answer: list[httpx.Response] = []
    whole = threading.Thread(
        target=lambda: answer.append(
            httpx.post(
                f"{gateway.url}/v1/chat/completions",
                json=chat(LONG, stream=False),
                headers=headers,
                timeout=CLIENT_TIMEOUT,
            )
        )
    )
    whole.start()
    stream = StreamReader(gateway.url, headers, chat(LONG, stream=True))
    assert stream.first_token.wait(60)
    wait_until(lambda: engine_running(engine) == 2, 30, "both requests in the engine")
    gateway.process.send_signal(signal.SIGTERM)
    assert gateway.process.wait(timeout=60) == 0, gateway.output()[-4000:]
    whole.join(timeout=60)
    stream.join()

    # The non-streamed request: OpenAI's 503, to retry, with its request id.
    (response,) = answer
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["retry-after"] == "1"
    request_id = response.headers["x-request-id"]
    assert request_id.startswith("req_")
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("server_shutting_down", "server_error")

    # The stream: what came, then an error event and [DONE].
    assert stream.events[-1] == "[DONE]"
    assert stream.events[-2]["error"]["code"] == "server_shutting_down"
    assert 0 < stream.num_content_chunks < LONG

    # Both recorded with what their engines produced; the ledger charges exactly that.
    recorded = records(database_url, tenant_id)
    assert recorded.keys() == {request_id, stream.request_id}
    whole_record, stream_record = recorded[request_id], recorded[stream.request_id]
    assert whole_record.status is UsageStatus.CANCELLED
    assert whole_record.prompt_tokens > 0
    assert 0 < whole_record.completion_tokens < LONG  # the engine's usage when it stopped
    assert stream_record.status is UsageStatus.CANCELLED
    assert stream_record.completion_tokens == stream.num_content_chunks

    reader = serve_gateway(
        GatewaySettings.from_dict(
            {
                **shared_settings(engine, redis_process, postgres_process),
                "data_dir": str(tmp_path / "reader"),
            }
        )
    )
    budget = httpx.get(f"{reader}/v1/budget", headers=headers, timeout=CLIENT_TIMEOUT).json()
    assert budget["reserved"] == 0  # settled, not left to reservation_ttl_s
    assert budget["used"] == sum(r.prompt_tokens + r.completion_tokens for r in recorded.values())


def test_a_request_sent_just_after_sigterm_is_served_while_ready_says_503(
    start_gateway: Callable[..., Tollway],
    make_tenant: Callable[..., tuple[str, str]],
    postgres_process: PostgresProcess,
) -> None:
    _, key = make_tenant(postgres_process.url, budget_tokens=BUDGET, budget_period="total")
    gateway = start_gateway()  # drain_delay_s as it comes: the default
    assert gateway.process is not None
    # Serving (uvicorn handles SIGTERM from then on), as a load balancer saw it.
    assert httpx.get(f"{gateway.url}/ready", timeout=CLIENT_TIMEOUT).status_code == 200
    gateway.process.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json=chat(4, stream=False),
        headers={"authorization": f"Bearer {key}"},
        timeout=CLIENT_TIMEOUT,
    )
    assert response.status_code == 200, response.text
    ready = httpx.get(f"{gateway.url}/ready", timeout=CLIENT_TIMEOUT)
    assert (ready.status_code, ready.json()) == (503, {"status": "draining"})
    gateway.process.send_signal(signal.SIGTERM)  # a second one skips the rest of the delay
    assert gateway.process.wait(timeout=30) == 0, gateway.output()[-4000:]

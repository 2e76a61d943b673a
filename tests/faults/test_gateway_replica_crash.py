"""One of two gateway replicas (one Redis, one PostgreSQL) SIGKILLed with streams in flight:
budgets stay exact. Its reservations hold the tenant's budget until they expire
(``reservation_ttl_s``), then free it; nothing is overspent meanwhile or after, and the
ledger's ``used`` is what the usage records charge.

The replica to kill is a process of its own (`tests.support.gateway_process.serve_gateway`,
as ``tollway serve`` and the benchmarks run it); the survivor runs in this process. Both
front one engine process (the tiny demo checkpoint, counted exactly by the gateways), whose
long answers keep streams in flight when the replica dies.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import GatewaySettings
from gateway.storage.database import Database
from gateway.storage.usage_store import sum_tokens
from tests.faults.conftest import PostgresProcess
from tests.faults.processes import CLIENT_TIMEOUT, TcpEngine, free_port
from tests.support import gateway_process
from tests.support.child_process import child_process, is_gone, wait_http
from tests.support.polling import wait_until
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.timeout(180)

EPOCH, FAR_FUTURE = (
    datetime(1970, 1, 1, tzinfo=timezone.utc),
    datetime(9999, 1, 1, tzinfo=timezone.utc),
)
MODEL = "chat"
BUDGET = 2_000
RESERVATION_TTL_S = 3.0
MAX_TOKENS = 600  # per stream on the replica that dies: seconds of tokens
NUM_STREAMS = 3
PROMPT = [{"role": "user", "content": "Write a long story"}]


@pytest.fixture(scope="module")
def engine(
    demo_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TcpEngine]:
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    engine = TcpEngine(demo_checkpoint(size="tiny"), "127.0.0.1", free_port(), log, MODEL)
    try:
        yield engine.start()
    finally:
        engine.stop()


def chat(max_tokens: int, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # every token asked for comes: the streams last
        "stream": stream,
    }
    return body


def test_a_killed_replicas_reservations_expire_and_nothing_is_overspent(
    engine: TcpEngine,
    redis_process: RedisServer,
    postgres_process: PostgresProcess,
    make_tenant: Callable[..., tuple[str, str]],
    serve_gateway: Callable[[GatewaySettings], str],
    tmp_path: Path,
) -> None:
    database_url = postgres_process.url
    tenant_id, key = make_tenant(database_url, budget_tokens=BUDGET, budget_period="total")
    shared: dict[str, Any] = {
        "database_url": database_url,
        "redis_url": redis_process.url,
        "reservation_ttl_s": RESERVATION_TTL_S,
        "models": {
            MODEL: {
                "upstreams": [engine.url],
                "checkpoint": str(engine.checkpoint),
                "context_window": 2048,
            }
        },
    }
    survivor = serve_gateway(
        GatewaySettings.from_dict({**shared, "data_dir": str(tmp_path / "survivor")})
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    doomed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    headers = {"authorization": f"Bearer {key}"}

    def budget() -> dict[str, int]:
        response = httpx.get(f"{survivor}/v1/budget", headers=headers, timeout=CLIENT_TIMEOUT)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def post(base: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(
            f"{base}/v1/chat/completions", json=body, headers=headers, timeout=CLIENT_TIMEOUT
        )

    settings = {**shared, "data_dir": str(tmp_path / "doomed")}
    with child_process(gateway_process.serve_gateway, settings, sock) as pid:
        sock.close()
        wait_http(doomed + "/health", pid)
        # Streams in flight on the replica that dies, each holding prompt + MAX_TOKENS.
        streaming = threading.Barrier(NUM_STREAMS + 1)
        broken: list[BaseException] = []

        def stream() -> None:
            try:
                with httpx.stream(
                    "POST",
                    f"{doomed}/v1/chat/completions",
                    json=chat(MAX_TOKENS, stream=True),
                    headers=headers,
                    timeout=CLIENT_TIMEOUT,
                ) as response:
                    assert response.status_code == 200
                    lines = response.iter_lines()
                    next(line for line in lines if line.startswith("data: "))
                    streaming.wait(timeout=30)
                    for _ in lines:
                        pass
            except httpx.HTTPError as exc:  # the replica died under it
                broken.append(exc)

        threads = [threading.Thread(target=stream) for _ in range(NUM_STREAMS)]
        for thread in threads:
            thread.start()
        streaming.wait(timeout=30)
        held = budget()
        assert held["used"] == 0
        per_stream = held["reserved"] // NUM_STREAMS
        assert held["reserved"] == NUM_STREAMS * per_stream
        assert per_stream > MAX_TOKENS

        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: is_gone(pid), 10, "the killed gateway to exit")
        for thread in threads:
            thread.join(timeout=30)
        assert len(broken) == NUM_STREAMS, broken

    # Until they expire, its reservations still count: the survivor refuses what would
    # overspend with them, and admits what fits beside them.
    room = BUDGET - held["reserved"]
    too_much = post(survivor, chat(room, stream=False))
    assert too_much.status_code == 429, too_much.text
    assert too_much.json()["error"]["code"] == "insufficient_quota"
    fits = post(survivor, chat(10, stream=False))
    assert fits.status_code == 200, fits.text
    assert budget()["reserved"] == held["reserved"]

    # Then they lapse: nothing reserved, and used is exactly what the records charge.
    wait_until(
        lambda: budget()["reserved"] == 0, RESERVATION_TTL_S + 10, "the reservations to lapse"
    )
    database = Database(database_url)
    try:

        def charged() -> int:
            with database.session() as session:
                totals = sum_tokens(session, tenant_id, EPOCH, FAR_FUTURE)
            return totals.prompt_tokens + totals.completion_tokens

        wait_until(lambda: charged() == budget()["used"], 10, "the records to match the ledger")
        assert budget()["used"] == fits.json()["usage"]["total_tokens"]

        # The freed budget is spent to the limit on the survivor, never past it.
        while (left := BUDGET - budget()["used"]) > per_stream:
            answer = post(survivor, chat(min(MAX_TOKENS, left - per_stream), stream=False))
            assert answer.status_code == 200, answer.text
        over = post(survivor, chat(left, stream=False))
        assert over.status_code == 429, over.text
        wait_until(lambda: charged() == budget()["used"], 10, "the records to match the ledger")
        assert budget()["used"] <= BUDGET
        assert budget()["reserved"] == 0
    finally:
        database.dispose()

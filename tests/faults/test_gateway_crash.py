"""The gateway SIGKILLed under load: every request whose client got its whole answer keeps its
usage record.

Why it holds: a request's record is appended to the spill file (flushed to the OS, so a process
crash cannot lose it) before the last bytes of its answer are sent, and the next start on the
same data directory commits the spill file to the database before it serves (budgets are
rebuilt from the database). The first two tests check those orders exactly, in process; the
third kills a real ``tollway serve`` mid-load and restarts it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import SPILL_FILENAME, build_gateway
from gateway.settings import GatewaySettings
from gateway.storage import migrate
from gateway.storage.api_keys import create_key
from gateway.storage.database import Database
from gateway.storage.models import UsageStatus
from gateway.storage.tenants import create_tenant
from gateway.storage.usage_store import UsageEntry, list_usage
from gateway.storage.usage_writer import UsageWriter
from tests.faults.processes import (
    MODEL,
    StreamSeen,
    Tollway,
    chat_body,
    read_stream,
    shared_tollway,
)
from tests.support.child_process import is_gone
from tests.support.polling import wait_until

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def checkpoint(demo_checkpoint: Callable[..., Path]) -> Path:
    return demo_checkpoint(size="tiny")


@pytest.fixture
def tollway(request: pytest.FixtureRequest, checkpoint: Path) -> Tollway:
    return shared_tollway(request.config, checkpoint)


# -- the order: record first, then the end of the answer -----------------------------------


@dataclass
class _Answer:
    request_id: str = ""
    status: int = 0
    body: bytes = b""
    ids_durable_at_the_end: frozenset[str] | None = None  # when the client saw the end


def _durable_request_ids(data_dir: Path, database: Database) -> frozenset[str]:
    """Request ids in the spill file or the database: what a crash now would not lose."""
    spill = data_dir / SPILL_FILENAME
    ids = {json.loads(line)["request_id"] for line in spill.read_text().splitlines() if line}
    with database.session() as session:
        ids |= {entry.request_id for entry in _stored(session)}
    return frozenset(ids)


def _stored(session: Any) -> list[UsageEntry]:
    return list_usage(session, limit=1000).records


async def _ask(app: Any, api_key: str, body: dict[str, Any], on_end: Callable[[], Any]) -> _Answer:
    """One request through the ASGI app, as a server would run it; ``on_end`` is called when
    the client receives the end of the answer ([DONE] on a stream, the last body part else)."""
    payload = json.dumps(body).encode()
    answer = _Answer()
    is_complete = asyncio.Event()
    sent_request = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_request
        if not sent_request:
            sent_request = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await is_complete.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.request_id = dict(message["headers"])[b"x-request-id"].decode()
            return
        chunk = message.get("body", b"")
        answer.body += chunk
        is_end = b"data: [DONE]" in chunk or not message.get("more_body", False)
        if is_end and answer.ids_durable_at_the_end is None:
            answer.ids_durable_at_the_end = on_end()
        if not message.get("more_body", False):
            is_complete.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"gateway"),
            (b"authorization", f"Bearer {api_key}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    await app(scope, receive, send)
    return answer


async def _with_lifespan(app: Any, work: Callable[[], Any]) -> Any:
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    task = asyncio.ensure_future(app({"type": "lifespan"}, inbox.get, outbox.put))
    assert (await asyncio.wait_for(outbox.get(), 30))["type"] == "lifespan.startup.complete"
    try:
        return await work()
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(outbox.get(), 30)
        await asyncio.wait_for(task, 30)


def test_a_record_is_durable_before_the_client_has_the_end_of_its_answer(
    tollway: Tollway, checkpoint: Path, tmp_path: Path
) -> None:
    """A gateway in process, in front of the module's real engine: at the moment the client
    receives [DONE] (or the last byte of a JSON answer), the request's record is already in the
    spill file or the database, so a crash from then on loses nothing."""
    url = f"sqlite:///{tmp_path / 'tollway.db'}"
    migrate.upgrade(url)
    database = Database(url)
    with database.transaction() as session:
        create_tenant(session, "t", name="t", tier="standard", quota={"budget_tokens": 100_000})
        api_key = create_key(session, "t").key
    settings = GatewaySettings.from_dict(
        {
            "data_dir": str(tmp_path),
            "database_url": url,
            "models": {
                MODEL: {
                    "upstreams": [f"unix:{tollway.engine_socket}"],
                    "context_window": 2048,
                    "checkpoint": str(checkpoint),
                }
            },
        }
    )
    app = build_gateway(settings)

    async def run() -> list[_Answer]:
        answers = []
        for stream in (True, False):
            body = chat_body(8, stream=stream)
            answers.append(
                await _ask(app, api_key, body, lambda: _durable_request_ids(tmp_path, database))
            )
        return answers

    try:
        answers = asyncio.run(_with_lifespan(app, run))
    finally:
        database.dispose()
    assert [answer.status for answer in answers] == [200, 200], answers
    is_durable = [answer.request_id in (answer.ids_durable_at_the_end or ()) for answer in answers]
    assert is_durable == [True, True], "the client had its answer before its record was spilled"


def test_a_restarted_gateway_serves_only_once_its_spilled_records_are_in_the_database(
    checkpoint: Path, tmp_path: Path
) -> None:
    """Budgets are rebuilt from the database on first use: a gateway that served before the
    records it replays (left by a crash) were committed would forget them, and the tenant
    could overspend by that much."""
    url = f"sqlite:///{tmp_path / 'tollway.db'}"
    migrate.upgrade(url)
    database = Database(url)
    # What a gateway killed mid-load leaves behind: records in the spill file only.
    crashed = UsageWriter(database, tmp_path / SPILL_FILENAME)  # never started
    for number in range(20):
        crashed.submit(_entry(f"spilled-{number}"))
    assert not crashed.close(timeout=0)
    settings = GatewaySettings.from_dict(
        {
            "data_dir": str(tmp_path),
            "database_url": url,
            "models": {
                MODEL: {
                    "upstreams": [f"unix:{tmp_path}/no-engine.sock"],
                    "context_window": 2048,
                    "checkpoint": str(checkpoint),
                }
            },
        }
    )

    async def num_stored() -> int:  # the moment the app starts serving
        with database.session() as session:
            return len(_stored(session))

    try:
        assert asyncio.run(_with_lifespan(build_gateway(settings), num_stored)) == 20
    finally:
        database.dispose()


def _entry(request_id: str) -> UsageEntry:
    return UsageEntry(
        request_id=request_id,
        tenant_id="t",
        key_id=None,
        requested_model=MODEL,
        served_model=MODEL,
        routing_decision=None,
        prompt_tokens=10,
        cached_tokens=0,
        completion_tokens=5,
        cost_micros=0,
        status=UsageStatus.COMPLETED,
        reject_reason=None,
        streamed=False,
        created_at=datetime.now(timezone.utc),
    )


# -- a real crash under load -------------------------------------------------------------


@dataclass(frozen=True)
class _Seen:
    """A request whose client got its whole answer, and the usage the answer reported."""

    request_id: str
    is_stream: bool
    prompt_tokens: int
    completion_tokens: int


def _one(client: httpx.Client, number: int) -> _Seen | None:
    """A whole answer, or None if the request failed (the gateway died under it)."""
    is_stream = number % 2 == 0
    body = chat_body(6 + number % 5, stream=is_stream)
    if is_stream:
        seen = StreamSeen()
        try:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                read_stream(response, into=seen)
        except httpx.HTTPError:
            pass  # [DONE] may have come before the connection broke: that is a whole answer
        usage = seen.usage
        if seen.status_code != 200 or not seen.is_done or seen.errors or usage is None:
            return None
        request_id = seen.request_id
    else:
        try:
            answer = client.post("/v1/chat/completions", json=body)
            if answer.status_code != 200:
                return None
            usage, request_id = answer.json()["usage"], answer.headers["x-request-id"]
        except (httpx.HTTPError, ValueError):
            return None
    return _Seen(request_id, is_stream, usage["prompt_tokens"], usage["completion_tokens"])


def test_every_request_answered_before_a_gateway_sigkill_keeps_its_record(
    tollway: Tollway,
) -> None:
    num_clients = 6
    completed: list[_Seen] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client_loop(index: int) -> None:
        number = index
        with tollway.client() as client:
            while not stop.is_set():
                seen = _one(client, number)
                number += num_clients
                if seen is not None:
                    with lock:
                        completed.append(seen)
                elif tollway.process is not None and tollway.process.poll() is not None:
                    return  # the gateway is gone

    engine_pid = tollway.engine_pid()
    with ThreadPoolExecutor(num_clients) as pool:
        for index in range(num_clients):
            pool.submit(client_loop, index)
        wait_until(lambda: len(completed) >= 40, 90, "40 answered requests")
        tollway.kill()  # SIGKILL, with requests in flight
        stop.set()
    # Leaving the pool's block joined every client thread: nothing appends any more.
    with lock:
        answered = list(completed)
    assert is_gone(tollway.pid)
    wait_until(lambda: is_gone(engine_pid), 10, "the engine to die with its gateway")

    tollway.restart()  # the same data directory: the spill file is replayed
    with tollway.client() as client:  # at once: the first look at the budget rebuilds it
        assert client.get("/v1/budget").status_code == 200
    tollway.wait_for_records({seen.request_id for seen in answered})
    records = tollway.records()
    for seen in answered:
        record = records[seen.request_id]
        assert record.status is UsageStatus.COMPLETED, record
        assert record.streamed == seen.is_stream
        assert (record.prompt_tokens, record.completion_tokens) == (
            seen.prompt_tokens,
            seen.completion_tokens,
        )
    # The budget, rebuilt from the records, counts every one of them.
    with tollway.client() as client:
        budget = client.get("/v1/budget").json()
    assert budget["used"] == sum(r.prompt_tokens + r.completion_tokens for r in records.values())
    # The restarted gateway serves, and the engine came back with it.
    with tollway.client() as client:
        response = client.post("/v1/chat/completions", json=chat_body(4, stream=False))
    assert response.status_code == 200, response.text

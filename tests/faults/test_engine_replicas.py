"""Engine replicas behind one gateway, found through one DNS name: one SIGKILLed mid-run, then
restarted, and one added by DNS mid-run.

Real engine processes (``python -m backend_engine`` on the tiny demo checkpoint), each on its
own loopback address and the same port, as a Kubernetes headless Service gives one address per
pod; the gateway (in this process) resolves ``dns://engines.test:<port>`` with a resolver that
answers the test's list of addresses. Replicas are chosen by prefix.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.app import build_gateway
from gateway.settings import GatewaySettings
from gateway.storage.database import Database
from gateway.storage.migrate import upgrade
from gateway.storage.models import UsageStatus
from gateway.storage.usage_store import UsageEntry, list_usage
from tests.faults.processes import (
    CLIENT_TIMEOUT,
    TcpEngine,
    chat_body,
    free_port,
    read_stream,
)
from tests.support.polling import wait_until
from tests.support.stand_in_stack import tenant_key
from tests.support.uvicorn_thread import start_in_thread, stop_thread

pytestmark = pytest.mark.timeout(300)

MODEL = "chat"
HOST_NAME = "engines.test"
ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
NUM_TOKENS_BEFORE_KILL = 5
LONG = 1000  # tokens asked for: far more than come before the kill
# A prompt of several KV blocks (16 tokens each), so that where it is cached shows.
SYSTEM = "You are the support assistant of one tenant; answer briefly and politely. " * 6


def system_chat(max_tokens: int, *, stream: bool, system: str = SYSTEM) -> dict[str, Any]:
    body = chat_body(max_tokens, stream=stream, content="What is my balance?")
    body["model"] = MODEL
    body["messages"].insert(0, {"role": "system", "content": system})
    return body


@dataclass
class Cluster:
    engines: list[TcpEngine]
    dns: list[str]  # what HOST_NAME resolves to now
    url: str
    key: str
    database_url: str
    request_ids: list[str] = field(default_factory=list)

    def client(self) -> httpx.Client:
        headers = {"authorization": f"Bearer {self.key}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=CLIENT_TIMEOUT)

    def chat(self, body: dict[str, Any]) -> httpx.Response:
        with self.client() as client:
            response = client.post("/v1/chat/completions", json=body)
        self.request_ids.append(response.headers["x-request-id"])
        return response

    def served_by(self, body: dict[str, Any]) -> tuple[TcpEngine, httpx.Response]:
        """The (live) engine that answered ``body``, and its answer."""
        live = [e for e in self.engines if e.process is not None and e.process.poll() is None]
        before = {e.address: e.num_requests() for e in live}
        response = self.chat(body)
        assert response.status_code == 200, response.text
        (engine,) = [e for e in live if e.num_requests() > before[e.address]]
        return engine, response

    def records(self) -> dict[str, UsageEntry]:
        database = Database(self.database_url)
        try:
            with database.session() as session:
                entries = list_usage(session, limit=1000).records
        finally:
            database.dispose()
        return {entry.request_id: entry for entry in entries}

    def wait_for_records(self) -> dict[str, UsageEntry]:
        wanted = set(self.request_ids)
        wait_until(lambda: wanted <= set(self.records()), 30, "every request's usage record")
        return self.records()


def cached_tokens(response: httpx.Response) -> int:
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


@pytest.fixture
def cluster(demo_checkpoint: Callable[..., Path], tmp_path: Path) -> Iterator[Cluster]:
    """Two engines in DNS (the third address is free for one to join), one gateway."""
    checkpoint = demo_checkpoint(size="tiny")
    port = free_port()
    engines = [
        TcpEngine(checkpoint, address, port, tmp_path / f"engine-{address}.log")
        for address in ADDRESSES
    ]
    dns = list(ADDRESSES[:2])

    async def resolve(host: str, asked_port: int) -> Sequence[str]:
        if host != HOST_NAME or asked_port != port:
            raise OSError(f"unknown name {host}:{asked_port}")
        return list(dns)

    database_url = f"sqlite:///{tmp_path / 'tollway.db'}"
    upgrade(database_url)
    settings = GatewaySettings.from_dict(
        {
            "data_dir": str(tmp_path / "gateway"),
            "database_url": database_url,
            "dns_refresh_s": 0.2,
            "health_check_interval_s": 0.2,
            "models": {
                MODEL: {
                    "upstreams": [f"dns://{HOST_NAME}:{port}"],
                    "checkpoint": str(checkpoint),
                    "context_window": 2048,
                    "replica_policy": "prefix",
                }
            },
        }
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(
            build_gateway(settings, resolver=resolve), lifespan="on", log_level="warning"
        )
    )
    try:
        for engine in engines[:2]:
            engine.start()
        thread = start_in_thread(server, [sock])
        _, key = tenant_key(database_url)
        yield Cluster(engines, dns, f"http://127.0.0.1:{sock.getsockname()[1]}", key, database_url)
        stop_thread(server, thread)
    finally:
        for engine in engines:
            engine.stop()


def test_a_killed_replica_is_routed_around_billed_and_rejoins_when_ready(
    cluster: Cluster,
) -> None:
    # The prefix stays where it was first cached.
    home, first = cluster.served_by(system_chat(4, stream=False))
    again, second = cluster.served_by(system_chat(4, stream=False))
    assert again is home
    assert cached_tokens(second) > 0 == cached_tokens(first)
    other = next(e for e in cluster.engines[:2] if e is not home)

    # A stream of that prefix is on its home replica when it is SIGKILLed; requests of the same
    # prefix keep coming meanwhile, and none has a token from the dead replica yet.
    killed = threading.Event()
    pool = ThreadPoolExecutor(4)
    sent: list[Future[httpx.Response]] = []

    def kill_after_a_few_tokens(seen: object) -> None:
        if not killed.is_set() and getattr(seen, "num_tokens", 0) >= NUM_TOKENS_BEFORE_KILL:
            home.kill()
            killed.set()
            body = system_chat(4, stream=False)
            sent.extend(pool.submit(cluster.chat, body) for _ in range(4))

    with pool, cluster.client() as client:
        with client.stream(
            "POST", "/v1/chat/completions", json=system_chat(LONG, stream=True)
        ) as r:
            seen = read_stream(r, kill_after_a_few_tokens)
        cluster.request_ids.append(seen.request_id)
        during = [future.result(timeout=60) for future in sent]
    assert killed.is_set(), "the stream ended before its engine could be killed"

    # The stream: what came before the crash, one error event, [DONE].
    assert NUM_TOKENS_BEFORE_KILL <= seen.num_tokens < LONG
    assert [e["code"] for e in seen.errors] == ["upstream_error"]
    assert seen.is_done
    # Requests with no token yet went to the other replica: all answered.
    assert [r.status_code for r in during] == [200] * 4, [r.text for r in during]
    # The prefix is re-homed: the surviving replica now holds it and serves it from cache.
    engine, answer = cluster.served_by(system_chat(4, stream=False))
    assert engine is other
    assert cached_tokens(answer) > 0

    # Every request has its record; the killed stream is billed what the client received.
    records = cluster.wait_for_records()
    assert len(records) == len(cluster.request_ids)
    killed_record = records[seen.request_id]
    assert killed_record.status is UsageStatus.UPSTREAM_ERROR
    assert killed_record.completion_tokens == seen.num_tokens
    assert all(records[r.headers["x-request-id"]].status is UsageStatus.COMPLETED for r in during)

    # Restarted, it rejoins once ready: new prefixes reach it again.
    home.start()
    before = home.num_requests()

    def home_serves_again() -> bool:
        system = f"Tenant {len(cluster.request_ids)}: a new system prompt for a new tenant. " * 6
        assert cluster.chat(system_chat(2, stream=False, system=system)).status_code == 200
        return home.num_requests() > before

    wait_until(home_serves_again, 60, "the restarted replica to receive requests")


def test_an_engine_added_by_dns_mid_run_receives_requests(cluster: Cluster) -> None:
    for n in range(4):
        system = f"Tenant {n} of the first pair of engines. " * 10
        assert cluster.chat(system_chat(2, stream=False, system=system)).status_code == 200
    added = cluster.engines[2].start()
    cluster.dns.append(added.address)  # the headless Service lists the new ready pod
    served: list[TcpEngine] = []

    def added_serves() -> bool:
        system = f"Tenant {len(cluster.request_ids)} arrives after the scale-up. " * 10
        engine, _ = cluster.served_by(system_chat(2, stream=False, system=system))
        served.append(engine)
        return engine is added

    wait_until(added_serves, 60, "the added replica to receive requests")
    # New prefixes on idle replicas: each goes to the rendezvous winner of the three, so 20 in
    # a row miss the added one only with odds of (2/3)**20, 0.03%.
    assert len(served) <= 20, f"{len(served)} requests before the new replica got one"

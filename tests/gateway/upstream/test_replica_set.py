"""Live replicas over real HTTP: a gateway in front of stand-in engines on 127.0.0.x ports.

Replicas join and leave as a ``dns://`` name resolves (the resolver is the test's: DNS lies
outside Tollway), a replica that is not ready is skipped until it is, and one that fails is
ejected, though never so that a request finds no replica to try.
"""

from __future__ import annotations

import re
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from gateway.settings import GatewaySettings
from gateway.storage.api_keys import hash_key
from tests.support.polling import wait_until
from tests.support.stand_in_engine import MODEL, StandInEngine
from tests.support.stand_in_stack import CONTEXT_WINDOW, TappedEngine, gateway, tenant_key
from tests.support.uvicorn_thread import start_in_thread, stop_thread

METRICS_TOKEN = "metrics-" + "m" * 40
NAME = "engines.test"


class Replica(TappedEngine):
    """A tapped stand-in engine on a TCP address; ``ready_status`` answers ``GET /ready``
    (None: the stand-in has no such route, 404, like a foreign server)."""

    ready_status: int | None = None
    num_ready_checks = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/ready":
            self.num_ready_checks += 1
        if scope["type"] == "http" and scope["path"] == "/ready" and self.ready_status:
            await send({"type": "http.response.start", "status": self.ready_status})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        await super().__call__(scope, receive, send)

    @property
    def num_posts(self) -> int:
        return len(self.requests)


@contextmanager
def replicas_on(hosts: Sequence[str]) -> Iterator[tuple[int, list[Replica]]]:
    """One stand-in per host (127.0.0.x), all on the same port, as a headless Service's
    pods are: ``(port, replicas)``."""
    with ExitStack() as stack:
        port, found = 0, []
        for host in hosts:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            replica = Replica(StandInEngine(num_chunks=2), f"{host}:{port}")
            config = uvicorn.Config(replica, loop="asyncio", http="h11", log_level="warning")
            server = uvicorn.Server(config)
            thread = start_in_thread(server, [sock])
            stack.callback(stop_thread, server, thread)
            stack.callback(replica.release)
            found.append(replica)
        yield port, found


def settings_with(
    upstreams: list[str], data_dir: Path, database_url: str, **overrides: Any
) -> GatewaySettings:
    return GatewaySettings.from_dict(
        {
            "data_dir": str(data_dir),
            "database_url": database_url,
            "metrics_token_hash": hash_key(METRICS_TOKEN),
            "models": {MODEL: {"upstreams": upstreams, "context_window": CONTEXT_WINDOW}},
            **overrides,
        }
    )


def metric(client: httpx.Client, name: str, labels: str = f'model="{MODEL}"') -> float | None:
    text = client.get("/metrics", headers={"authorization": f"Bearer {METRICS_TOKEN}"}).text
    found = re.search(rf"^{name}\{{{re.escape(labels)}\}} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


def complete(client: httpx.Client, key: str, *, stream: bool = False) -> httpx.Response:
    return client.post(
        "/v1/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream},
    )


def test_replicas_join_and_leave_as_the_name_resolves(sqlite_db_url: str, tmp_path: Path) -> None:
    addresses = ["127.0.0.1", "127.0.0.2"]
    is_failing = threading.Event()

    async def resolver(host: str, port: int) -> Sequence[str]:
        assert host == NAME
        if is_failing.is_set():
            raise OSError("no such name (the test's)")
        return list(addresses)

    with replicas_on(["127.0.0.1", "127.0.0.2", "127.0.0.3"]) as (port, (a, b, c)):
        settings = settings_with(
            [f"dns://{NAME}:{port}"],
            tmp_path,
            sqlite_db_url,
            dns_refresh_s=0.05,
            health_check_interval_s=0.05,
        )
        _, key = tenant_key(sqlite_db_url)
        with (
            gateway(settings, resolver=resolver) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            healthy = "tollway_gateway_healthy_replicas"
            assert metric(client, healthy) == 2.0  # resolved before serving
            for _ in range(2):
                assert complete(client, key).status_code == 200
            assert (a.num_posts, b.num_posts, c.num_posts) == (1, 1, 0)

            addresses.append("127.0.0.3")  # a pod became ready
            wait_until(lambda: metric(client, healthy) == 3.0, what="the third replica joins")
            for _ in range(3):
                assert complete(client, key).status_code == 200
            assert (a.num_posts, b.num_posts, c.num_posts) == (2, 2, 1)

            # A stream in flight on a replica that leaves finishes there.
            for replica in (a, b, c):
                replica.hold()
            answers: list[httpx.Response] = []
            streaming = threading.Thread(
                target=lambda: answers.append(complete(client, key, stream=True))
            )
            streaming.start()  # the gateway answers once the engine sends its first token
            holder: list[Replica] = []

            def someone_holds() -> bool:
                holder[:] = [r for r in (a, b, c) if r.num_held]
                return bool(holder)

            wait_until(someone_holds, what="the stream reaches a replica")
            (leaving,) = holder
            addresses.remove(leaving.socket_path.split(":")[0])
            wait_until(lambda: metric(client, healthy) == 2.0, what="the replica leaves")
            for replica in (a, b, c):
                replica.release()
            streaming.join(timeout=30)
            (streamed,) = answers
            assert streamed.status_code == 200
            assert streamed.text.rstrip().endswith("[DONE]")
            assert streamed.text.count("word") == 2

            before = leaving.num_posts
            for _ in range(4):
                assert complete(client, key).status_code == 200
            assert leaving.num_posts == before

            # A failed resolution keeps the last good set.
            is_failing.set()
            failures = "tollway_gateway_dns_resolution_failures_total"
            labels = f'upstream="dns://{NAME}:{port}"'
            wait_until(lambda: (metric(client, failures, labels) or 0) >= 2, what="failures")
            assert metric(client, healthy) == 2.0
            for _ in range(2):
                assert complete(client, key).status_code == 200
            assert leaving.num_posts == before


def test_a_replica_that_is_not_ready_is_skipped_until_it_is(
    sqlite_db_url: str, tmp_path: Path
) -> None:
    with replicas_on(["127.0.0.1", "127.0.0.2"]) as (port, (foreign, loading)):
        loading.ready_status = 503  # an engine loading its weights
        settings = settings_with(
            [f"http://127.0.0.1:{port}", f"http://127.0.0.2:{port}"],
            tmp_path,
            sqlite_db_url,
            health_check_interval_s=0.05,
        )
        _, key = tenant_key(sqlite_db_url)
        with gateway(settings) as base, httpx.Client(base_url=base, timeout=30) as client:
            healthy = "tollway_gateway_healthy_replicas"
            assert metric(client, healthy) == 1.0  # the foreign one: no /ready, /health ok
            for _ in range(4):
                assert complete(client, key).status_code == 200
            assert (foreign.num_posts, loading.num_posts) == (4, 0)

            loading.ready_status = 200
            wait_until(lambda: metric(client, healthy) == 2.0, what="it becomes ready")
            for _ in range(2):
                assert complete(client, key).status_code == 200
            assert (foreign.num_posts, loading.num_posts) == (5, 1)


def test_a_discovered_replica_joins_only_once_a_check_says_it_is_ready(
    sqlite_db_url: str, tmp_path: Path
) -> None:
    addresses = ["127.0.0.1"]

    async def resolver(host: str, port: int) -> Sequence[str]:
        return list(addresses)

    with replicas_on(["127.0.0.1", "127.0.0.2"]) as (port, (serving, loading)):
        loading.ready_status = 503
        settings = settings_with(
            [f"dns://{NAME}:{port}"],
            tmp_path,
            sqlite_db_url,
            dns_refresh_s=0.05,
            health_check_interval_s=3600,  # only the check on joining runs in this test
        )
        _, key = tenant_key(sqlite_db_url)
        with (
            gateway(settings, resolver=resolver) as base,
            httpx.Client(base_url=base, timeout=30) as client,
        ):
            addresses.append("127.0.0.2")
            wait_until(lambda: loading.num_ready_checks == 1, what="the check on joining")
            for _ in range(4):
                assert complete(client, key).status_code == 200
            assert (serving.num_posts, loading.num_posts) == (4, 0)
            assert metric(client, "tollway_gateway_healthy_replicas") == 1.0


def test_failing_replicas_are_ejected_yet_still_tried_when_all_are(
    sqlite_db_url: str, tmp_path: Path
) -> None:
    with replicas_on(["127.0.0.1", "127.0.0.2"]) as (port, (good, bad)):
        bad.fail_with = 500
        settings = settings_with(
            [f"http://127.0.0.1:{port}", f"http://127.0.0.2:{port}"],
            tmp_path,
            sqlite_db_url,
            health_check_interval_s=0,
            ejection_failures=2,
            ejection_backoff_s=3600,
            ejection_backoff_max_s=3600,
        )
        _, key = tenant_key(sqlite_db_url)
        with gateway(settings) as base, httpx.Client(base_url=base, timeout=30) as client:
            for stream in (False, True) * 3:  # retried on the good one before a token
                assert complete(client, key, stream=stream).status_code == 200
            assert bad.num_posts == 2  # then ejected: not tried again
            assert good.num_posts == 6
            ejections = "tollway_gateway_replica_ejections_total"
            assert metric(client, ejections) == 1.0
            assert metric(client, "tollway_gateway_healthy_replicas") == 1.0

            good.fail_with = 500
            statuses = [complete(client, key).status_code for _ in range(3)]
            assert statuses == [502, 502, 502]  # the engines failed it: no 503 for lack of one
            assert metric(client, ejections) == 2.0
            # Alone, it was tried twice and ejected; then both were tried anyway.
            assert (good.num_posts, bad.num_posts) == (9, 3)
            assert metric(client, "tollway_gateway_healthy_replicas") == 0.0

            good.fail_with = bad.fail_with = None
            assert complete(client, key).status_code == 200  # a success ends its ejection
            assert metric(client, "tollway_gateway_healthy_replicas") == 1.0
            assert complete(client, key).status_code == 200  # on that one: the other waits
            assert metric(client, "tollway_gateway_healthy_replicas") == 1.0
            assert good.num_posts + bad.num_posts == 9 + 3 + 2


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)

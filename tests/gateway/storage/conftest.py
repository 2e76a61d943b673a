"""Storage fixtures: every test runs on SQLite and on a real PostgreSQL server.

The PostgreSQL server is ``postgres_server`` (tests/gateway/conftest.py), started once per
session. Each test gets its own database on that server, dropped afterwards.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from gateway.storage.database import Database
from gateway.storage.migrate import upgrade
from gateway.storage.models import UsageStatus
from gateway.storage.usage_store import UsageEntry
from tests.support.postgres_server import PostgresServer

PG_TEMPLATE = "tollway_migrated"

Outage = Callable[[], AbstractContextManager[None]]


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def database_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database (no tables) on the test's backend."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'tollway.db'}"
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    with postgres_database(server, template="template0") as url:
        yield url


@contextmanager
def postgres_database(server: PostgresServer, *, template: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:16]}"
    server.execute(f"CREATE DATABASE {name} TEMPLATE {template} STRATEGY file_copy")
    try:
        yield server.url(name)
    finally:
        server.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def postgres_template(postgres_server: PostgresServer) -> str:
    """A PostgreSQL database migrated to head once per session; tests get copies."""
    postgres_server.execute(f"CREATE DATABASE {PG_TEMPLATE}")
    upgrade(postgres_server.url(PG_TEMPLATE))
    return PG_TEMPLATE


@pytest.fixture
def migrated_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database migrated to head on the test's backend."""
    if backend == "sqlite":
        yield request.getfixturevalue("sqlite_db_url")  # tests/gateway/conftest.py
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    with postgres_database(server, template=request.getfixturevalue("postgres_template")) as url:
        yield url


@pytest.fixture
def database(migrated_url: str) -> Iterator[Database]:
    db = Database(migrated_url)
    yield db
    db.dispose()


@pytest.fixture
def outage(backend: str, migrated_url: str, request: pytest.FixtureRequest) -> Outage:
    """``with outage(): ...`` makes the database refuse work, then brings it back.

    SQLite: another connection holds an exclusive lock, so writers get "database is locked".
    PostgreSQL: the database stops accepting connections and its sessions are terminated.
    """

    @contextmanager
    def sqlite_outage() -> Iterator[None]:
        path = migrated_url.removeprefix("sqlite:///")
        blocker = sqlite3.connect(path, isolation_level=None, timeout=5)
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()

    @contextmanager
    def postgres_outage() -> Iterator[None]:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        name = migrated_url.rsplit("/", 1)[1]
        server.execute(
            f"ALTER DATABASE {name} ALLOW_CONNECTIONS false",
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'",
        )
        try:
            yield
        finally:
            server.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")

    return sqlite_outage if backend == "sqlite" else postgres_outage


T0 = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)


@pytest.fixture
def t0() -> datetime:
    """When ``make_entry(0)`` was created."""
    return T0


@pytest.fixture
def make_entry() -> Callable[..., UsageEntry]:
    """``make_entry(n, **fields)``: a completed record ``req-n``, created ``n`` s after T0."""

    def make(n: int, **fields: Any) -> UsageEntry:
        values: dict[str, Any] = {
            "request_id": f"req-{n}",
            "tenant_id": "acme",
            "key_id": "key_1",
            "requested_model": "auto",
            "served_model": "llama-small",
            "routing_decision": "cheapest",
            "prompt_tokens": 100,
            "cached_tokens": 40,
            "completion_tokens": 10,
            "cost_micros": 1234,
            "status": UsageStatus.COMPLETED,
            "reject_reason": None,
            "streamed": True,
            "created_at": T0 + timedelta(seconds=n),
            "finished_at": T0 + timedelta(seconds=n, milliseconds=500),
            "ttft_ms": 42,
            "finish_reason": "stop",
        }
        values.update(fields)
        return UsageEntry(**values)

    return make

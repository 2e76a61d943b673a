"""Alert fixtures: ``database``, a migrated database on SQLite and on a real PostgreSQL server
(``postgres_server``, started once per session), fresh per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from gateway.storage.database import Database
from gateway.storage.migrate import upgrade
from tests.support.postgres_server import PostgresServer


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "sqlite":
        yield request.getfixturevalue("sqlite_db_url")
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    name = f"t_{uuid.uuid4().hex[:16]}"
    server.execute(f"CREATE DATABASE {name}")
    try:
        upgrade(server.url(name))
        yield server.url(name)
    finally:
        server.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def database(database_url: str) -> Iterator[Database]:
    db = Database(database_url)
    yield db
    db.dispose()

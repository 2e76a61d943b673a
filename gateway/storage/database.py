"""The database handle: one engine and its session factory, built from a URL.

``sqlite:///path/tollway.db`` is the embedded default; ``postgresql+psycopg://…`` is for
production. On SQLite every connection gets WAL (readers never block the one writer), foreign
keys on, and a busy timeout so a briefly locked database waits instead of failing at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker


def ensure_sqlite_directory(url: str) -> None:
    """Create the directory of a SQLite database file (SQLite creates only the file)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)


class Database:
    """Owns an engine; hands out sessions. Create one at start-up and pass it down."""

    def __init__(self, url: str, *, busy_timeout_s: float = 5.0, echo: bool = False) -> None:
        parsed = make_url(url)
        if parsed.get_backend_name() not in ("sqlite", "postgresql"):
            raise ValueError(
                f"unsupported database URL {parsed.render_as_string(hide_password=True)!r}: "
                "use sqlite:///path/to/tollway.db or postgresql+psycopg://user@host/db"
            )
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        connect_args: dict[str, Any] = {}
        if self.is_sqlite:
            # The usage writer's thread and the request handlers share the pool.
            connect_args["check_same_thread"] = False
            connect_args["timeout"] = busy_timeout_s
            ensure_sqlite_directory(url)
        else:
            connect_args["connect_timeout"] = 10  # seconds; a dead host must not hang a writer
        self.engine: Engine = create_engine(
            parsed, echo=echo, pool_pre_ping=not self.is_sqlite, connect_args=connect_args
        )
        if self.is_sqlite:
            _install_sqlite_pragmas(self.engine, busy_timeout_ms=int(busy_timeout_s * 1000))
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def url(self) -> str:
        """The URL with its password in clear (pass it on, never log it)."""
        return self.engine.url.render_as_string(hide_password=False)

    def session(self) -> Session:
        return self._sessions()

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on an exception."""
        with self._sessions() as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()


def _install_sqlite_pragmas(engine: Engine, *, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def set_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

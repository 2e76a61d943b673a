"""Run the Alembic migrations in ``migrations/`` against a database URL, without alembic.ini.

Every gateway replica migrates at start-up (a no-op when the database is current), so
upgrades are serialised: on PostgreSQL by a session advisory lock held for the whole
upgrade, on SQLite by an exclusive lock on a file next to the database. A replica that
waits finds the schema current and does nothing.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, make_url, pool, text

import migrations
from gateway.storage.database import ensure_sqlite_directory

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent
# pg_advisory_lock key (a signed bigint): "TOLLWAY1" in ASCII, unique to our migrations.
MIGRATION_LOCK_KEY = 0x544F4C4C57415931


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Config values are %-interpolated: a password with "%" in it must be escaped.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    ensure_sqlite_directory(url)
    with migration_lock(url):
        command.upgrade(alembic_config(url), revision)


@contextmanager
def migration_lock(url: str) -> Iterator[None]:
    """Hold the database's migration lock: one upgrade at a time, across processes."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "postgresql":
        engine = create_engine(url, poolclass=pool.NullPool)
        try:
            with engine.connect() as connection:
                connection.execute(
                    text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
                )
                connection.commit()
                try:
                    yield
                finally:
                    connection.execute(
                        text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY}
                    )
                    connection.commit()
        finally:
            engine.dispose()
    elif parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        lock_path = Path(f"{parsed.database}.migrate-lock")
        with lock_path.open("a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
    else:
        yield


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    """The revision the database is at, or ``None`` if it was never migrated."""
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations found in {MIGRATIONS_DIR}")
    return head


def all_revisions() -> list[str]:
    """Every revision id, oldest first."""
    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]

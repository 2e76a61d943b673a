from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import text
from sqlalchemy.exc import StatementError

from gateway.storage.database import Database
from gateway.storage.tenants import create_tenant, get_tenant


def test_sqlite_connections_use_wal_and_foreign_keys(tmp_path):
    db = Database(f"sqlite:///{tmp_path / 'nested' / 'x.db'}")
    with db.session() as session:
        assert session.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert session.execute(text("PRAGMA foreign_keys")).scalar() == 1
    assert (tmp_path / "nested" / "x.db").exists()
    db.dispose()


def test_an_unsupported_url_is_refused():
    with pytest.raises(ValueError, match="unsupported database URL"):
        Database("mysql://u:secret@host/db")


def test_transaction_rolls_back_on_error(database):
    def create_then_fail() -> None:
        with database.transaction() as session:
            create_tenant(session, "acme", name="Acme", tier="free", quota={})
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        create_then_fail()
    with database.session() as session:
        assert get_tenant(session, "acme") is None


def test_timestamps_come_back_aware_utc(database):
    plus_two = timezone(timedelta(hours=2))
    at = datetime(2025, 3, 1, 14, 30, 0, 123456, tzinfo=plus_two)
    with database.transaction() as session:
        create_tenant(session, "acme", name="Acme", tier="free", quota={"rpm": 5}, now=at)
    with database.session() as session:
        tenant = get_tenant(session, "acme")
    assert tenant is not None
    assert tenant.created_at == at
    assert tenant.created_at.tzinfo == timezone.utc
    assert tenant.quota == {"rpm": 5}


def test_naive_timestamps_are_refused(database):
    with pytest.raises(StatementError, match="naive datetime"), database.transaction() as s:
        create_tenant(s, "acme", name="Acme", tier="free", quota={}, now=datetime(2025, 1, 1))

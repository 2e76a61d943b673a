import hashlib
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import select

from gateway.storage import api_keys
from gateway.storage.api_keys import (
    authenticate,
    create_key,
    hash_key,
    list_keys,
    revoke_key,
    verify_key,
)
from gateway.storage.models import ApiKeyRow
from gateway.storage.tenants import create_tenant, delete_tenant

T0 = datetime(2025, 3, 1, tzinfo=timezone.utc)


@pytest.fixture
def tenant_db(database):
    with database.transaction() as session:
        create_tenant(session, "acme", name="Acme", tier="pro", quota={"rpm": 60}, now=T0)
        create_tenant(session, "other", name="Other", tier="free", quota={}, now=T0)
    return database


def test_a_key_is_returned_once_and_stored_only_as_a_hash(tenant_db):
    with tenant_db.transaction() as session:
        created = create_key(session, "acme", name="ci", priority="batch", now=T0)
    key = created.key
    assert key.startswith("tw-")
    assert len(key) >= 40
    assert created.info.prefix == key[:12]
    assert created.info.id.startswith("key_")
    assert key not in repr(created)
    with tenant_db.session() as session:
        row = session.scalars(select(ApiKeyRow)).one()
        assert row.key_hash == hashlib.sha256(key.encode()).hexdigest()
        assert all(key not in str(value) for value in vars(row).values())


def test_authenticate_returns_the_key_and_its_tenant(tenant_db):
    with tenant_db.transaction() as session:
        created = create_key(session, "acme", name="ci", priority="batch", now=T0)
    with tenant_db.session() as session:
        found = authenticate(session, created.key, now=T0)
        assert authenticate(session, created.key + "x", now=T0) is None
        assert authenticate(session, "tw-unknown", now=T0) is None
    assert found is not None
    assert found.key == created.info
    assert found.key.priority == "batch"
    assert (found.tenant.id, found.tenant.tier, found.tenant.quota) == ("acme", "pro", {"rpm": 60})


def test_revoked_expired_and_deleted_tenant_keys_fail(tenant_db):
    with tenant_db.transaction() as session:
        revoked = create_key(session, "acme", now=T0)
        expiring = create_key(session, "acme", expires_at=T0 + timedelta(days=1), now=T0)
        orphan = create_key(session, "other", now=T0)
    with tenant_db.transaction() as session:
        assert revoke_key(session, revoked.info.id, now=T0)
        assert not revoke_key(session, revoked.info.id)
        assert not revoke_key(session, "key_nope")
        assert delete_tenant(session, "other")
    with tenant_db.session() as session:
        assert authenticate(session, revoked.key, now=T0) is None
        assert authenticate(session, expiring.key, now=T0 + timedelta(hours=23)) is not None
        assert authenticate(session, expiring.key, now=T0 + timedelta(days=1)) is None
        assert authenticate(session, orphan.key, now=T0) is None


def test_list_keys_by_tenant_shows_prefixes_and_state(tenant_db):
    with tenant_db.transaction() as session:
        first = create_key(session, "acme", name="a", now=T0)
        second = create_key(session, "acme", name="b", now=T0 + timedelta(seconds=1))
        create_key(session, "other", now=T0)
        revoke_key(session, first.info.id, now=T0)
    with tenant_db.session() as session:
        keys = list_keys(session, "acme")
    assert [k.id for k in keys] == [first.info.id, second.info.id]
    assert [k.prefix for k in keys] == [first.key[:12], second.key[:12]]
    assert [k.is_active(T0) for k in keys] == [False, True]


def test_creating_a_key_for_a_missing_tenant_fails(tenant_db):
    with pytest.raises(LookupError), tenant_db.transaction() as session:
        create_key(session, "nobody")


def test_comparisons_are_constant_time(tenant_db, monkeypatch):
    calls = []

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return a == b

    monkeypatch.setattr(api_keys.hmac, "compare_digest", spy)
    assert verify_key("tw-abc", hash_key("tw-abc"))
    assert not verify_key("tw-abd", hash_key("tw-abc"))
    assert len(calls) == 2
    with tenant_db.transaction() as session:
        created = create_key(session, "acme", now=T0)
    with tenant_db.session() as session:
        assert authenticate(session, created.key, now=T0) is not None
    assert len(calls) == 3
    assert calls[-1][0] == hash_key(created.key).encode()


def test_key_pages_walk_every_key_once_oldest_first(tenant_db):
    with tenant_db.transaction() as session:
        # Three keys per instant: ties on created_at are ordered by id.
        for n in range(11):
            create_key(session, "acme", name=f"k{n}", now=T0 + timedelta(seconds=n // 3))
        create_key(session, "other", now=T0)
    with tenant_db.session() as session:
        expected = [k.id for k in list_keys(session, "acme")]
        seen: list[str] = []
        cursor = None
        while True:
            page = api_keys.key_page(session, "acme", cursor=cursor, limit=2)
            seen += [k.id for k in page.keys]
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert seen == expected
        assert len(set(seen)) == 11
        other_key = list_keys(session, "other")[0].id
        for cursor in ("key_nope", other_key):
            with pytest.raises(api_keys.UnknownCursorError):
                api_keys.key_page(session, "acme", cursor=cursor, limit=2)

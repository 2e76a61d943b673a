from datetime import datetime, timedelta, timezone

import pytest

from gateway.storage.tenants import (
    TenantExistsError,
    create_tenant,
    delete_tenant,
    get_tenant,
    list_tenants,
    update_tenant,
)

T0 = datetime(2025, 3, 1, tzinfo=timezone.utc)


def test_create_get_and_list(database):
    with database.transaction() as session:
        created = create_tenant(session, "b-corp", name="B", tier="pro", quota={"rpm": 60}, now=T0)
        create_tenant(session, "a-corp", name="A", tier="free", quota={}, now=T0)
    assert created.created_at == created.updated_at == T0
    assert not created.is_deleted
    with database.session() as session:
        assert get_tenant(session, "b-corp") == created
        assert [t.id for t in list_tenants(session)] == ["a-corp", "b-corp"]
        assert get_tenant(session, "nobody") is None


def test_ids_are_unique_even_after_delete(database):
    with database.transaction() as session:
        create_tenant(session, "acme", name="Acme", tier="free", quota={})
        with pytest.raises(TenantExistsError):
            create_tenant(session, "acme", name="Other", tier="free", quota={})
        assert delete_tenant(session, "acme")
        with pytest.raises(TenantExistsError):
            create_tenant(session, "acme", name="Again", tier="free", quota={})
    with pytest.raises(ValueError, match="1 to 64"), database.transaction() as session:
        create_tenant(session, "", name="x", tier="free", quota={})


def test_update_changes_only_given_fields(database):
    with database.transaction() as session:
        create_tenant(session, "acme", name="Acme", tier="free", quota={"rpm": 5}, now=T0)
    later = T0 + timedelta(hours=1)
    with database.transaction() as session:
        updated = update_tenant(session, "acme", quota={"rpm": 50}, now=later)
        assert update_tenant(session, "nobody", name="x") is None
    assert updated is not None
    assert (updated.name, updated.tier, updated.quota) == ("Acme", "free", {"rpm": 50})
    assert (updated.created_at, updated.updated_at) == (T0, later)
    with database.session() as session:
        assert get_tenant(session, "acme") == updated


def test_soft_delete_hides_the_tenant_but_keeps_the_row(database):
    with database.transaction() as session:
        create_tenant(session, "acme", name="Acme", tier="free", quota={})
        create_tenant(session, "other", name="Other", tier="free", quota={})
    with database.transaction() as session:
        assert delete_tenant(session, "acme", now=T0)
        assert not delete_tenant(session, "acme")
        assert not delete_tenant(session, "nobody")
        assert update_tenant(session, "acme", name="x") is None
    with database.session() as session:
        assert get_tenant(session, "acme") is None
        kept = get_tenant(session, "acme", include_deleted=True)
        assert kept is not None
        assert kept.deleted_at == T0
        assert kept.is_deleted
        assert [t.id for t in list_tenants(session)] == ["other"]
        assert [t.id for t in list_tenants(session, include_deleted=True)] == ["acme", "other"]

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import insert
from sqlalchemy.exc import IntegrityError

from gateway.storage.models import Tenant
from gateway.storage.tenants import (
    TenantExistsError,
    create_tenant,
    delete_tenant,
    get_tenant,
    list_tenants,
    tenant_page,
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


def test_ids_differing_only_in_case_cannot_coexist(database):
    with database.transaction() as session:
        create_tenant(session, "acme", name="Acme", tier="free", quota={})
        for variant in ("Acme", "ACME", "aCmE"):
            with pytest.raises(TenantExistsError) as raised:
                create_tenant(session, variant, name="x", tier="free", quota={})
            assert raised.value.existing_id == "acme"
        assert get_tenant(session, "Acme") is None  # lookups are exact: one spelling
    times = {"created_at": T0, "updated_at": T0}
    # The database refuses it too (a concurrent create skips the check above).
    with pytest.raises(IntegrityError), database.transaction() as session:
        session.execute(insert(Tenant).values(id="ACME", name="", tier="free", quota={}, **times))
    with database.session() as session:
        assert [t.id for t in list_tenants(session)] == ["acme"]


def test_pages_walk_every_tenant_once(database):
    ids = [f"t-{n:02d}" for n in range(23)] + ["Zeta", "alpha", "Beta.x", "b_corp"]
    with database.transaction() as session:
        for tenant_id in ids:
            create_tenant(session, tenant_id, name="", tier="free", quota={}, now=T0)
        for tenant_id in ids[::5]:
            delete_tenant(session, tenant_id)
    for include_deleted in (False, True):
        with database.session() as session:
            expected = [t.id for t in list_tenants(session, include_deleted=include_deleted)]
            seen: list[str] = []
            cursor = None
            while True:
                page = tenant_page(session, include_deleted=include_deleted, cursor=cursor, limit=4)
                assert len(page.tenants) <= 4
                seen += [t.id for t in page.tenants]
                if page.next_cursor is None:
                    break
                assert page.next_cursor == page.tenants[-1].id
                cursor = page.next_cursor
        assert seen == expected
        assert len(set(seen)) == len(ids) - (0 if include_deleted else len(ids[::5]))
    with database.session() as session:
        exact = tenant_page(session, include_deleted=True, limit=len(ids))
        assert len(exact.tenants) == len(ids)
        assert exact.next_cursor is None  # no empty page after a full last one
        with pytest.raises(ValueError, match="at least 1"):
            tenant_page(session, limit=0)

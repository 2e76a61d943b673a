"""The audit log through the admin API, on SQLite and PostgreSQL: every admin change is
recorded, in its own transaction, with who, when, before and after; no key secret or key
hash ever reaches it; it is listed newest first, filtered and paged."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from starlette.applications import Starlette

from gateway.api.admin_api import admin_routes
from gateway.auth.admin_key import admin_credential_id
from gateway.errors import EXCEPTION_HANDLERS
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.storage import audit_log
from gateway.storage.api_keys import hash_key
from gateway.storage.database import Database

ADMIN_KEY = "admin-" + "a" * 40
ACTOR = admin_credential_id(hash_key(ADMIN_KEY))
T0 = datetime(2025, 3, 15, 12, 0, tzinfo=timezone.utc)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def client(database: Database, clock: Clock) -> AsyncIterator[httpx.AsyncClient]:
    routes = admin_routes(database, hash_key(ADMIN_KEY), MemoryBudgetLedger(), now=clock)
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as c:
        yield c


async def ok(response: Any, status: int = 200) -> dict[str, Any]:
    result = await response
    assert result.status_code == status, result.text
    return dict(result.json())


async def listed(client: httpx.AsyncClient, **params: Any) -> list[dict[str, Any]]:
    return list((await ok(client.get("/admin/audit-log", params=params)))["data"])


async def test_every_admin_change_is_recorded_with_before_and_after(
    client: httpx.AsyncClient, clock: Clock
) -> None:
    tenant = await ok(client.post("/admin/tenants", json={"id": "acme", "name": "Acme"}), 201)
    clock.now += timedelta(minutes=1)
    await ok(client.patch("/admin/tenants/acme", json={"name": "Acme Inc"}))
    await ok(client.put("/admin/tenants/acme/quota", json={"rpm": 7, "budget_tokens": 1000}))
    key = await ok(client.post("/admin/tenants/acme/keys", json={"name": "ci"}), 201)
    await ok(client.delete(f"/admin/keys/{key['id']}"))
    await ok(client.delete(f"/admin/keys/{key['id']}"))  # again: nothing changes
    await ok(client.delete("/admin/tenants/acme"))
    entries = await listed(client)
    assert [e["action"] for e in entries] == [
        "tenant.deleted",
        "key.revoked",
        "key.created",
        "quota.replaced",
        "tenant.updated",
        "tenant.created",
    ]
    assert {e["actor"] for e in entries} == {ACTOR}
    assert {e["tenant_id"] for e in entries} == {"acme"}
    deleted, revoked, created_key, quota, updated, created = entries
    assert (created["before"], created["after"]["name"]) == (None, "Acme")
    assert created["after"] == tenant
    assert created["created_at"] == "2025-03-15T12:00:00Z"
    assert updated["created_at"] == "2025-03-15T12:01:00Z"
    assert (updated["before"]["name"], updated["after"]["name"]) == ("Acme", "Acme Inc")
    assert (quota["target_type"], quota["target_id"]) == ("quota", "acme")
    assert (quota["before"]["rpm"], quota["after"]["rpm"]) == (None, 7)
    assert quota["after"]["budget_tokens"] == 1000
    assert (created_key["target_type"], created_key["target_id"]) == ("key", key["id"])
    assert created_key["before"] is None
    assert created_key["after"]["name"] == "ci"
    assert revoked["before"]["revoked_at"] is None
    assert revoked["after"]["revoked_at"] == "2025-03-15T12:01:00Z"
    assert deleted["before"]["deleted_at"] is None
    assert deleted["after"]["deleted_at"] == "2025-03-15T12:01:00Z"


async def test_no_key_secret_or_hash_is_ever_recorded(
    client: httpx.AsyncClient, database: Database
) -> None:
    await ok(client.post("/admin/tenants", json={"id": "acme"}), 201)
    created = await ok(client.post("/admin/tenants/acme/keys", json={"name": "k"}), 201)
    await ok(client.delete(f"/admin/keys/{created['id']}"))
    secret = created["key"]
    listing = (await client.get("/admin/audit-log")).text
    with database.session() as session:
        rows = session.execute(text("SELECT * FROM audit_log")).all()
    stored = " ".join(str(value) for row in rows for value in row)
    assert "key.created" in stored
    for forbidden in (secret, hash_key(secret), ADMIN_KEY, hash_key(ADMIN_KEY)):
        assert forbidden not in listing
        assert forbidden not in stored


def test_secret_fields_are_dropped_at_any_depth(database: Database) -> None:
    """A view that grows a field named like a secret still cannot leak it into the log."""
    with database.transaction() as session:
        audit_log.record_change(
            session,
            actor=ACTOR,
            action="key.created",
            target_type="key",
            target_id="key_1",
            tenant_id="acme",
            before=None,
            after={"id": "key_1", "key": "sk-secret", "nested": [{"key_hash": "abc", "n": 1}]},
            now=T0,
        )
        page = audit_log.audit_page(
            session, tenant_id=None, start=None, end=None, cursor=None, limit=10
        )
    assert page.records[0].after == {"id": "key_1", "nested": [{"n": 1}]}


async def test_a_refused_change_records_nothing(
    client: httpx.AsyncClient, database: Database
) -> None:
    """The entry shares the change's transaction: a change that fails leaves neither."""
    await ok(client.post("/admin/tenants", json={"id": "acme"}), 201)
    assert (await client.post("/admin/tenants", json={"id": "ACME"})).status_code == 409
    assert (await client.put("/admin/tenants/nobody/quota", json={})).status_code == 404
    assert (await client.delete("/admin/keys/key_nope")).status_code == 404
    assert [e["action"] for e in await listed(client)] == ["tenant.created"]


def test_an_entry_rolls_back_with_its_transaction(database: Database) -> None:
    def change_that_fails() -> None:
        with database.transaction() as session:
            audit_log.record_change(
                session,
                actor=ACTOR,
                action="tenant.updated",
                target_type="tenant",
                target_id="acme",
                tenant_id="acme",
                before={},
                after={},
                now=T0,
            )
            raise RuntimeError("the change failed after its entry was written")

    with pytest.raises(RuntimeError):
        change_that_fails()
    with database.session() as session:
        page = audit_log.audit_page(
            session, tenant_id=None, start=None, end=None, cursor=None, limit=10
        )
    assert page.records == []


def targets(entries: list[dict[str, Any]]) -> list[str]:
    return [entry["target_id"] for entry in entries]


async def test_listing_filters_by_tenant_and_window_and_pages_newest_first(
    client: httpx.AsyncClient, clock: Clock
) -> None:
    for n, tenant_id in enumerate(["a", "b", "a", "b", "a"]):
        clock.now = T0 + timedelta(hours=n)
        await ok(client.post("/admin/tenants", json={"id": f"{tenant_id}{n}"}), 201)
        await ok(client.patch(f"/admin/tenants/{tenant_id}{n}", json={"name": "x"}))
    assert targets(await listed(client, tenant_id="a2")) == ["a2", "a2"]
    window = {"start": "2025-03-15T13:00:00Z", "end": "2025-03-15T15:00:00Z"}
    assert targets(await listed(client, **window)) == ["a2", "a2", "b1", "b1"]
    first = await ok(client.get("/admin/audit-log", params={"limit": 3}))
    assert targets(first["data"]) == ["a4", "a4", "b3"]
    second = await ok(
        client.get("/admin/audit-log", params={"limit": 3, "cursor": first["next_cursor"]})
    )
    assert targets(second["data"]) == ["b3", "a2", "a2"]
    ids = [e["id"] for e in first["data"] + second["data"]]
    assert ids == sorted(ids, reverse=True)
    assert await listed(client, tenant_id="nobody") == []


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"tenant": "a"}, "tenant"),
        ({"cursor": "x"}, "cursor"),
        ({"limit": "0"}, "limit"),
        ({"start": "yesterday"}, "start"),
        ({"start": "2025-03-02", "end": "2025-03-01"}, "start"),
    ],
)
async def test_bad_listing_parameters_are_400s(
    client: httpx.AsyncClient, params: dict[str, str], param: str
) -> None:
    response = await client.get("/admin/audit-log", params=params)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/admin/audit-log", "/admin/alert-events"])
async def test_a_tenant_filter_no_database_can_hold_finds_nothing(
    client: httpx.AsyncClient, path: str
) -> None:
    """PostgreSQL's text refuses NUL: such a filter must answer an empty page, not a 500."""
    await ok(client.post("/admin/tenants", json={"id": "acme"}), 201)
    response = await client.get(f"{path}?tenant_id=acme%00")
    assert response.status_code == 200, response.text
    assert response.json()["data"] == []

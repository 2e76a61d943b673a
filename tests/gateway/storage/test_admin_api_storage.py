"""Admin API values that reach the database, on SQLite and on PostgreSQL.

PostgreSQL's ``text`` refuses NUL (psycopg raises ``DataError``), and its timestamps end in
year 9999 (UTC): the admin API must refuse such values with a 400, or find nothing (404),
before they reach a query, on both backends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from gateway.api.admin_api import admin_routes
from gateway.errors import EXCEPTION_HANDLERS
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.storage.api_keys import hash_key
from gateway.storage.database import Database
from gateway.storage.tenants import list_tenants

ADMIN_KEY = "admin-" + "p" * 40
NOW = datetime(2025, 3, 15, 12, 0, tzinfo=timezone.utc)


@pytest.fixture
async def client(database: Database) -> AsyncIterator[httpx.AsyncClient]:
    routes = admin_routes(database, hash_key(ADMIN_KEY), MemoryBudgetLedger(), now=lambda: NOW)
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as c:
        assert (await c.post("/admin/tenants", json={"id": "acme"})).status_code == 201
        yield c


def assert_400(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("method", "path", "body", "param"),
    [
        ("POST", "/admin/tenants", {"id": "b", "name": "B\x00"}, "name"),
        ("POST", "/admin/tenants", {"id": "b", "tier": "pro\x00"}, "tier"),
        (
            "POST",
            "/admin/tenants",
            {"id": "b", "quota": {"allowed_models": ["m\x00"]}},
            "quota.allowed_models.0",
        ),
        ("PATCH", "/admin/tenants/acme", {"name": "A\x00"}, "name"),
        ("PATCH", "/admin/tenants/acme", {"tier": "\x00"}, "tier"),
        ("PUT", "/admin/tenants/acme/quota", {"allowed_models": ["m\x00"]}, "allowed_models.0"),
        ("POST", "/admin/tenants/acme/keys", {"name": "ci\x00"}, "name"),
        (
            "POST",
            "/admin/tenants/acme/keys",
            {"expires_at": "9999-12-31T23:00:00-05:00"},
            "expires_at",
        ),
    ],
)
async def test_values_the_database_cannot_store_are_400s(
    client: httpx.AsyncClient,
    database: Database,
    method: str,
    path: str,
    body: dict[str, Any],
    param: str,
) -> None:
    response = await client.request(method, path, json=body)
    assert_400(response, param)
    with database.session() as session:
        tenants = list_tenants(session, include_deleted=True)
    assert [(t.id, t.name, t.tier) for t in tenants] == [("acme", "", "standard")]
    keys = await client.get("/admin/tenants/acme/keys")
    assert keys.status_code == 200
    assert keys.json()["data"] == []


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/tenants/ac%00me"),
        ("PATCH", "/admin/tenants/ac%00me"),
        ("DELETE", "/admin/tenants/ac%00me"),
        ("PUT", "/admin/tenants/ac%00me/quota"),
        ("GET", "/admin/tenants/ac%00me/budget"),
        ("POST", "/admin/tenants/ac%00me/keys"),
        ("GET", "/admin/tenants/ac%00me/keys"),
        ("DELETE", "/admin/keys/key_%00"),
        ("GET", "/admin/usage?tenant_id=ac%00me"),
        ("GET", "/admin/usage/summary?tenant_id=ac%00me"),
    ],
)
async def test_ids_with_nul_find_nothing(client: httpx.AsyncClient, method: str, path: str) -> None:
    response = await client.request(method, path, json={})
    assert response.status_code == 404, response.text
    assert response.json()["error"]["type"] == "not_found_error"

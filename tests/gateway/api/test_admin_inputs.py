"""Path ids on the admin API, through the real routes and a migrated SQLite file."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette

from gateway.api.admin_api import admin_routes
from gateway.errors import EXCEPTION_HANDLERS
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.storage.api_keys import hash_key
from gateway.storage.database import Database

ADMIN_KEY = "admin-" + "x" * 40


@pytest.fixture
async def client(db: Database) -> AsyncIterator[httpx.AsyncClient]:
    app = Starlette(
        routes=admin_routes(db, hash_key(ADMIN_KEY), MemoryBudgetLedger()),
        exception_handlers=EXCEPTION_HANDLERS,
    )
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as c:
        created = await c.post("/admin/tenants", json={"id": "a"})
        assert created.status_code == 201, created.text
        assert (await c.post("/admin/tenants/a/keys")).status_code == 201
        yield c


@pytest.mark.parametrize(
    ("method", "path", "param"),
    [
        ("GET", "/admin/tenants/a%2Fkeys", "tenant_id"),
        ("POST", "/admin/tenants/a%2fkeys", "tenant_id"),
        ("PUT", "/admin/tenants/a%2Fquota", "tenant_id"),
        ("GET", "/admin/tenants/a%2Fbudget", "tenant_id"),
        ("GET", "/admin/tenants/a%5Ckeys", "tenant_id"),
        ("DELETE", "/admin/tenants/a%5c", "tenant_id"),
    ],
)
async def test_an_encoded_slash_in_a_path_id_is_400(
    client: httpx.AsyncClient, method: str, path: str, param: str
) -> None:
    response = await client.request(method, path, json={})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_path"
    assert error["param"] == param
    assert "%2F" in error["message"]
    assert (await client.get("/admin/tenants/a")).json()["deleted_at"] is None


async def test_an_encoded_slash_in_the_query_string_is_no_path_id(
    client: httpx.AsyncClient,
) -> None:
    response = await client.get("/admin/tenants/a?note=x%2Fy")
    assert response.status_code == 200, response.text
    assert response.json()["id"] == "a"


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/tenants/{id}"),
        ("DELETE", "/admin/tenants/{id}"),
        ("GET", "/admin/tenants/{id}/keys"),
        ("DELETE", "/admin/keys/{id}"),
        ("GET", "/admin/usage?tenant_id={id}"),
    ],
)
async def test_a_404_echoes_a_bounded_prefix_of_the_id(
    client: httpx.AsyncClient, method: str, path: str
) -> None:
    long_id = "x" * 5_000
    response = await client.request(method, path.format(id=long_id))
    assert response.status_code == 404, response.text
    message = response.json()["error"]["message"]
    assert "x" * 64 + "..." in message
    assert "x" * 65 not in message
    assert len(message) < 100

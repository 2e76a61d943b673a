"""The admin API over a real migrated SQLite file, through httpx's ASGI transport."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from gateway.api.admin_api import admin_routes
from gateway.api.admin_schemas import Quota
from gateway.api.openapi import openapi_document, openapi_route
from gateway.api.tenant_api import tenant_routes
from gateway.errors import EXCEPTION_HANDLERS
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.storage.api_keys import authenticate, hash_key, list_keys
from gateway.storage.database import Database
from gateway.storage.models import UsageStatus
from gateway.storage.tenants import list_tenants
from gateway.storage.usage_store import UsageEntry, insert_usage
from policies.quota import TenantQuota

ADMIN_KEY = "admin-" + "x" * 40
NOW = datetime(2025, 3, 15, 12, 0, tzinfo=timezone.utc)
T0 = datetime(2025, 3, 1, 0, 0, tzinfo=timezone.utc)


@pytest.fixture
def app(db: Database) -> Starlette:
    ledger = MemoryBudgetLedger()
    routes = admin_routes(db, hash_key(ADMIN_KEY), ledger, now=lambda: NOW)
    routes += tenant_routes(db, ledger, now=lambda: NOW)
    return Starlette(routes=[*routes, openapi_route(routes)], exception_handlers=EXCEPTION_HANDLERS)


@pytest.fixture
async def client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as c:
        yield c


def entry(n: int, **fields: Any) -> UsageEntry:
    values: dict[str, Any] = {
        "request_id": f"req-{n}",
        "tenant_id": "acme",
        "key_id": "key_1",
        "requested_model": "auto",
        "served_model": "small",
        "routing_decision": "default",
        "prompt_tokens": 100,
        "cached_tokens": 40,
        "completion_tokens": 10,
        "cost_micros": 1234,
        "status": UsageStatus.COMPLETED,
        "reject_reason": None,
        "streamed": True,
        "created_at": T0 + timedelta(minutes=n),
        "finished_at": None,
        "ttft_ms": None,
    }
    return UsageEntry(**{**values, **fields})


def iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def insert(db: Database, entries: list[UsageEntry]) -> None:
    with db.transaction() as session:
        insert_usage(session, entries)


def jsonable(record: UsageEntry) -> dict[str, Any]:
    data = record.to_json_dict()
    return {
        k: iso(getattr(record, k)) if isinstance(getattr(record, k), datetime) else v
        for k, v in data.items()
    }


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    return dict(error)


async def create(client: httpx.AsyncClient, tenant_id: str, **body: Any) -> dict[str, Any]:
    response = await client.post("/admin/tenants", json={"id": tenant_id, **body})
    assert response.status_code == 201, response.text
    return dict(response.json())


# --- auth ---------------------------------------------------------------------------------


def admin_requests(app: Starlette) -> list[tuple[str, str]]:
    paths = []
    for route in app.routes:
        if isinstance(route, Route) and route.path.startswith("/admin"):
            path = route.path.replace("{tenant_id}", "acme").replace("{key_id}", "key_1")
            path = path.replace("{user}", "alice")
            paths += [(method, path) for method in sorted(route.methods or ()) if method != "HEAD"]
    return paths


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong", f"Basic {ADMIN_KEY}", f"Bearer {ADMIN_KEY}x", "Bearer "],
)
async def test_every_admin_route_refuses_a_missing_or_wrong_key(
    app: Starlette, client: httpx.AsyncClient, db: Database, authorization: str | None
) -> None:
    await create(client, "acme")
    requests = admin_requests(app)
    assert len(requests) == 20
    for method, path in requests:
        headers = {"Authorization": authorization} if authorization else {}
        client.headers.pop("Authorization", None)
        response = await client.request(method, path, headers=headers, json={"name": "x"})
        error = assert_error(response, 401)
        assert error["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
        assert ADMIN_KEY not in response.text
    with db.session() as session:  # nothing changed
        assert [t.name for t in list_tenants(session, include_deleted=True)] == [""]
        assert list_keys(session, "acme") == []


async def test_a_tenant_key_is_known_but_not_allowed(client: httpx.AsyncClient) -> None:
    """A live tenant key: 403 (the caller is known, the operation is not theirs); a revoked
    or made-up key of the same shape: 401, as any unknown key."""
    await create(client, "acme")
    created = (await client.post("/admin/tenants/acme/keys")).json()
    key = created["key"]
    response = await client.get("/admin/tenants", headers={"Authorization": f"Bearer {key}"})
    error = assert_error(response, 403)
    assert (error["type"], error["code"]) == ("permission_error", "insufficient_permissions")
    assert "admin key" in error["message"]
    assert key not in response.text
    made_up = "tw-" + "A" * (len(key) - 3)
    for token in (made_up, key[:-1], key + "x"):
        response = await client.get("/admin/tenants", headers={"Authorization": f"Bearer {token}"})
        assert assert_error(response, 401)["code"] == "invalid_api_key"
    await client.delete(f"/admin/keys/{created['id']}")
    response = await client.get("/admin/tenants", headers={"Authorization": f"Bearer {key}"})
    assert assert_error(response, 401)["code"] == "invalid_api_key"


def test_the_admin_key_hash_must_be_a_sha256_hex_digest(db: Database) -> None:
    for bad in ("", "admin", "z" * 64, hash_key("k")[:-1]):
        with pytest.raises(ValueError, match="SHA-256"):
            admin_routes(db, bad, MemoryBudgetLedger())
    assert admin_routes(db, hash_key("k").upper(), MemoryBudgetLedger())


# --- tenants ------------------------------------------------------------------------------


async def test_tenant_create_read_update_delete(client: httpx.AsyncClient) -> None:
    created = await create(client, "b-corp", name="B", tier="pro", quota={"rpm": 60})
    assert created["object"] == "tenant"
    assert created["name"] == "B"
    assert created["tier"] == "pro"
    assert created["quota"] == {**TenantQuota(rpm=60, tier="pro").to_dict()}
    assert created["created_at"] == created["updated_at"] == iso(NOW)
    await create(client, "a-corp")

    assert (await client.get("/admin/tenants/b-corp")).json() == created
    listed = (await client.get("/admin/tenants")).json()
    assert listed["object"] == "list"
    assert [t["id"] for t in listed["data"]] == ["a-corp", "b-corp"]

    patched = await client.patch("/admin/tenants/b-corp", json={"name": "Bee", "tier": "free"})
    assert patched.status_code == 200
    assert (patched.json()["name"], patched.json()["tier"]) == ("Bee", "free")
    assert patched.json()["quota"]["tier"] == "free"
    assert patched.json()["quota"]["rpm"] == 60
    renamed = await client.patch("/admin/tenants/b-corp", json={"name": "B2"})
    assert (renamed.json()["name"], renamed.json()["tier"]) == ("B2", "free")

    deleted = await client.delete("/admin/tenants/b-corp")
    assert deleted.json() == {"id": "b-corp", "object": "tenant", "deleted": True}
    assert_error(await client.get("/admin/tenants/b-corp"), 404)
    assert_error(await client.patch("/admin/tenants/b-corp", json={"name": "x"}), 404)
    assert_error(await client.delete("/admin/tenants/b-corp"), 404)
    assert [t["id"] for t in (await client.get("/admin/tenants")).json()["data"]] == ["a-corp"]
    everyone = (await client.get("/admin/tenants?include_deleted=true")).json()["data"]
    assert [(t["id"], t["deleted_at"]) for t in everyone] == [
        ("a-corp", None),
        ("b-corp", iso(NOW)),
    ]
    assert_error(await client.get("/admin/tenants?include_deleted=maybe"), 400, "include_deleted")
    assert_error(await client.get("/admin/tenants?deleted=true"), 400, "deleted")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"id": "has space"}, "id"),
        ({"id": "x" * 65}, "id"),
        ({"id": ""}, "id"),
        ({}, "id"),
        ({"id": "acme", "name": 5}, "name"),
        ({"id": "acme", "tier": ""}, "tier"),
        ({"id": "acme", "tier": "   "}, "tier"),
        ({"id": "acme", "tier": "pro\u0000"}, "tier"),
        ({"id": "acme", "name": "A\u0000corp"}, "name"),
        ({"id": "acme", "colour": "red"}, "colour"),
        ({"id": "acme", "quota": {"rpm": 0}}, "quota.rpm"),
        ({"id": "acme", "quota": {"rpm": "5"}}, "quota.rpm"),
        ({"id": "acme", "quota": {"tier": "pro"}}, "quota.tier"),
        ({"id": "acme", "quota": []}, "quota"),
    ],
)
async def test_bad_tenant_bodies_are_400s_naming_the_field(
    client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    assert_error(await client.post("/admin/tenants", json=body), 400, param)
    assert (await client.get("/admin/tenants")).json()["data"] == []


async def test_malformed_json_and_duplicates(client: httpx.AsyncClient) -> None:
    for content in (b"{not json", b"[1, 2]", b"", b"\xff"):
        response = await client.post("/admin/tenants", content=content)
        assert assert_error(response, 400)["code"] == "invalid_json"
    await create(client, "acme")
    error = assert_error(await client.post("/admin/tenants", json={"id": "acme"}), 409, "id")
    assert error["code"] == "tenant_exists"
    await client.delete("/admin/tenants/acme")
    assert_error(await client.post("/admin/tenants", json={"id": "acme"}), 409, "id")
    error = assert_error(await client.patch("/admin/tenants/x", json={"quota": {}}), 400, "quota")
    assert "PUT /admin/tenants/{tenant_id}/quota" in error["message"]
    response = await client.put("/admin/tenants")  # no such method: still OpenAI's format
    assert_error(response, 405)


# --- quotas -------------------------------------------------------------------------------


async def test_put_quota_replaces_the_whole_quota(client: httpx.AsyncClient) -> None:
    await create(client, "acme", tier="pro", quota={"rpm": 60, "tpm": 1000})
    body = {
        "budget_tokens": 1_000_000,
        "budget_period": "day",
        "max_output_tokens": 4096,
        "default_max_output_tokens": 1024,
        "max_prompt_tokens": 8000,
        "rpm": 120,
        "allowed_models": ["small", "large"],
        "priority": "batch",
    }
    response = await client.put("/admin/tenants/acme/quota", json=body)
    assert response.status_code == 200, response.text
    expected = TenantQuota.from_dict({**body, "tier": "pro"}).to_dict()
    assert response.json() == expected
    assert expected["tpm"] is None  # omitted: back to the default
    assert (await client.get("/admin/tenants/acme")).json()["quota"] == expected

    reset = await client.put("/admin/tenants/acme/quota", json={})
    assert reset.json() == TenantQuota(tier="pro").to_dict()
    assert_error(await client.put("/admin/tenants/nobody/quota", json={}), 404)


@pytest.mark.parametrize(
    ("quota", "param"),
    [
        ({"rpm": 0}, "rpm"),
        ({"tpm": -5}, "tpm"),
        ({"budget_tokens": 1.5}, "budget_tokens"),
        ({"budget_tokens": True}, "budget_tokens"),
        ({"max_prompt_tokens": "100"}, "max_prompt_tokens"),
        ({"budget_period": "week"}, "budget_period"),
        ({"priority": "urgent"}, "priority"),
        ({"max_output_tokens": 100, "default_max_output_tokens": 200}, "default_max_output_tokens"),
        ({"allowed_models": "small"}, "allowed_models"),
        ({"allowed_models": ["small", ""]}, "allowed_models.1"),
        ({"allowed_models": [" "]}, "allowed_models.0"),
        ({"allowed_models": ["sm\u0000all"]}, "allowed_models.0"),
        ({"allowed_models": [1]}, "allowed_models.0"),
        ({"clamp_max_output": "yes"}, "clamp_max_output"),
        ({"rpm": 2**53}, "rpm"),  # beyond what a JSON number (or Redis' Lua) holds exactly
        ({"budget_tokens": 2**64}, "budget_tokens"),
        ({"tpm": 5.5}, "tpm"),
        ({"tier": "pro"}, "tier"),
        ({"burst": 5}, "burst"),
    ],
)
async def test_invalid_quotas_are_400s_naming_the_field(
    client: httpx.AsyncClient, quota: dict[str, Any], param: str
) -> None:
    await create(client, "acme", quota={"rpm": 7})
    assert_error(await client.put("/admin/tenants/acme/quota", json=quota), 400, param)
    assert (await client.get("/admin/tenants/acme")).json()["quota"]["rpm"] == 7


async def test_an_integral_number_is_an_integer(client: httpx.AsyncClient) -> None:
    """JSON Schema's ``integer`` includes 5.0, and the document is the contract."""
    await create(client, "acme")
    response = await client.put("/admin/tenants/acme/quota", json={"rpm": 60.0, "tpm": 2**53 - 1})
    assert response.status_code == 200, response.text
    assert (response.json()["rpm"], response.json()["tpm"]) == (60, 2**53 - 1)


def test_the_quota_body_has_every_tenant_quota_field_but_the_tier() -> None:
    tenant_quota_fields = {f.name for f in dataclasses.fields(TenantQuota)}
    assert set(Quota.model_fields) == tenant_quota_fields - {"tier"}
    defaults = TenantQuota().to_dict()
    assert {name: defaults[name] for name in Quota.model_fields} == Quota().model_dump()


# --- keys ---------------------------------------------------------------------------------


async def test_a_key_is_shown_once_listed_by_prefix_and_revoked_at_once(
    client: httpx.AsyncClient, db: Database
) -> None:
    await create(client, "acme")
    response = await client.post(
        "/admin/tenants/acme/keys", json={"name": "ci", "priority": "batch"}
    )
    assert response.status_code == 201
    assert response.headers["cache-control"] == "no-store"
    created = response.json()
    key = created["key"]
    assert key.startswith("tw-")
    assert created["prefix"] == key[:12]
    assert created["name"] == "ci"
    assert created["priority"] == "batch"
    assert created["revoked_at"] is None
    second = (await client.post("/admin/tenants/acme/keys")).json()  # an empty body is fine

    listed = await client.get("/admin/tenants/acme/keys")  # same created_at: then by id
    prefixes = {k["id"]: k["prefix"] for k in listed.json()["data"]}
    assert prefixes == {created["id"]: key[:12], second["id"]: second["key"][:12]}
    assert key not in listed.text
    assert hash_key(key) not in listed.text
    assert "key" not in listed.json()["data"][0]
    assert "key_hash" not in listed.json()["data"][0]
    with db.session() as session:
        found = authenticate(session, key)
        assert found is not None
        assert found.key.id == created["id"]

    revoked = await client.delete(f"/admin/keys/{created['id']}")
    assert revoked.status_code == 200
    assert revoked.json()["revoked_at"] == iso(NOW)
    assert "key" not in revoked.json()
    with db.session() as session:
        assert authenticate(session, key) is None
        assert authenticate(session, second["key"]) is not None
    again = await client.delete(f"/admin/keys/{created['id']}")  # idempotent
    assert again.status_code == 200
    assert again.json() == revoked.json()
    listed_after = (await client.get("/admin/tenants/acme/keys")).json()["data"]
    revoked_at = {k["id"]: k["revoked_at"] for k in listed_after}
    assert revoked_at == {created["id"]: iso(NOW), second["id"]: None}
    assert_error(await client.delete("/admin/keys/key_nope"), 404)


async def test_key_errors(client: httpx.AsyncClient) -> None:
    assert_error(await client.post("/admin/tenants/nobody/keys"), 404)
    assert_error(await client.get("/admin/tenants/nobody/keys"), 404)
    await create(client, "acme")
    past = (NOW - timedelta(days=1)).isoformat()
    for body, param in [
        ({"expires_at": past}, "expires_at"),
        ({"expires_at": "2030-01-01T00:00:00"}, "expires_at"),  # no time zone
        ({"expires_at": "soon"}, "expires_at"),
        ({"expires_at": "9999-12-31T23:00:00-05:00"}, "expires_at"),  # year 10000 in UTC
        ({"expires_at": "0001-01-01T00:00:00+05:00"}, "expires_at"),  # year 0 in UTC
        ({"expires_at": 1893456000}, "expires_at"),  # a number is not a date-time
        ({"expires_at": "1893456000"}, "expires_at"),
        ({"expires_at": "2030-01-01"}, "expires_at"),
        ({"name": "ci\u0000"}, "name"),
        ({"priority": "urgent"}, "priority"),
        ({"name": None}, "name"),
    ]:
        assert_error(await client.post("/admin/tenants/acme/keys", json=body), 400, param)
    expiring = await client.post(
        "/admin/tenants/acme/keys", json={"expires_at": "2030-01-01T00:00:00Z"}
    )
    assert expiring.json()["expires_at"] == "2030-01-01T00:00:00Z"
    latest = await client.post(
        "/admin/tenants/acme/keys", json={"expires_at": "9999-12-31T18:59:59-05:00"}
    )
    assert latest.json()["expires_at"] == "9999-12-31T23:59:59Z"
    assert len((await client.get("/admin/tenants/acme/keys")).json()["data"]) == 2


async def test_deleting_a_tenant_stops_its_keys(client: httpx.AsyncClient, db: Database) -> None:
    await create(client, "acme")
    key = (await client.post("/admin/tenants/acme/keys")).json()["key"]
    await client.delete("/admin/tenants/acme")
    with db.session() as session:
        assert authenticate(session, key) is None


# --- usage --------------------------------------------------------------------------------


def parse_records(response: httpx.Response, format_: str) -> tuple[list[str], str | None]:
    """(request ids, next cursor) of one usage response."""
    assert response.status_code == 200, response.text
    if format_ == "json":
        body = response.json()
        return [r["request_id"] for r in body["data"]], body["next_cursor"]
    cursor = response.headers.get("x-next-cursor")
    if format_ == "jsonl":
        assert response.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line)["request_id"] for line in response.text.splitlines()], cursor
    assert response.headers["content-type"] == "text/csv; charset=utf-8"
    rows = list(csv.DictReader(io.StringIO(response.text)))
    return [row["request_id"] for row in rows], cursor


async def read_all(
    client: httpx.AsyncClient, path: str, format_: str, **params: Any
) -> tuple[list[str], int]:
    """Every request id over all pages, and the number of pages."""
    seen: list[str] = []
    cursor: str | None = None
    num_pages = 0
    while True:
        query = {**params, "format": format_, **({"cursor": cursor} if cursor else {})}
        ids, cursor = parse_records(await client.get(path, params=query), format_)
        seen += ids
        num_pages += 1
        if cursor is None:
            return seen, num_pages


@pytest.mark.parametrize("format_", ["json", "jsonl", "csv"])
async def test_usage_pages_return_every_record_exactly_once(
    client: httpx.AsyncClient, db: Database, format_: str
) -> None:
    await create(client, "even")
    await create(client, "odd")
    insert(db, [entry(n, tenant_id="even" if n % 2 == 0 else "odd") for n in range(25)])
    seen, num_pages = await read_all(client, "/admin/usage", format_, limit=4)
    assert seen == [f"req-{n}" for n in range(25)]
    assert num_pages == 7

    evens, _ = await read_all(client, "/admin/usage", format_, limit=5, tenant_id="even")
    assert evens == [f"req-{n}" for n in range(0, 25, 2)]
    window = {"start": (T0 + timedelta(minutes=3)).isoformat(), "end": "2025-03-01T00:10:00Z"}
    windowed, _ = await read_all(client, "/admin/usage", format_, limit=3, **window)
    assert windowed == [f"req-{n}" for n in range(3, 10)]


async def test_an_empty_window_is_valid_and_empty(client: httpx.AsyncClient, db: Database) -> None:
    await create(client, "acme")
    insert(db, [entry(n) for n in range(3)])
    moment = iso(T0 + timedelta(minutes=1))  # exactly when req-1 was created
    for format_ in ("json", "jsonl", "csv"):
        response = await client.get(
            "/admin/usage", params={"start": moment, "end": moment, "format": format_}
        )
        assert parse_records(response, format_) == ([], None)
    summary = await client.get("/admin/usage/summary", params={"start": moment, "end": moment})
    assert summary.status_code == 200
    assert summary.json()["data"] == []


async def test_ids_that_no_database_can_hold_are_404s(client: httpx.AsyncClient) -> None:
    await create(client, "acme")
    for method, path in [
        ("GET", "/admin/tenants/ac%00me"),
        ("PATCH", "/admin/tenants/ac%00me"),
        ("DELETE", "/admin/tenants/ac%00me"),
        ("PUT", "/admin/tenants/ac%00me/quota"),
        ("GET", "/admin/tenants/ac%00me/budget"),
        ("POST", "/admin/tenants/ac%00me/keys"),
        ("GET", "/admin/tenants/ac%00me/keys"),
        ("DELETE", "/admin/keys/key_%00"),
    ]:
        response = await client.request(method, path, json={})
        assert response.status_code == 404, (method, path, response.text)
    for path in ("/admin/usage", "/admin/usage/summary"):
        response = await client.get(path, params={"tenant_id": "ac\x00me"})
        assert_error(response, 404, "tenant_id")


async def test_usage_records_carry_every_field(client: httpx.AsyncClient, db: Database) -> None:
    record = entry(
        1,
        status=UsageStatus.REJECTED,
        reject_reason="budget, exhausted",  # a comma, quoted in CSV
        served_model=None,
        streamed=False,
        finished_at=T0 + timedelta(seconds=61),
        ttft_ms=12,
    )
    answered = entry(2, finish_reason="tool_calls")
    insert(db, [record, answered])
    as_json = (await client.get("/admin/usage")).json()["data"]
    exported = [{**jsonable(record), "id": 1}, {**jsonable(answered), "id": 2}]
    assert as_json == exported
    assert [r["finish_reason"] for r in as_json] == [None, "tool_calls"]
    as_jsonl = (await client.get("/admin/usage?format=jsonl")).text
    assert [json.loads(line) for line in as_jsonl.splitlines()] == as_json
    rows = list(csv.DictReader(io.StringIO((await client.get("/admin/usage?format=csv")).text)))
    assert rows == [
        {
            name: ""
            if value is None
            else str(value).lower()
            if isinstance(value, bool)
            else str(value)
            for name, value in stored.items()
        }
        for stored in exported
    ]
    assert list(rows[0])[-1] == "id"  # appended: the older columns keep their positions
    assert rows[1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("format_", ["jsonl", "csv"])
async def test_exports_without_a_limit_stream_everything(
    client: httpx.AsyncClient, db: Database, format_: str
) -> None:
    insert(db, [entry(n, created_at=T0 + timedelta(seconds=n)) for n in range(2500)])
    response = await client.get("/admin/usage", params={"format": format_, "cursor": 10})
    ids, cursor = parse_records(response, format_)
    assert ids == [f"req-{n}" for n in range(10, 2500)]
    assert cursor is None
    page = (await client.get("/admin/usage")).json()
    assert len(page["data"]) == 100
    assert page["next_cursor"] == 100


@pytest.mark.parametrize(
    ("query", "param", "status"),
    [
        ("start=yesterday", "start", 400),
        ("end=2025-13-01", "end", 400),
        ("start=2025-03-02&end=2025-03-01", "start", 400),
        ("start=", "start", 400),
        ("end=", "end", 400),
        ("cursor=", "cursor", 400),
        ("limit=", "limit", 400),
        ("format=", "format", 400),
        ("cursor=-1", "cursor", 400),
        ("cursor=abc", "cursor", 400),
        ("cursor=%C2%B2", "cursor", 400),  # a digit to str.isdigit, not to int()
        ("start=0001-01-01T00:00:00%2B05:00", "start", 400),
        ("cursor=99999999999999999999", "cursor", 400),
        ("limit=0", "limit", 400),
        ("limit=1001", "limit", 400),
        ("limit=ten", "limit", 400),
        ("format=xml", "format", 400),
        ("tenant_id=nobody", "tenant_id", 404),
        ("tenant=acme", "tenant", 400),  # a misspelt filter must not answer for everyone
        ("=1", "", 400),
    ],
)
async def test_bad_usage_queries_are_4xx(
    client: httpx.AsyncClient, query: str, param: str, status: int
) -> None:
    assert_error(await client.get(f"/admin/usage?{query}"), status, param)


async def test_usage_summary_totals_per_tenant_and_model(
    client: httpx.AsyncClient, db: Database
) -> None:
    await create(client, "acme")
    await create(client, "bolt")
    today = NOW.replace(hour=1)
    insert(
        db,
        [
            entry(1, created_at=today, prompt_tokens=100, completion_tokens=10),
            entry(2, created_at=today, served_model="large", prompt_tokens=50, cost_micros=5),
            entry(3, created_at=today - timedelta(days=3), completion_tokens=7),
            entry(4, created_at=datetime(2025, 2, 10, tzinfo=timezone.utc)),
            entry(5, tenant_id="bolt", created_at=today, prompt_tokens=1, cached_tokens=0),
        ],
    )

    async def summary(**params: Any) -> dict[str, Any]:
        response = await client.get("/admin/usage/summary", params=params)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def rows(body: dict[str, Any]) -> dict[tuple[str, str], tuple[int, int, int]]:
        return {
            (r["tenant_id"], r["served_model"]): (
                r["num_requests"],
                r["total_tokens"],
                r["cost_micros"],
            )
            for r in body["data"]
        }

    day = await summary(period="day")
    assert (day["period"], day["start"], day["end"]) == (
        "day",
        "2025-03-15T00:00:00Z",
        "2025-03-16T00:00:00Z",
    )
    assert rows(day) == {
        ("acme", "small"): (1, 110, 1234),
        ("acme", "large"): (1, 60, 5),
        ("bolt", "small"): (1, 11, 1234),
    }
    month = await summary(tenant_id="acme")  # month by default
    assert month["period"] == "month"
    assert month["start"] == "2025-03-01T00:00:00Z"
    assert rows(month) == {("acme", "small"): (2, 217, 2468), ("acme", "large"): (1, 60, 5)}
    total = await summary(period="total", tenant_id="acme")
    assert (total["start"], total["end"]) == (None, None)
    assert rows(total)[("acme", "small")] == (3, 327, 3702)
    explicit = await summary(start="2025-02-01", end="2025-03-13")
    assert explicit["period"] is None
    assert rows(explicit) == {("acme", "small"): (2, 217, 2468)}
    entry_fields = month["data"][0]
    assert {"prompt_tokens", "cached_tokens", "completion_tokens"} <= set(entry_fields)

    bad = [("period=week", "period", 400), ("period=day&start=2025-03-01", "period", 400)]
    bad += [("start=03/01/2025", "start", 400), ("tenant_id=nobody", "tenant_id", 404)]
    bad += [
        ("tenant=acme", "tenant", 400),
        ("limit=5", "limit", 400),
        ("period=", "period", 400),
        ("start=", "start", 400),
        ("period=&end=2025-03-02", "period", 400),
    ]
    for query, param, status in bad:
        assert_error(await client.get(f"/admin/usage/summary?{query}"), status, param)


# --- OpenAPI ------------------------------------------------------------------------------


async def test_the_openapi_document_lists_every_endpoint(
    app: Starlette, client: httpx.AsyncClient
) -> None:
    response = await client.get("/openapi.json", headers={"Authorization": ""})
    assert response.status_code == 200
    document = response.json()
    assert document["openapi"].startswith("3.")
    operations = {
        (path, method): operation
        for path, item in document["paths"].items()
        for method, operation in item.items()
    }
    expected = {
        (route.path, method.lower())
        for route in app.routes
        if isinstance(route, Route) and route.include_in_schema
        for method in route.methods or ()
        if method != "HEAD"
    }
    assert len(expected) == 22
    assert set(operations) == expected
    for (path, method), operation in operations.items():
        assert operation["summary"]
        success = [code for code in operation["responses"] if code.startswith("2")]
        assert success, (path, method)
        assert "$ref" in operation["responses"][success[0]]["content"]["application/json"]["schema"]
        assert "401" in operation["responses"]
        path_ids = {"#/components/parameters/TenantId", "#/components/parameters/KeyId"}
        if path_ids & {p["$ref"] for p in operation.get("parameters", [])}:
            # An encoded '/' or '\' in the path (admin_inputs.path_id) is a 400.
            assert "400" in operation["responses"], (path, method)
        scheme = "adminKey" if path.startswith("/admin") else "tenantKey"
        assert operation["security"] == [{scheme: []}]
        if method in ("post", "put", "patch") and path != "/admin/tenants/{tenant_id}/keys":
            assert operation["requestBody"]["required"] is True
    assert "text/csv" in operations[("/v1/usage", "get")]["responses"]["200"]["content"]
    record = document["components"]["schemas"]["ExportedUsage"]
    assert record["properties"]["finish_reason"]["anyOf"] == [{"type": "string"}, {"type": "null"}]
    assert record["properties"]["id"] == {"type": "integer", "title": "Id"}
    assert "id" in record["required"]
    page = document["components"]["schemas"]["UsageList"]["properties"]
    assert page["has_more"]["type"] == "boolean"
    assert page["resume_cursor"]["anyOf"] == [{"type": "integer"}, {"type": "null"}]
    assert_refs_resolve(document, document)


def assert_refs_resolve(node: Any, document: dict[str, Any]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            target: Any = document
            for part in ref.removeprefix("#/").split("/"):
                assert part in target, f"unresolved {ref}"
                target = target[part]
        for value in node.values():
            assert_refs_resolve(value, document)
    elif isinstance(node, list):
        for value in node:
            assert_refs_resolve(value, document)


def test_plain_openapi_docstrings_pass_through_and_others_are_skipped() -> None:
    async def undocumented(request: Any) -> Any: ...

    async def health(request: Any) -> Any:
        """Liveness.
        ---
        responses: {"200": {description: OK}}
        """

    document = openapi_document([Route("/plain", undocumented), Route("/health", health)])
    assert document["paths"] == {
        "/health": {"get": {"summary": "Liveness.", "responses": {"200": {"description": "OK"}}}}
    }


# --- pages, ids and names -------------------------------------------------------------------


async def walk(client: httpx.AsyncClient, path: str, limit: int, **query: str) -> list[str]:
    """Every id of a listing, page by page through ``next_cursor``."""
    ids: list[str] = []
    cursor = None
    while True:
        params = {**query, "limit": str(limit)} | ({} if cursor is None else {"cursor": cursor})
        response = await client.get(path, params=params)
        assert response.status_code == 200, response.text
        page = response.json()
        assert len(page["data"]) <= limit
        ids += [item["id"] for item in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            return ids
        assert cursor == page["data"][-1]["id"]


async def test_tenant_pages_walk_every_tenant_once(client: httpx.AsyncClient, db: Database) -> None:
    ids = [f"t{n:03d}" for n in range(103)] + ["Zeta", "alpha", "Beta.x", "b_corp"]
    for tenant_id in ids:
        await create(client, tenant_id)
    await client.delete("/admin/tenants/t007")
    with db.session() as session:
        expected = [t.id for t in list_tenants(session)]
        everyone = [t.id for t in list_tenants(session, include_deleted=True)]
    for limit in (1, 7, 106, 1000):
        assert await walk(client, "/admin/tenants", limit) == expected
    assert await walk(client, "/admin/tenants", 10, include_deleted="true") == everyone
    assert len(set(everyone)) == len(ids)

    first = (await client.get("/admin/tenants")).json()
    assert len(first["data"]) == 100  # the default page, as the usage export's
    assert first["next_cursor"] == expected[99]
    rest = (await client.get("/admin/tenants", params={"cursor": first["next_cursor"]})).json()
    assert [t["id"] for t in rest["data"]] == expected[100:]
    assert rest["next_cursor"] is None
    for query in ("limit=0", "limit=1001", "limit=", "limit=ten", "limit=-1", "limit=1.5"):
        assert_error(await client.get(f"/admin/tenants?{query}"), 400, "limit")
    for query in ("cursor=", f"cursor={'x' * 65}", "cursor=a%00b"):
        assert_error(await client.get(f"/admin/tenants?{query}"), 400, "cursor")


async def test_key_pages_walk_every_key_once(client: httpx.AsyncClient) -> None:
    await create(client, "acme")
    await create(client, "other")
    created = [(await client.post("/admin/tenants/acme/keys")).json()["id"] for _ in range(7)]
    other_key = (await client.post("/admin/tenants/other/keys")).json()["id"]
    listed = (await client.get("/admin/tenants/acme/keys")).json()
    assert sorted(k["id"] for k in listed["data"]) == sorted(created)
    assert listed["next_cursor"] is None
    everything = [k["id"] for k in listed["data"]]
    for limit in (1, 3, 7):
        assert await walk(client, "/admin/tenants/acme/keys", limit) == everything
    for query in ("limit=0", "limit=1001", "limit="):
        assert_error(await client.get(f"/admin/tenants/acme/keys?{query}"), 400, "limit")
    for cursor in ("key_nope", other_key, ""):
        response = await client.get("/admin/tenants/acme/keys", params={"cursor": cursor})
        assert_error(response, 400, "cursor")
    assert_error(await client.get("/admin/tenants/acme/keys?after=x"), 400, "after")
    assert_error(await client.get("/admin/tenants/nobody/keys?limit=2"), 404)


async def test_tenant_ids_differing_only_in_case_cannot_coexist(client: httpx.AsyncClient) -> None:
    await create(client, "acme")
    for variant in ("Acme", "ACME"):
        error = assert_error(await client.post("/admin/tenants", json={"id": variant}), 409, "id")
        assert error["code"] == "tenant_exists"
        assert "'acme'" in error["message"]
        assert "case" in error["message"]
    assert [t["id"] for t in (await client.get("/admin/tenants")).json()["data"]] == ["acme"]
    await create(client, "Widget")  # an id keeps its spelling
    assert (await client.get("/admin/tenants/Widget")).json()["id"] == "Widget"
    assert_error(await client.post("/admin/tenants", json={"id": "widget"}), 409, "id")


async def test_names_are_nfc_normalized(client: httpx.AsyncClient) -> None:
    composed, decomposed = "Caf\u00e9 M\u00fcller", "Cafe\u0301 Mu\u0308ller"
    assert composed != decomposed
    assert (await create(client, "acme", name=decomposed))["name"] == composed
    assert (await client.get("/admin/tenants/acme")).json()["name"] == composed
    await create(client, "other", name=composed)
    patched = await client.patch("/admin/tenants/other", json={"name": "Cre\u0300me"})
    assert patched.json()["name"] == "Cr\u00e8me"
    key = await client.post("/admin/tenants/acme/keys", json={"name": decomposed})
    assert key.json()["name"] == composed
    listed = (await client.get("/admin/tenants/acme/keys")).json()["data"]
    assert [k["name"] for k in listed] == [composed]


INVISIBLE = [
    *(chr(c) for c in range(0x202A, 0x202F)),  # embeddings and overrides
    *(chr(c) for c in range(0x2066, 0x206A)),  # isolates
    "\u200e",  # left-to-right mark
    "\u200f",  # right-to-left mark
    "\u200b",  # zero-width space
    "\u200c",  # zero-width non-joiner
    "\u200d",  # zero-width joiner
    "\u2060",  # word joiner
    "\ufeff",  # zero-width no-break space (BOM)
]


@pytest.mark.parametrize("character", INVISIBLE, ids=lambda c: f"U+{ord(c):04X}")
async def test_names_refuse_bidi_controls_and_zero_width_characters(
    client: httpx.AsyncClient, character: str
) -> None:
    name = f"Acme{character}Corp"
    response = await client.post("/admin/tenants", json={"id": "x", "name": name})
    error = assert_error(response, 400, "name")
    assert "bidirectional controls" in error["message"]
    await create(client, "acme", name="Acme")
    assert_error(await client.patch("/admin/tenants/acme", json={"name": name}), 400, "name")
    assert_error(await client.post("/admin/tenants/acme/keys", json={"name": name}), 400, "name")
    assert (await client.get("/admin/tenants/acme")).json()["name"] == "Acme"
    assert (await client.get("/admin/tenants/acme/keys")).json()["data"] == []

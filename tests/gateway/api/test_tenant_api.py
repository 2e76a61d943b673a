"""``/v1/usage`` and ``/v1/budget``: a tenant reads its own usage and budget, never another's."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from gateway.api.admin_api import admin_routes
from gateway.api.tenant_api import tenant_routes
from gateway.errors import EXCEPTION_HANDLERS
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.storage.api_keys import create_key, hash_key, revoke_key
from gateway.storage.database import Database
from gateway.storage.models import UsageStatus
from gateway.storage.tenants import create_tenant
from gateway.storage.usage_store import UsageEntry, insert_usage

ADMIN_KEY = "admin-" + "y" * 40
NOW = datetime(2025, 3, 15, 12, 0, tzinfo=timezone.utc)
MONTH_START = datetime(2025, 3, 1, tzinfo=timezone.utc)


@pytest.fixture
def ledger() -> MemoryBudgetLedger:
    return MemoryBudgetLedger()


@pytest.fixture
async def client(db: Database, ledger: MemoryBudgetLedger) -> AsyncIterator[httpx.AsyncClient]:
    routes = tenant_routes(db, ledger, now=lambda: NOW)
    routes += admin_routes(db, hash_key(ADMIN_KEY), ledger, now=lambda: NOW)
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
        yield c


@pytest.fixture
def keys(db: Database) -> dict[str, str]:
    """Tenants ``a`` (budget 1000 a month) and ``b`` (500 a day), one key each."""
    with db.transaction() as session:
        create_tenant(session, "a", name="A", tier="pro", quota={"budget_tokens": 1000})
        create_tenant(
            session,
            "b",
            name="B",
            tier="free",
            quota={"budget_tokens": 500, "budget_period": "day"},
        )
        return {tenant: create_key(session, tenant).key for tenant in ("a", "b")}


def entry(n: int, tenant_id: str, created_at: datetime, **fields: Any) -> UsageEntry:
    values: dict[str, Any] = {
        "request_id": f"{tenant_id}-{n}",
        "tenant_id": tenant_id,
        "key_id": None,
        "requested_model": "auto",
        "served_model": "small",
        "routing_decision": None,
        "prompt_tokens": 30,
        "cached_tokens": 0,
        "completion_tokens": 20,
        "cost_micros": 7,
        "status": UsageStatus.COMPLETED,
        "reject_reason": None,
        "streamed": False,
        "created_at": created_at,
    }
    return UsageEntry(**{**values, **fields})


@pytest.fixture
def records(db: Database, keys: dict[str, str]) -> None:
    """a: 6 records this month (300 tokens) and 1 last month; b: 4 today and 1 yesterday."""
    entries = [entry(n, "a", MONTH_START + timedelta(days=n)) for n in range(6)]
    entries.append(entry(99, "a", MONTH_START - timedelta(hours=1)))
    entries += [entry(n, "b", NOW - timedelta(hours=n + 1)) for n in range(4)]
    entries.append(entry(99, "b", NOW - timedelta(days=1)))
    with db.transaction() as session:
        insert_usage(session, entries)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


def request_ids(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    kind = response.headers["content-type"]
    if kind.startswith("application/json"):
        return [r["request_id"] for r in response.json()["data"]]
    if kind.startswith("application/x-ndjson"):
        return [json.loads(line)["request_id"] for line in response.text.splitlines()]
    return [row["request_id"] for row in csv.DictReader(io.StringIO(response.text))]


@pytest.mark.parametrize("format_", ["json", "jsonl", "csv"])
async def test_records_carry_the_finish_reason(
    client: httpx.AsyncClient, db: Database, keys: dict[str, str], format_: str
) -> None:
    reasons = ["tool_calls", "stop", "length", None]
    with db.transaction() as session:
        insert_usage(
            session,
            [entry(n, "a", NOW, finish_reason=r) for n, r in enumerate(reasons)],
        )
    response = await client.get(f"/v1/usage?format={format_}", headers=bearer(keys["a"]))
    assert response.status_code == 200, response.text
    if format_ == "json":
        rows = response.json()["data"]
    elif format_ == "jsonl":
        rows = [json.loads(line) for line in response.text.splitlines()]
    else:  # CSV has no null: an empty cell
        rows = list(csv.DictReader(io.StringIO(response.text)))
        reasons[-1] = ""
    assert [row["finish_reason"] for row in rows] == reasons


@pytest.mark.usefixtures("records")
@pytest.mark.parametrize("format_", ["json", "jsonl", "csv"])
async def test_a_key_sees_only_its_own_tenants_usage(
    client: httpx.AsyncClient, keys: dict[str, str], format_: str
) -> None:
    as_a = await client.get(f"/v1/usage?format={format_}", headers=bearer(keys["a"]))
    assert request_ids(as_a) == [*(f"a-{n}" for n in range(6)), "a-99"]
    assert "b-" not in as_a.text
    as_b = await client.get(f"/v1/usage?format={format_}", headers=bearer(keys["b"]))
    assert request_ids(as_b) == ["b-0", "b-1", "b-2", "b-3", "b-99"]
    assert "a-" not in as_b.text

    # Naming one's own tenant is harmless; naming another is refused, whatever else is asked.
    own = await client.get(f"/v1/usage?tenant_id=a&format={format_}", headers=bearer(keys["a"]))
    assert len(request_ids(own)) == 7
    other = await client.get(f"/v1/usage?tenant_id=b&format={format_}", headers=bearer(keys["a"]))
    assert_error(other, 403, "permission_denied")
    assert other.json()["error"]["type"] == "permission_error"
    assert "b-0" not in other.text


@pytest.mark.usefixtures("records")
async def test_tenant_usage_pages_and_windows(
    client: httpx.AsyncClient, keys: dict[str, str]
) -> None:
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {
            "limit": 2,
            "start": "2025-03-01",
            **({"cursor": cursor} if cursor else {}),
        }
        page = (await client.get("/v1/usage", params=params, headers=bearer(keys["a"]))).json()
        seen += [r["request_id"] for r in page["data"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [f"a-{n}" for n in range(6)]
    bad = await client.get("/v1/usage?start=soon", headers=bearer(keys["a"]))
    assert_error(bad, 400, "invalid_request")


async def test_usage_and_budget_need_a_live_key(
    client: httpx.AsyncClient, db: Database, keys: dict[str, str]
) -> None:
    with db.transaction() as session:
        revoked = create_key(session, "a")
        revoke_key(session, revoked.info.id)
    for path in ("/v1/usage", "/v1/budget"):
        for headers in ({}, bearer("tw-nope"), bearer(revoked.key), bearer(ADMIN_KEY)):
            assert_error(await client.get(path, headers=headers), 401, "invalid_api_key")
        assert (await client.get(path, headers=bearer(keys["a"]))).status_code == 200


@pytest.mark.usefixtures("records")
async def test_budget_is_rebuilt_from_usage_then_read_from_the_ledger(
    client: httpx.AsyncClient, db: Database, ledger: MemoryBudgetLedger, keys: dict[str, str]
) -> None:
    assert not await ledger.is_known("a", "month:2025-03")
    budget = (await client.get("/v1/budget", headers=bearer(keys["a"]))).json()
    assert budget == {
        "object": "budget",
        "tenant_id": "a",
        "limit": 1000,
        "period": "month",
        "window_start": "2025-03-01T00:00:00Z",
        "window_end": "2025-04-01T00:00:00Z",
        "used": 300,  # six records of 30 + 20 this month; last month's does not count
        "reserved": 0,
        "remaining": 700,
        "currency": "USD",  # the prices' (the gateway's currency setting)
        "budgets": [  # every budget that applies: here only the tenant's tokens
            {
                "object": "budget.standing",
                "scope": "tenant",
                "subject": None,
                "unit": "tokens",
                "limit": 1000,
                "period": "month",
                "window_start": "2025-03-01T00:00:00Z",
                "window_end": "2025-04-01T00:00:00Z",
                "used": 300,
                "reserved": 0,
                "remaining": 700,
                "alert_thresholds": None,
                "currency": None,  # a token budget's
            }
        ],
    }
    assert await ledger.is_known("a", "month:2025-03")

    reservation = await ledger.reserve("a", "month:2025-03", 1000, 250, ttl_s=60)
    assert reservation is not None
    with db.transaction() as session:  # the ledger, not the records, is the balance from now on
        insert_usage(session, [entry(50, "a", NOW, prompt_tokens=400)])
    budget = (await client.get("/v1/budget", headers=bearer(keys["a"]))).json()
    assert (budget["used"], budget["reserved"], budget["remaining"]) == (300, 250, 450)
    await ledger.settle(reservation, 200)
    budget = (await client.get("/v1/budget", headers=bearer(keys["a"]))).json()
    assert (budget["used"], budget["reserved"], budget["remaining"]) == (500, 0, 500)


@pytest.mark.usefixtures("records")
async def test_a_key_never_sees_another_tenants_budget(
    client: httpx.AsyncClient, keys: dict[str, str]
) -> None:
    b = (await client.get("/v1/budget", headers=bearer(keys["b"]))).json()
    assert (b["tenant_id"], b["limit"], b["period"], b["used"], b["remaining"]) == (
        "b",
        500,
        "day",
        200,  # today's four records; yesterday's is another window
        300,
    )
    assert (b["window_start"], b["window_end"]) == ("2025-03-15T00:00:00Z", "2025-03-16T00:00:00Z")
    assert_error(
        await client.get("/v1/budget?tenant_id=b", headers=bearer(keys["a"])),
        403,
        "permission_denied",
    )
    own = await client.get("/v1/budget?tenant_id=a", headers=bearer(keys["a"]))
    assert own.json()["tenant_id"] == "a"
    assert own.json()["used"] == 300
    admin_view = await client.get("/admin/tenants/b/budget", headers=bearer(ADMIN_KEY))
    assert admin_view.json() == b


async def test_an_unlimited_budget_reports_use_from_the_records_and_leaves_the_ledger(
    client: httpx.AsyncClient, db: Database, ledger: MemoryBudgetLedger
) -> None:
    with db.transaction() as session:
        create_tenant(session, "free", name="", tier="free", quota={"budget_period": "total"})
        key = create_key(session, "free").key
        insert_usage(session, [entry(1, "free", datetime(2020, 1, 1, tzinfo=timezone.utc))])
    budget = (await client.get("/v1/budget", headers=bearer(key))).json()
    assert (budget["limit"], budget["remaining"], budget["used"]) == (None, None, 50)
    assert (budget["period"], budget["window_start"], budget["window_end"]) == ("total", None, None)
    # Admission never reserves for an unlimited tenant: a rebuilt balance would go stale.
    assert not await ledger.is_known("free", "total")
    with db.transaction() as session:
        insert_usage(session, [entry(2, "free", NOW)])
    assert (await client.get("/v1/budget", headers=bearer(key))).json()["used"] == 100


def exported(response: httpx.Response) -> list[dict[str, Any]]:
    """The records of a JSON, JSONL or CSV answer (CSV cells are strings)."""
    assert response.status_code == 200, response.text
    kind = response.headers["content-type"]
    if kind.startswith("application/json"):
        return list(response.json()["data"])
    if kind.startswith("application/x-ndjson"):
        return [json.loads(line) for line in response.text.splitlines()]
    return list(csv.DictReader(io.StringIO(response.text)))


@pytest.mark.usefixtures("records")
@pytest.mark.parametrize("format_", ["json", "jsonl", "csv"])
async def test_records_carry_a_stable_id_in_every_format(
    client: httpx.AsyncClient, keys: dict[str, str], format_: str
) -> None:
    as_json = exported(await client.get("/v1/usage", headers=bearer(keys["a"])))
    ids = {r["request_id"]: r["id"] for r in as_json}
    assert all(isinstance(id_, int) for id_ in ids.values())
    assert len(set(ids.values())) == len(ids) == 7
    for _ in range(2):  # the same ids on every read, in every format
        response = await client.get(f"/v1/usage?format={format_}", headers=bearer(keys["a"]))
        assert {r["request_id"]: int(r["id"]) for r in exported(response)} == ids
    # The id is the cursor: from a record's id come exactly the records after it.
    after = await client.get(
        "/v1/usage", params={"format": format_, "cursor": ids["a-2"]}, headers=bearer(keys["a"])
    )
    assert request_ids(after) == ["a-3", "a-4", "a-5", "a-99"]


@pytest.mark.usefixtures("records")
@pytest.mark.parametrize("format_", ["json", "jsonl", "csv"])
async def test_a_follower_at_the_last_page_gets_only_new_records(
    client: httpx.AsyncClient, db: Database, keys: dict[str, str], format_: str
) -> None:
    async def poll(cursor: int | None) -> tuple[list[str], int | None]:
        params: dict[str, Any] = {"format": format_, "limit": 100}
        if cursor is not None:
            params["cursor"] = cursor
        response = await client.get("/v1/usage", params=params, headers=bearer(keys["a"]))
        if format_ == "json":
            page = response.json()
            assert (page["next_cursor"], page["has_more"]) == (None, False)
            return request_ids(response), page["resume_cursor"]
        assert "X-Next-Cursor" not in response.headers  # the last page, as before
        resume = response.headers.get("X-Resume-Cursor")
        return request_ids(response), None if resume is None else int(resume)

    first, cursor = await poll(None)
    assert first == [*(f"a-{n}" for n in range(6)), "a-99"]
    assert cursor is not None
    assert await poll(cursor) == ([], cursor)  # nothing new: nothing re-read
    with db.transaction() as session:
        insert_usage(session, [entry(7, "b", NOW), entry(7, "a", NOW), entry(8, "a", NOW)])
    new, next_cursor = await poll(cursor)
    assert new == ["a-7", "a-8"]
    assert next_cursor is not None
    assert next_cursor > cursor
    assert await poll(next_cursor) == ([], next_cursor)
    # A stream without a limit resumes from its last record's id.
    streamed = exported(await client.get(f"/v1/usage?format={format_}", headers=bearer(keys["a"])))
    assert int(streamed[-1]["id"]) == next_cursor

"""GET /admin/alert-events over a real migrated SQLite file: each event with its delivery
state and the payload its webhook gets, newest first, filtered and paged. The audit log's
listing is tested with the changes it records (tests/gateway/storage/test_audit_log.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from gateway.alerts.budget_watch import BudgetReading, BudgetRef, BudgetWatch
from gateway.api.admin_api import admin_routes
from gateway.errors import EXCEPTION_HANDLERS
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.storage import alert_outbox
from gateway.storage.api_keys import hash_key
from gateway.storage.database import Database

ADMIN_KEY = "admin-" + "r" * 40
NOW = datetime(2026, 12, 3, 12, 0, tzinfo=timezone.utc)


@pytest.fixture
async def client(db: Database) -> AsyncIterator[httpx.AsyncClient]:
    routes = admin_routes(db, hash_key(ADMIN_KEY), MemoryBudgetLedger(), now=lambda: NOW)
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as c:
        yield c


async def events(client: httpx.AsyncClient, **params: Any) -> dict[str, Any]:
    response = await client.get("/admin/alert-events", params=params)
    assert response.status_code == 200, response.text
    return dict(response.json())


async def test_events_are_listed_with_their_delivery_state(
    client: httpx.AsyncClient, db: Database
) -> None:
    watch = BudgetWatch(db, (50, 80, 100), now=lambda: NOW)
    acme = await watch.check(BudgetRef("acme"), BudgetReading("month:2026-12", 100, 85))
    other = await watch.check(
        BudgetRef("other", "key", "key_1", "micros"), BudgetReading("total", 10, 10)
    )
    with db.transaction() as session:
        alert_outbox.mark_delivered(session, acme[0], now=NOW)
        alert_outbox.mark_attempt_failed(session, other[0], error="HTTP 500", retry_at=None)
    listed = await events(client)
    assert [e["id"] for e in listed["data"]] == [*reversed(other), *reversed(acme)]
    by_id = {e["id"]: e for e in listed["data"]}
    delivered = by_id[acme[0]]
    assert delivered["state"] == "delivered"
    assert delivered["delivered_at"] == "2026-12-03T12:00:00Z"
    assert (delivered["budget_level"], delivered["budget_id"], delivered["unit"]) == (
        "tenant",
        "acme",
        "tokens",
    )
    assert (delivered["period"], delivered["threshold_percent"]) == ("month:2026-12", 50)
    assert delivered["payload"]["data"]["used"] == 85
    assert delivered["payload"]["id"] == acme[0]
    failed = by_id[other[0]]
    assert (failed["state"], failed["last_error"]) == ("failed", "HTTP 500")
    assert by_id[acme[1]]["state"] == "pending"

    assert [e["id"] for e in (await events(client, tenant_id="other"))["data"]] == [
        *reversed(other)
    ]
    pending = (await events(client, state="pending"))["data"]
    assert {e["id"] for e in pending} == {acme[1], other[1], other[2]}
    first = await events(client, limit=2)
    rest = await events(client, limit=10, cursor=first["next_cursor"])
    assert [e["id"] for e in first["data"] + rest["data"]] == [e["id"] for e in listed["data"]]
    assert rest["next_cursor"] is None


@pytest.mark.parametrize(
    ("params", "param"),
    [({"state": "lost"}, "state"), ({"cursor": "-1"}, "cursor"), ({"budget": "x"}, "budget")],
)
async def test_bad_parameters_are_400s(
    client: httpx.AsyncClient, params: dict[str, str], param: str
) -> None:
    response = await client.get("/admin/alert-events", params=params)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_only_the_admin_key_may_list_events(client: httpx.AsyncClient) -> None:
    response = await client.get("/admin/alert-events", headers={"Authorization": "Bearer no"})
    assert response.status_code == 401

"""Budgets on a key and on an end user through the admin API, and every budget that applies
on ``GET /v1/budget``, over a real migrated SQLite file."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from gateway.api.admin_api import admin_routes
from gateway.api.tenant_api import tenant_routes
from gateway.auth.epochs import INITIAL_EPOCH, MemoryAuthEpochs
from gateway.errors import EXCEPTION_HANDLERS
from gateway.ledger.budget_ledger import BudgetAccount
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.storage.api_keys import create_key, hash_key
from gateway.storage.database import Database
from gateway.storage.models import UsageStatus
from gateway.storage.tenants import create_tenant
from gateway.storage.usage_store import UsageEntry, insert_usage

ADMIN_KEY = "admin-" + "y" * 40
NOW = datetime(2025, 3, 15, 12, 0, tzinfo=timezone.utc)
CURRENCY = "EUR"  # the gateway's currency setting: named by every money budget's view


@pytest.fixture
def ledger() -> MemoryBudgetLedger:
    return MemoryBudgetLedger()


@pytest.fixture
def epochs() -> MemoryAuthEpochs:
    return MemoryAuthEpochs()


@pytest.fixture
async def client(
    db: Database, ledger: MemoryBudgetLedger, epochs: MemoryAuthEpochs
) -> AsyncIterator[httpx.AsyncClient]:
    routes = tenant_routes(db, ledger, now=lambda: NOW, currency=CURRENCY)
    routes += admin_routes(
        db, hash_key(ADMIN_KEY), ledger, now=lambda: NOW, auth_epochs=epochs, currency=CURRENCY
    )
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
    transport = httpx.ASGITransport(app=app)
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as c:
        yield c


@pytest.fixture
def key(db: Database) -> tuple[str, str]:
    """Tenant ``acme`` (a money budget of 5.00 a day) and one key: (key id, key)."""
    with db.transaction() as session:
        create_tenant(
            session,
            "acme",
            name="",
            tier="pro",
            quota={"budget_micros": 5_000_000, "budget_period": "day"},
        )
        created = create_key(session, "acme")
    return created.info.id, created.key


def record(n: int, key_id: str, end_user: str | None, **fields: Any) -> UsageEntry:
    values: dict[str, Any] = {
        "request_id": f"r-{n}",
        "tenant_id": "acme",
        "key_id": key_id,
        "requested_model": "small",
        "served_model": "small",
        "routing_decision": None,
        "prompt_tokens": 30,
        "cached_tokens": 10,
        "completion_tokens": 20,
        "cost_micros": 700,
        "status": UsageStatus.COMPLETED,
        "reject_reason": None,
        "streamed": False,
        "created_at": NOW - timedelta(hours=n + 1),
        "end_user": end_user,
    }
    return UsageEntry(**{**values, **fields})


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


async def test_a_key_budget_is_set_read_shown_to_the_key_and_cleared(
    client: httpx.AsyncClient, db: Database, key: tuple[str, str], epochs: MemoryAuthEpochs
) -> None:
    key_id, secret = key
    with db.transaction() as session:  # today: 2 records of the key, 1 of another key
        insert_usage(session, [record(0, key_id, None), record(1, key_id, "alice")])
        insert_usage(session, [record(2, "key_other", None)])
    path = f"/admin/keys/{key_id}/budget"
    error_of(await client.get(path), 404)
    body = {"unit": "tokens", "limit": 1000, "period": "day"}
    put = await client.put(path, json=body)
    assert put.status_code == 200, put.text
    standing = put.json()
    assert {k: standing[k] for k in ("scope", "subject", "unit", "limit", "period")} == {
        "scope": "key",
        "subject": key_id,
        "unit": "tokens",
        "limit": 1000,
        "period": "day",
    }
    # rebuilt from this key's records of the day only: 2 x (30 + 20)
    assert (standing["used"], standing["reserved"], standing["remaining"]) == (100, 0, 900)
    assert (await client.get(path)).json() == standing
    assert epochs.current_now("acme") != INITIAL_EPOCH  # every gateway re-reads it

    mine = await client.get("/v1/budget", headers={"Authorization": f"Bearer {secret}"})
    budgets = mine.json()["budgets"]
    assert [(b["scope"], b["unit"], b["limit"], b["used"]) for b in budgets] == [
        ("tenant", "micros", 5_000_000, 2100),  # every record of the tenant today
        ("key", "tokens", 1000, 100),
    ]

    audit = (await client.get("/admin/audit-log")).json()["data"]
    assert [(e["action"], e["target_type"], e["target_id"], e["after"]) for e in audit] == [
        (
            "budget.set",
            "key_budget",
            key_id,
            {**body, "scope": "key", "subject": key_id, "alert_thresholds": None},
        )
    ]

    deleted = await client.delete(path)
    assert deleted.json() == {"id": key_id, "object": "key.budget", "deleted": True}
    error_of(await client.get(path), 404)
    error_of(await client.delete(path), 404)
    error_of(
        await client.put("/admin/keys/key_nope/budget", json={"unit": "tokens", "limit": 1}), 404
    )


async def test_an_end_users_budget_in_money_and_on_v1_budget_with_user(
    client: httpx.AsyncClient, db: Database, key: tuple[str, str], ledger: MemoryBudgetLedger
) -> None:
    key_id, secret = key
    with db.transaction() as session:
        insert_usage(session, [record(0, key_id, "alice"), record(1, key_id, "bob")])
    path = "/admin/tenants/acme/users/alice/budget"
    put = await client.put(path, json={"unit": "micros", "limit": 2_500_000})
    assert put.status_code == 200, put.text
    assert (put.json()["period"], put.json()["used"]) == ("month", 700)  # alice's one record
    assert put.json()["currency"] == CURRENCY
    account = BudgetAccount("user", "alice", "micros")
    assert await ledger.is_known("acme", "month:2025-03", account)

    headers = {"Authorization": f"Bearer {secret}"}
    mine = (await client.get("/v1/budget?user=alice", headers=headers)).json()
    for_alice = mine["budgets"]
    assert [(b["scope"], b["subject"], b["unit"], b["currency"]) for b in for_alice] == [
        ("tenant", None, "micros", CURRENCY),
        ("user", "alice", "micros", CURRENCY),
    ]
    assert mine["currency"] == CURRENCY
    tenant = (await client.get("/admin/tenants/acme/budget")).json()
    assert [b["currency"] for b in tenant["budgets"]] == [CURRENCY]
    assert tenant["currency"] == CURRENCY
    for_bob = (await client.get("/v1/budget?user=bob", headers=headers)).json()["budgets"]
    assert [b["scope"] for b in for_bob] == ["tenant"]  # bob has no budget of his own
    error = error_of(await client.get("/v1/budget?user=", headers=headers), 400)
    assert error["param"] == "user"

    error_of(await client.get("/admin/tenants/nobody/users/alice/budget"), 404)
    assert (await client.delete(path)).json()["deleted"] is True


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"limit": 5}, "unit"),
        ({"unit": "usd", "limit": 5}, "unit"),
        ({"unit": "tokens"}, "limit"),
        ({"unit": "tokens", "limit": -1}, "limit"),
        ({"unit": "tokens", "limit": 1.5}, "limit"),
        ({"unit": "tokens", "limit": "5"}, "limit"),
        ({"unit": "tokens", "limit": 2**53}, "limit"),
        ({"unit": "tokens", "limit": 5, "period": "week"}, "period"),
        ({"unit": "tokens", "limit": 5, "scope": "key"}, "scope"),
        ({"unit": "tokens", "limit": 5, "alert_thresholds": [80, 50]}, "alert_thresholds"),
        ({"unit": "tokens", "limit": 5, "alert_thresholds": [50, 50]}, "alert_thresholds"),
        ({"unit": "tokens", "limit": 5, "alert_thresholds": [0, 50]}, "alert_thresholds"),
        ({"unit": "tokens", "limit": 5, "alert_thresholds": [1001]}, "alert_thresholds"),
        ({"unit": "tokens", "limit": 5, "alert_thresholds": [50.5]}, "alert_thresholds"),
        ({"unit": "tokens", "limit": 5, "alert_thresholds": ["50"]}, "alert_thresholds"),
        ({"unit": "tokens", "limit": 5, "alert_thresholds": []}, "alert_thresholds"),
        ({"unit": "tokens", "limit": 5, "alert_thresholds": 50}, "alert_thresholds"),
    ],
)
async def test_an_invalid_budget_is_a_400_naming_the_field(
    client: httpx.AsyncClient, key: tuple[str, str], body: dict[str, Any], param: str
) -> None:
    key_id, _ = key
    for path in (f"/admin/keys/{key_id}/budget", "/admin/tenants/acme/users/alice/budget"):
        error = error_of(await client.put(path, json=body), 400)
        assert (error["type"], error["param"]) == ("invalid_request_error", param)
        assert param in error["message"]
        error_of(await client.get(path), 404)  # nothing was stored


async def test_a_user_id_too_long_for_a_request_is_a_400(
    client: httpx.AsyncClient, key: tuple[str, str]
) -> None:
    path = f"/admin/tenants/acme/users/{'u' * 257}/budget"
    assert (
        error_of(await client.put(path, json={"unit": "tokens", "limit": 1}), 400)["param"]
        == "user"
    )


async def test_a_budgets_alert_thresholds_are_stored_shown_and_audited(
    client: httpx.AsyncClient, key: tuple[str, str]
) -> None:
    key_id, _ = key
    path = f"/admin/keys/{key_id}/budget"
    body = {"unit": "tokens", "limit": 1000, "alert_thresholds": [25, 90, 1000]}
    put = await client.put(path, json=body)
    assert put.status_code == 200, put.text
    assert put.json()["alert_thresholds"] == [25, 90, 1000]
    assert put.json()["currency"] is None  # a token budget names no currency
    assert (await client.get(path)).json()["alert_thresholds"] == [25, 90, 1000]
    cleared = await client.put(path, json={"unit": "tokens", "limit": 1000})
    assert cleared.json()["alert_thresholds"] is None  # the settings' default again
    audit = (await client.get("/admin/audit-log")).json()["data"]
    assert [e["after"]["alert_thresholds"] for e in audit] == [None, [25, 90, 1000]]


@pytest.mark.parametrize("thresholds", [[100, 50], [50, 50], [0], [2000], [], "50"])
async def test_a_tenants_alert_thresholds_are_checked_in_its_quota(
    client: httpx.AsyncClient, key: tuple[str, str], thresholds: Any
) -> None:
    path = "/admin/tenants/acme/quota"
    error = error_of(await client.put(path, json={"alert_thresholds": thresholds}), 400)
    assert (error["type"], error["param"]) == ("invalid_request_error", "alert_thresholds")
    assert "alert_thresholds" in error["message"]
    created = await client.post(
        "/admin/tenants", json={"id": "beta", "quota": {"alert_thresholds": thresholds}}
    )
    assert error_of(created, 400)["param"] == "quota.alert_thresholds"


async def test_a_tenants_alert_thresholds_are_kept_with_its_quota(
    client: httpx.AsyncClient, key: tuple[str, str]
) -> None:
    body = {"budget_tokens": 100, "alert_thresholds": [10, 75]}
    put = await client.put("/admin/tenants/acme/quota", json=body)
    assert put.status_code == 200, put.text
    assert put.json()["alert_thresholds"] == [10, 75]
    tenant = (await client.get("/admin/tenants/acme")).json()
    assert tenant["quota"]["alert_thresholds"] == [10, 75]
    budget = (await client.get("/admin/tenants/acme/budget")).json()
    assert {b["alert_thresholds"] == [10, 75] for b in budget["budgets"]} == {True}

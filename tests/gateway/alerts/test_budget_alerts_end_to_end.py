"""Budget alerts end to end, without torch: a real gateway in front of the stand-in engine,
on the in-process ledger and on Redis, posting to a local webhook receiver. A request whose
settle crosses a threshold gets its event delivered, signed; an event left undelivered when
the gateway stops is delivered by the next gateway on the same database, with no request. A
budget that names its own thresholds (set through the admin API) fires at those alone."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.alerts.webhook_signature import verify
from gateway.settings import GatewaySettings
from gateway.storage.api_keys import hash_key
from gateway.storage.database import Database
from gateway.storage.models import ApiKeyRow
from tests.support.polling import wait_until
from tests.support.stand_in_engine import MODEL
from tests.support.stand_in_stack import (
    TappedEngine,
    gateway,
    stand_in_engine,
    stand_in_settings,
    tenant_key,
)
from tests.support.webhook_receiver import WebhookReceiver, webhook_receiver

NUM_CHUNKS = 6
MESSAGES = [{"role": "user", "content": "a prompt of six words"}]  # 5 tokens to the stand-in
TOKENS_PER_REQUEST = 5 + NUM_CHUNKS  # what each request settles to
BUDGET = 2 * TOKENS_PER_REQUEST  # one request is 50% of it
SECRET = "whsec_" + base64.b64encode(b"e" * 24).decode()
ADMIN_KEY = "admin-" + "e" * 40
WAIT_S = 60.0  # bounds a hang only


@pytest.fixture(params=["memory", "redis"])
def ledger_overrides(request: pytest.FixtureRequest) -> dict[str, Any]:
    if request.param == "redis":
        return {"redis_url": request.getfixturevalue("redis_url")}
    return {}


@pytest.fixture
def engine() -> Iterator[TappedEngine]:
    with stand_in_engine(num_chunks=NUM_CHUNKS) as running:
        yield running


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with webhook_receiver() as running:
        yield running


def settings(
    engine: TappedEngine,
    receiver: WebhookReceiver,
    tmp_path: Path,
    database_url: str,
    overrides: dict[str, Any],
) -> GatewaySettings:
    alerts = {
        "webhook_url": receiver.url,
        "webhook_secret": SECRET,
        "thresholds": [50, 100],
        "retry_first_delay_s": 0.05,
        "retry_max_delay_s": 0.2,
        "poll_interval_s": 0.2,
    }
    return stand_in_settings(
        engine,
        tmp_path / "gw",
        database_url,
        alerts=alerts,
        admin_key_hash=hash_key(ADMIN_KEY),
        **overrides,
    )


def chat(base: str, key: str, user: str | None = None) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": NUM_CHUNKS}
    if user is not None:
        body["user"] = user
    response = httpx.post(
        f"{base}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["total_tokens"] == TOKENS_PER_REQUEST


def admin_events(base: str) -> list[dict[str, Any]]:
    response = httpx.get(
        f"{base}/admin/alert-events", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert response.status_code == 200, response.text
    return list(response.json()["data"])


def test_a_settle_that_crosses_a_threshold_is_delivered(
    engine: TappedEngine,
    receiver: WebhookReceiver,
    sqlite_db_url: str,
    tmp_path: Path,
    ledger_overrides: dict[str, Any],
) -> None:
    tenant_id, key = tenant_key(sqlite_db_url, budget_tokens=BUDGET, budget_period="month")
    with gateway(settings(engine, receiver, tmp_path, sqlite_db_url, ledger_overrides)) as base:
        chat(base, key)
        wait_until(lambda: receiver.deliveries, WAIT_S, "the 50% alert is delivered")
        wait_until(lambda: admin_events(base)[0]["state"] == "delivered", WAIT_S)
        [event] = admin_events(base)
    [delivery] = receiver.deliveries
    assert verify(SECRET, delivery.headers, delivery.body, now=time.time()) == event["id"]
    payload = json.loads(delivery.body)
    assert payload == event["payload"]
    assert payload["data"]["tenant_id"] == tenant_id
    assert payload["data"]["budget"] == {"level": "tenant", "id": tenant_id}
    assert payload["data"]["threshold_percent"] == 50
    assert (payload["data"]["used"], payload["data"]["limit"]) == (TOKENS_PER_REQUEST, BUDGET)
    assert payload["data"]["unit"] == "tokens"
    assert payload["data"]["period"].startswith("month:")


def test_an_event_left_undelivered_is_delivered_after_a_gateway_restart(
    engine: TappedEngine,
    receiver: WebhookReceiver,
    sqlite_db_url: str,
    tmp_path: Path,
    ledger_overrides: dict[str, Any],
) -> None:
    _, key = tenant_key(sqlite_db_url, budget_tokens=BUDGET, budget_period="month")
    config = settings(engine, receiver, tmp_path, sqlite_db_url, ledger_overrides)
    receiver.is_refusing = True
    with gateway(config) as base:
        chat(base, key)
        wait_until(lambda: len(receiver.deliveries) >= 2, WAIT_S, "refused, then retried")
        [event] = admin_events(base)
        assert event["state"] == "pending"
    num_refused = len(receiver.deliveries)
    receiver.is_refusing = False
    with gateway(config) as base:  # a new gateway process's start: nothing in memory
        wait_until(lambda: admin_events(base)[0]["state"] == "delivered", WAIT_S)
    assert receiver.event_ids() == [event["id"]] * (num_refused + 1)
    assert receiver.deliveries[-1].status == 200
    assert len(engine.requests) == 1  # delivered by the restart, not by another request


def key_id_of(database_url: str, tenant_id: str) -> str:
    database = Database(database_url)
    try:
        with database.session() as session:
            [row] = session.query(ApiKeyRow).filter(ApiKeyRow.tenant_id == tenant_id).all()
            return row.id
    finally:
        database.dispose()


def test_a_key_budget_with_its_own_thresholds_fires_at_them_alone(
    engine: TappedEngine,
    receiver: WebhookReceiver,
    sqlite_db_url: str,
    tmp_path: Path,
    ledger_overrides: dict[str, Any],
) -> None:
    """The key's budget alerts at 25% and not at the settings' 50%. The end user's budget,
    at 50% alone, is the barrier: a settle checks the key's budget before the user's, so
    once the user's 50% event is in, the key's check of the same settle is done."""
    tenant_id, key = tenant_key(sqlite_db_url)  # no tenant budget: the key's and user's
    key_id = key_id_of(sqlite_db_url, tenant_id)
    limit = 4 * TOKENS_PER_REQUEST  # one request is 25% of it, two 50%
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    budgets = {
        f"/admin/keys/{key_id}/budget": [25],
        f"/admin/tenants/{tenant_id}/users/alice/budget": [50],
    }
    with gateway(settings(engine, receiver, tmp_path, sqlite_db_url, ledger_overrides)) as base:
        for path, thresholds in budgets.items():
            body = {"unit": "tokens", "limit": limit, "alert_thresholds": thresholds}
            put = httpx.put(f"{base}{path}", json=body, headers=admin)
            assert put.status_code == 200, put.text
            assert put.json()["alert_thresholds"] == thresholds
        chat(base, key, user="alice")
        wait_until(lambda: receiver.deliveries, WAIT_S, "the key's 25% alert is delivered")
        chat(base, key, user="alice")  # 50%: the user's threshold, and the settings' default
        wait_until(lambda: len(admin_events(base)) == 2, WAIT_S, "the user's 50% alert")
        wait_until(lambda: {e["state"] for e in admin_events(base)} == {"delivered"}, WAIT_S)
        events = admin_events(base)
    crossed = sorted(
        (e["payload"]["data"]["budget"]["level"], e["payload"]["data"]["threshold_percent"])
        for e in events
    )
    assert crossed == [("key", 25), ("user", 50)]  # no key 50: its own thresholds alone
    key_event = next(e for e in events if e["payload"]["data"]["budget"]["level"] == "key")
    data = key_event["payload"]["data"]
    assert data["budget"] == {"level": "key", "id": key_id}
    assert (data["used"], data["limit"]) == (TOKENS_PER_REQUEST, limit)

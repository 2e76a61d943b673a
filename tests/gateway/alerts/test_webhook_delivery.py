"""Alert webhooks against a local receiver (a real HTTP server): refused deliveries are
retried, a duplicate carries the same id, every delivery verifies with the documented scheme
(and not with another secret), and an event a stopped gateway left undelivered is sent after
the restart. On SQLite and PostgreSQL."""

from __future__ import annotations

import base64
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from gateway.alert_settings import AlertSettings
from gateway.alerts.budget_watch import BudgetReading, BudgetRef, BudgetWatch
from gateway.alerts.webhook_delivery import WebhookDelivery
from gateway.alerts.webhook_signature import InvalidSignature, verify
from gateway.storage import alert_outbox
from gateway.storage.database import Database
from gateway.storage.models import utc_now
from tests.support.polling import eventually
from tests.support.webhook_receiver import WebhookReceiver, webhook_receiver

SECRET = "whsec_" + base64.b64encode(b"s" * 24).decode()
WAIT_S = 30.0  # bounds a hang only: deliveries here take milliseconds


def settings(url: str, **overrides: Any) -> AlertSettings:
    values: dict[str, Any] = {
        "retry_first_delay_s": 0.05,
        "retry_max_delay_s": 0.2,
        "timeout_s": 5.0,
        "poll_interval_s": 0.2,
        **overrides,
    }
    return AlertSettings(url, SECRET, **values)


async def cross_half(database: Database) -> str:
    """Record one crossing (50% of acme's token budget): the id of its event."""
    watch = BudgetWatch(database, (50,))
    [event_id] = await watch.check(BudgetRef("acme"), BudgetReading("month:2026-12", 100, 60))
    return event_id


def event(database: Database, event_id: str) -> alert_outbox.AlertRecord:
    with database.transaction() as session:
        page = alert_outbox.alert_page(session, tenant_id=None, state=None, cursor=None, limit=10)
    [record] = [r for r in page.records if r.event_id == event_id]
    return record


def in_state(database: Database, event_id: str, state: str) -> Callable[[], bool]:
    return lambda: event(database, event_id).state == state


@asynccontextmanager
async def delivering(database: Database, alerts: AlertSettings) -> AsyncIterator[WebhookDelivery]:
    """A gateway's delivery task, running until the block ends (the gateway stops)."""
    delivery = WebhookDelivery(database, alerts)
    delivery.start()
    try:
        yield delivery
    finally:
        await delivery.aclose()


def assert_all_verify(receiver: WebhookReceiver, event_id: str) -> None:
    for delivery in receiver.deliveries:
        assert verify(SECRET, delivery.headers, delivery.body, now=time.time()) == event_id


@pytest.fixture
def receiver() -> Any:
    with webhook_receiver() as running:
        yield running


async def test_a_refused_delivery_is_retried_then_delivered(
    database: Database, receiver: WebhookReceiver
) -> None:
    receiver.statuses = [500, 503]
    event_id = await cross_half(database)
    async with delivering(database, settings(receiver.url)):
        await eventually(in_state(database, event_id, "delivered"), WAIT_S)
    assert [d.status for d in receiver.deliveries] == [500, 503, 200]
    assert receiver.event_ids() == [event_id] * 3
    assert len({d.body for d in receiver.deliveries}) == 1
    assert_all_verify(receiver, event_id)
    record = event(database, event_id)
    assert (record.num_attempts, record.last_error) == (3, None)
    assert record.delivered_at is not None


async def test_a_duplicate_delivery_carries_the_same_id(
    database: Database, receiver: WebhookReceiver
) -> None:
    """The receiver takes the first delivery but answers after the gateway stopped waiting
    (a lost reply): the gateway sends it again, and the receiver sees the same event twice
    under one id, which is how it drops the duplicate."""
    receiver.delays_s = [2.0]
    event_id = await cross_half(database)
    async with delivering(database, settings(receiver.url, timeout_s=0.5)):
        await eventually(in_state(database, event_id, "delivered"), WAIT_S)
    assert receiver.event_ids() == [event_id, event_id]
    first, second = receiver.deliveries
    assert first.body == second.body
    assert_all_verify(receiver, event_id)
    assert event(database, event_id).num_attempts == 2


async def test_a_wrong_signature_is_detectable(
    database: Database, receiver: WebhookReceiver
) -> None:
    event_id = await cross_half(database)
    async with delivering(database, settings(receiver.url)):
        await eventually(in_state(database, event_id, "delivered"), WAIT_S)
    [delivery] = receiver.deliveries
    other_secret = "whsec_" + base64.b64encode(b"o" * 24).decode()
    with pytest.raises(InvalidSignature):
        verify(other_secret, delivery.headers, delivery.body, now=time.time())
    with pytest.raises(InvalidSignature):
        verify(SECRET, delivery.headers, delivery.body + b" ", now=time.time())
    assert verify(SECRET, delivery.headers, delivery.body, now=time.time()) == event_id


async def test_an_undelivered_event_is_delivered_after_a_restart(
    database: Database, receiver: WebhookReceiver
) -> None:
    """The receiver is down while the first gateway runs; that gateway stops with the event
    undelivered. The next one, a fresh process with nothing in memory, reads the outbox at
    start and delivers it, though nothing crosses a threshold again."""
    receiver.is_refusing = True
    event_id = await cross_half(database)
    async with delivering(database, settings(receiver.url, retry_first_delay_s=0.05)):
        await eventually(lambda: len(receiver.deliveries) >= 2, WAIT_S)
    assert event(database, event_id).state == "pending"
    num_refused = len(receiver.deliveries)
    receiver.is_refusing = False
    restarted = Database(database.url)
    try:
        async with delivering(restarted, settings(receiver.url)):
            await eventually(in_state(restarted, event_id, "delivered"), WAIT_S)
    finally:
        restarted.dispose()
    assert receiver.event_ids() == [event_id] * (num_refused + 1)
    assert receiver.deliveries[-1].status == 200


async def test_an_event_claimed_by_a_gateway_that_died_is_sent_once_its_lease_lapses(
    database: Database, receiver: WebhookReceiver
) -> None:
    """A gateway killed between its claim and its post leaves the event pending and leased;
    another delivers it once the lease is over."""
    event_id = await cross_half(database)
    with database.transaction() as session:
        [claimed] = alert_outbox.claim_due(session, now=utc_now(), lease_s=0.5, limit=10)
    assert claimed.event_id == event_id
    async with delivering(database, settings(receiver.url)):
        await eventually(in_state(database, event_id, "delivered"), WAIT_S)
    assert receiver.event_ids() == [event_id]
    assert event(database, event_id).num_attempts == 2  # the dead gateway's claim counts


async def test_after_the_last_attempt_the_event_is_failed_and_kept(
    database: Database, receiver: WebhookReceiver
) -> None:
    receiver.is_refusing = True
    event_id = await cross_half(database)
    async with delivering(database, settings(receiver.url, max_attempts=3)):
        await eventually(in_state(database, event_id, "failed"), WAIT_S)
    record = event(database, event_id)
    assert (record.num_attempts, record.last_error) == (3, "HTTP 500")
    assert len(receiver.deliveries) == 3


async def test_an_unreachable_receiver_keeps_the_event_pending(database: Database) -> None:
    """Nothing listens at the URL: each attempt fails to connect, the error is kept on the
    event, and it stays pending for the next attempt."""
    with socket.socket() as probe:  # a port that was free a moment ago, now closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    event_id = await cross_half(database)
    alerts = settings(f"http://127.0.0.1:{port}/hook", retry_first_delay_s=60, retry_max_delay_s=60)
    async with delivering(database, alerts):
        await eventually(lambda: event(database, event_id).num_attempts == 1, WAIT_S)
        await eventually(lambda: event(database, event_id).last_error is not None, WAIT_S)
    record = event(database, event_id)
    assert record.state == "pending"
    assert record.last_error is not None
    assert record.last_error.startswith("ConnectError")

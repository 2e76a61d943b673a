"""The alert delivery's metrics on the gateway's registry, against the local receiver: a
refused and a delivered attempt each move their counter, an unreachable receiver its own,
an event given up on is counted, and the pending gauge follows the outbox. The delivery's
clock is the test's (a retry is due when the test says); on SQLite and PostgreSQL."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.alert_settings import AlertSettings
from gateway.alerts.budget_watch import BudgetReading, BudgetRef, BudgetWatch
from gateway.alerts.webhook_delivery import WebhookDelivery
from gateway.observability.metrics import GatewayMetrics
from gateway.storage.database import Database
from tests.support.webhook_receiver import WebhookReceiver, webhook_receiver

SECRET = "whsec_" + base64.b64encode(b"m" * 24).decode()
UNREACHABLE_URL = "http://127.0.0.1:9/hook"  # the discard port: nothing listens


class Clock:
    """The delivery's clock: the real time when made, then moved by the test."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def attempts(metrics: GatewayMetrics) -> dict[str, float]:
    name = "tollway_gateway_alert_delivery_attempts_total"
    outcomes = ("delivered", "refused", "unreachable")
    return {outcome: sample(metrics, name, outcome=outcome) for outcome in outcomes}


def pending(metrics: GatewayMetrics) -> float:
    return sample(metrics, "tollway_gateway_alert_events_pending")


async def cross(database: Database, *thresholds: int) -> None:
    """Record crossings of acme's token budget at each threshold: one event each."""
    watch = BudgetWatch(database, thresholds)
    reading = BudgetReading("month:2026-12", 100, 100)
    assert len(await watch.check(BudgetRef("acme"), reading)) == len(thresholds)


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with webhook_receiver() as running:
        yield running


async def delivery_to(
    url: str, database: Database, metrics: GatewayMetrics, clock: Clock, **settings: Any
) -> tuple[WebhookDelivery, httpx.AsyncClient]:
    alerts = AlertSettings(url, SECRET, retry_first_delay_s=1, retry_max_delay_s=1, **settings)
    client = httpx.AsyncClient()
    return WebhookDelivery(database, alerts, client=client, clock=clock, metrics=metrics), client


async def test_a_refused_then_delivered_event_moves_the_counters_and_the_gauge(
    database: Database, receiver: WebhookReceiver
) -> None:
    metrics, clock = GatewayMetrics(), Clock()
    delivery, client = await delivery_to(receiver.url, database, metrics, clock)
    receiver.statuses = [500]
    await cross(database, 50)
    clock.now = time.time()  # the event is due
    assert await delivery.deliver_due() == 1
    assert attempts(metrics) == {"delivered": 0, "refused": 1, "unreachable": 0}
    assert pending(metrics) == 1  # due again in a second
    clock.now += 2
    assert await delivery.deliver_due() == 1
    assert attempts(metrics) == {"delivered": 1, "refused": 1, "unreachable": 0}
    assert pending(metrics) == 0
    assert sample(metrics, "tollway_gateway_alert_events_failed_total") == 0
    text = metrics.render().decode()
    assert 'tollway_gateway_alert_delivery_attempts_total{outcome="delivered"} 1.0' in text
    assert 'tollway_gateway_alert_delivery_attempts_total{outcome="refused"} 1.0' in text
    assert "tollway_gateway_alert_events_pending 0.0" in text
    await client.aclose()


async def test_an_unreachable_receiver_and_an_event_given_up_on_are_counted(
    database: Database,
) -> None:
    metrics, clock = GatewayMetrics(), Clock()
    delivery, client = await delivery_to(
        UNREACHABLE_URL, database, metrics, clock, max_attempts=2, timeout_s=2
    )
    await cross(database, 50, 80)
    clock.now = time.time()
    assert await delivery.deliver_due() == 2
    assert attempts(metrics) == {"delivered": 0, "refused": 0, "unreachable": 2}
    assert pending(metrics) == 2
    assert sample(metrics, "tollway_gateway_alert_events_failed_total") == 0
    clock.now += 2
    assert await delivery.deliver_due() == 2  # the last attempt of each: both given up
    assert attempts(metrics)["unreachable"] == 4
    assert pending(metrics) == 0
    assert sample(metrics, "tollway_gateway_alert_events_failed_total") == 2
    await client.aclose()

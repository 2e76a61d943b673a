"""Crossings become outbox events: each threshold once per budget and period, across
processes (the outbox's unique key), on SQLite and PostgreSQL."""

from __future__ import annotations

import json

import pytest

from gateway.alerts.budget_watch import BudgetReading, BudgetRef, BudgetWatch
from gateway.storage import alert_outbox
from gateway.storage.database import Database

ACME = BudgetRef("acme")
MONTH = "month:2026-12"


def outbox(database: Database) -> list[alert_outbox.AlertRecord]:
    with database.transaction() as session:
        page = alert_outbox.alert_page(session, tenant_id=None, state=None, cursor=None, limit=100)
    return list(reversed(page.records))


def thresholds(records: list[alert_outbox.AlertRecord]) -> list[tuple[str, str, int]]:
    return [(r.budget_level, r.unit, r.threshold_percent) for r in records]


async def test_each_threshold_fires_once_per_period(database: Database) -> None:
    wakes: list[None] = []
    watch = BudgetWatch(database, (50, 80, 100), on_new_events=lambda: wakes.append(None))
    assert len(await watch.check(ACME, BudgetReading(MONTH, 1000, 600))) == 1
    assert await watch.check(ACME, BudgetReading(MONTH, 1000, 700)) == []
    assert len(await watch.check(ACME, BudgetReading(MONTH, 1000, 1000))) == 2
    assert await watch.check(ACME, BudgetReading(MONTH, 1000, 1500)) == []
    assert len(await watch.check(ACME, BudgetReading("month:2027-01", 1000, 500))) == 1
    records = outbox(database)
    assert [(r.period_key, r.threshold_percent) for r in records] == [
        (MONTH, 50),
        (MONTH, 80),
        (MONTH, 100),
        ("month:2027-01", 50),
    ]
    assert len(wakes) == 3  # once per check that wrote events
    assert {r.state for r in records} == {"pending"}


async def test_another_process_does_not_fire_again(database: Database) -> None:
    """A replica (or a restarted gateway) without this one's mark checks from zero: what
    was fired this period is dropped by the outbox, what was not fires."""
    await BudgetWatch(database, (50, 80)).check(ACME, BudgetReading(MONTH, 1000, 600))
    other = BudgetWatch(database, (50, 80))
    assert len(await other.check(ACME, BudgetReading(MONTH, 1000, 850))) == 1
    assert thresholds(outbox(database)) == [("tenant", "tokens", 50), ("tenant", "tokens", 80)]


async def test_a_gap_between_two_settles_read_late_is_still_crossed(database: Database) -> None:
    """Two settles of 300 land (0 -> 300 -> 600) before either reads the balance: both read
    600. The second check starts from the first one's mark, not from 600 - 300."""
    watch = BudgetWatch(database, (50,))
    first = await watch.check(ACME, BudgetReading(MONTH, 1000, 600))
    second = await watch.check(ACME, BudgetReading(MONTH, 1000, 600))
    assert (len(first), second) == (1, [])


async def test_budgets_are_apart_by_level_subject_and_unit(database: Database) -> None:
    watch = BudgetWatch(database, (50,))
    for budget in (
        ACME,
        BudgetRef("acme", unit="micros"),
        BudgetRef("acme", "key", "key_1"),
        BudgetRef("acme", "user", "alice"),
        BudgetRef("other", "user", "alice"),
    ):
        assert len(await watch.check(budget, BudgetReading(MONTH, 10, 5))) == 1
    assert {(r.tenant_id, r.budget_level, r.budget_id, r.unit) for r in outbox(database)} == {
        ("acme", "tenant", "acme", "tokens"),
        ("acme", "tenant", "acme", "micros"),
        ("acme", "key", "key_1", "tokens"),
        ("acme", "user", "alice", "tokens"),
        ("other", "user", "alice", "tokens"),
    }


async def test_per_budget_thresholds_override_the_default(database: Database) -> None:
    watch = BudgetWatch(database, (50, 80, 100))
    written = await watch.check(ACME, BudgetReading(MONTH, 1000, 950), thresholds=[90])
    assert len(written) == 1
    assert thresholds(outbox(database)) == [("tenant", "tokens", 90)]


async def test_the_event_body_says_what_crossed(database: Database) -> None:
    budget = BudgetRef("acme", "key", "key_1", "micros")
    [event_id] = await BudgetWatch(database, (80,)).check(budget, BudgetReading(MONTH, 999, 850))
    [record] = outbox(database)
    assert record.event_id == event_id
    body = json.loads(record.body)
    assert body["id"] == event_id
    assert body["type"] == "budget.threshold_crossed"
    assert body["data"] == {
        "tenant_id": "acme",
        "budget": {"level": "key", "id": "key_1"},
        "period": MONTH,
        "threshold_percent": 80,
        "threshold": 800,
        "limit": 999,
        "used": 850,
        "unit": "micros",
    }


def test_a_budget_names_a_known_level_and_unit() -> None:
    with pytest.raises(ValueError, match="level"):
        BudgetRef("acme", "team")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unit"):
        BudgetRef("acme", unit="dollars")  # type: ignore[arg-type]

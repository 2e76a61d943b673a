"""A request's key and end-user budgets from memory: read once per auth epoch (and ``ttl_s``),
read again when the epoch moved, served stale only under the same epoch while the database
cannot answer."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from gateway.admission.scoped_budget_lookup import ScopedBudgetLookup
from gateway.errors import ApiError
from gateway.storage.database import Database
from gateway.storage.scoped_budgets import put_budget
from gateway.storage.tenants import create_tenant
from policies.scoped_budgets import ScopedBudget

KEY = ScopedBudget("key", "micros", 5_000_000, "day", subject="key_1")
ALICE = ScopedBudget("user", "tokens", 1000, "month", subject="alice")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def budgets(db: Database) -> Database:
    with db.transaction() as session:
        create_tenant(session, "acme", name="", tier="pro", quota={})
        put_budget(session, "acme", KEY)
        put_budget(session, "acme", ALICE)
    return db


def set_limit(db: Database, budget: ScopedBudget, limit: int) -> ScopedBudget:
    changed = ScopedBudget(budget.scope, budget.unit, limit, budget.period, budget.subject)
    with db.transaction() as session:
        put_budget(session, "acme", changed)
    return changed


async def test_the_key_and_the_users_budgets_in_that_order(budgets: Database) -> None:
    lookup = ScopedBudgetLookup(budgets, ttl_s=60)
    assert await lookup.budgets("acme", "e1", "key_1", "alice") == (KEY, ALICE)
    assert await lookup.budgets("acme", "e1", "key_1", None) == (KEY,)
    assert await lookup.budgets("acme", "e1", "key_2", "bob") == ()  # no budget of their own
    assert await lookup.budgets("other", "e1", "key_1", "alice") == ()  # another tenant's alice


async def test_a_change_is_seen_under_the_next_epoch_or_after_ttl(budgets: Database) -> None:
    clock = Clock()
    lookup = ScopedBudgetLookup(budgets, ttl_s=60, clock=clock)
    assert await lookup.budgets("acme", "e1", "key_1", "alice") == (KEY, ALICE)
    key = set_limit(budgets, KEY, 7)  # committed; the admin API then bumps the epoch
    assert await lookup.budgets("acme", "e1", "key_1", "alice") == (KEY, ALICE)  # cached
    assert await lookup.budgets("acme", "e2", "key_1", "alice") == (key, ALICE)
    alice = set_limit(budgets, ALICE, 9)  # straight in the database: no epoch bump
    clock.now += 59.9
    assert await lookup.budgets("acme", "e2", "key_1", "alice") == (key, ALICE)
    clock.now += 0.1
    assert await lookup.budgets("acme", "e2", "key_1", "alice") == (key, alice)


async def test_the_database_down_serves_the_same_epochs_entries_only(budgets: Database) -> None:
    clock = Clock()
    lookup = ScopedBudgetLookup(budgets, ttl_s=1, clock=clock)
    assert await lookup.budgets("acme", "e1", "key_1", "alice") == (KEY, ALICE)
    with budgets.transaction() as session:  # every read fails from here on
        session.execute(text("DROP TABLE scoped_budgets"))
    clock.now += 3600
    assert await lookup.budgets("acme", "e1", "key_1", "alice") == (KEY, ALICE)
    for epoch, user in (("e2", "alice"), ("e1", "bob")):
        with pytest.raises(ApiError) as raised:
            await lookup.budgets("acme", epoch, "key_1", user)
        assert (raised.value.rejection.status, raised.value.rejection.code) == (
            503,
            "auth_unavailable",
        )

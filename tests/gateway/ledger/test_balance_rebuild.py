"""A lost balance rebuilt from the usage records: the tokens they charge to its window only,
and never over a balance the ledger knows."""

from __future__ import annotations

from datetime import datetime, timezone

from gateway.ledger.balance_rebuild import BalanceRebuild
from gateway.ledger.budget_ledger import Balance
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.storage.database import Database
from gateway.storage.models import UsageStatus
from gateway.storage.usage_store import UsageEntry, insert_usage
from policies.budget_period import budget_window

JUNE = datetime(2025, 6, 15, tzinfo=timezone.utc)


def record(
    request_id: str, tenant_id: str, at: datetime, prompt: int, completion: int
) -> UsageEntry:
    return UsageEntry(
        request_id, tenant_id, "key-1", "small", "small", None, prompt, 0, completion, 0,
        UsageStatus.COMPLETED, None, False, at,
    )  # fmt: skip


async def test_the_windows_records_rebuild_its_used_tokens(db: Database) -> None:
    with db.transaction() as session:
        insert_usage(
            session,
            [
                record("in-1", "acme", JUNE, 40, 10),
                record("in-2", "acme", JUNE.replace(day=30), 5, 5),
                record("may", "acme", JUNE.replace(month=5), 1000, 0),
                record("other", "other", JUNE, 1000, 0),
            ],
        )
    ledger = MemoryBudgetLedger()
    window = budget_window("month", JUNE)
    await BalanceRebuild(ledger, db).rebuild("acme", window)
    assert await ledger.balance("acme", window.key) == Balance(used=60, reserved=0)


async def test_a_known_balance_is_left_as_it_is(db: Database) -> None:
    ledger = MemoryBudgetLedger()
    window = budget_window("month", JUNE)
    assert await ledger.rebuild("acme", window.key, 7)
    with db.transaction() as session:
        insert_usage(session, [record("in-1", "acme", JUNE, 40, 10)])
    await BalanceRebuild(ledger, db).rebuild("acme", window)
    assert await ledger.balance("acme", window.key) == Balance(used=7, reserved=0)

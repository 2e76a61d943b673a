"""Where a budget stands: its limit and the balance of its current window, for
``GET /v1/budget`` and the admin API's budget routes.

Every budget that applies to a caller is listed: its tenant's (tokens, money), its API key's
and, when the caller names one (``?user=``), that end user's. A balance the ledger does not
know is rebuilt from the usage records first, as admission does
(`gateway.ledger.balance_rebuild`), so what is shown is what the next request is admitted on.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from gateway.ledger.balance_rebuild import BalanceRebuild
from gateway.ledger.budget_ledger import BudgetAccount, BudgetLedger
from gateway.storage.database import Database
from gateway.storage.scoped_budgets import get_budgets
from policies.budget_period import budget_window
from policies.quota import BudgetPeriod, TenantQuota
from policies.scoped_budgets import BudgetScope, BudgetUnit, ScopedBudget, tenant_budgets


class BudgetStanding(BaseModel):
    """One budget in its current window: ``unit`` tokens, or micros (millionths of
    ``currency``, the code the models are priced in; null for a token budget); ``subject``:
    the key's id or the end user (null for the tenant's own); ``alert_thresholds``: its own
    (null: the ``alerts:`` default)."""

    object: Literal["budget.standing"] = "budget.standing"
    scope: BudgetScope
    subject: str | None
    unit: BudgetUnit
    limit: int
    period: BudgetPeriod
    window_start: datetime | None
    window_end: datetime | None
    used: int
    reserved: int
    remaining: int
    alert_thresholds: list[int] | None = None
    currency: str | None = None


async def budget_standing(
    db: Database,
    ledger: BudgetLedger,
    tenant_id: str,
    budget: ScopedBudget,
    now: datetime,
    currency: str,
) -> BudgetStanding:
    window = budget_window(budget.period, now)
    account = BudgetAccount.of(budget)
    if not await ledger.is_known(tenant_id, window.key, account):
        await BalanceRebuild(ledger, db).rebuild(tenant_id, window, account)
    balance = await ledger.balance(tenant_id, window.key, account)
    return BudgetStanding(
        scope=budget.scope,
        subject=budget.subject or None,
        unit=budget.unit,
        limit=budget.limit,
        period=budget.period,
        window_start=window.start,
        window_end=window.end,
        used=balance.used,
        reserved=balance.reserved,
        remaining=balance.remaining(budget.limit),
        alert_thresholds=None if budget.alert_thresholds is None else list(budget.alert_thresholds),
        currency=currency if budget.unit == "micros" else None,
    )


async def standings_of(
    db: Database,
    ledger: BudgetLedger,
    tenant_id: str,
    quota: TenantQuota,
    key_id: str | None,
    end_user: str | None,
    now: datetime,
    currency: str,
) -> list[BudgetStanding]:
    """Every budget that applies to a request of ``key_id`` naming ``end_user``, in the order
    admission checks them: tenant, key, end user."""
    budgets = tenant_budgets(quota)
    budgets += [b for b in await run_in_threadpool(_scoped, db, tenant_id, key_id, end_user) if b]
    return [await budget_standing(db, ledger, tenant_id, b, now, currency) for b in budgets]


def _scoped(
    db: Database, tenant_id: str, key_id: str | None, end_user: str | None
) -> tuple[ScopedBudget | None, ScopedBudget | None]:
    with db.session() as session:
        return get_budgets(session, tenant_id, key_id, end_user)

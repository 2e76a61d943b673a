"""Budgets below the tenant, stored: one per API key or end user, read, set and cleared.

A row (``scoped_budgets``, migration 0005) is a `ScopedBudget` keyed by ``(tenant_id, scope,
subject)``: scope ``key`` names a key's id, scope ``user`` an end user (the request's
``user``, which only means something within its tenant). A tenant's own budgets stay in its
quota; a budget's own alert thresholds are kept with it (migration 0008; null: the
``alerts:`` default). Functions take a ``Session`` and leave the transaction to the caller,
as the other repositories do; the admin API bumps the tenant's auth epoch after it commits a
change, so every gateway's `gateway.admission.scoped_budget_lookup` reads it again.
"""

from __future__ import annotations

from typing import cast

from sqlalchemy import select
from sqlalchemy.orm import Session

from gateway.storage.models import ScopedBudget as ScopedBudgetRow
from gateway.storage.models import utc_now
from policies.quota import BudgetPeriod
from policies.scoped_budgets import BudgetScope, BudgetUnit, ScopedBudget


def get_budget(
    session: Session, tenant_id: str, scope: BudgetScope, subject: str
) -> ScopedBudget | None:
    row = session.get(ScopedBudgetRow, (tenant_id, scope, subject))
    return None if row is None else _budget_of(row)


def get_budgets(
    session: Session, tenant_id: str, key_id: str | None, end_user: str | None
) -> tuple[ScopedBudget | None, ScopedBudget | None]:
    """The key's and the end user's budgets (either None: no such budget), in one query."""
    wanted = [("key", key_id), ("user", end_user)]
    subjects = [(scope, subject) for scope, subject in wanted if subject is not None]
    if not subjects:
        return None, None
    rows = session.scalars(
        select(ScopedBudgetRow).where(
            ScopedBudgetRow.tenant_id == tenant_id,
            ScopedBudgetRow.scope.in_([scope for scope, _ in subjects]),
            ScopedBudgetRow.subject.in_([subject for _, subject in subjects]),
        )
    )
    found = {(row.scope, row.subject): _budget_of(row) for row in rows}
    return found.get(("key", key_id or "")), found.get(("user", end_user or ""))


def put_budget(session: Session, tenant_id: str, budget: ScopedBudget) -> ScopedBudget:
    """Set (create or replace) the budget of ``budget.subject``; returns it as stored."""
    if budget.scope == "tenant":
        raise ValueError("a tenant's own budget is part of its quota, not a scoped budget")
    now = utc_now()
    row = session.get(ScopedBudgetRow, (tenant_id, budget.scope, budget.subject))
    if row is None:
        row = ScopedBudgetRow(
            tenant_id=tenant_id,
            scope=budget.scope,
            subject=budget.subject,
            created_at=now,
        )
        session.add(row)
    row.unit, row.amount, row.period, row.updated_at = budget.unit, budget.limit, budget.period, now
    thresholds = budget.alert_thresholds
    row.alert_thresholds = None if thresholds is None else list(thresholds)
    session.flush()
    return _budget_of(row)


def delete_budget(session: Session, tenant_id: str, scope: BudgetScope, subject: str) -> bool:
    """Clear the budget; False if there was none."""
    row = session.get(ScopedBudgetRow, (tenant_id, scope, subject))
    if row is None:
        return False
    session.delete(row)
    session.flush()
    return True


def _budget_of(row: ScopedBudgetRow) -> ScopedBudget:
    return ScopedBudget(
        scope=cast(BudgetScope, row.scope),
        unit=cast(BudgetUnit, row.unit),
        limit=row.amount,
        period=cast(BudgetPeriod, row.period),
        subject=row.subject,
        alert_thresholds=None if row.alert_thresholds is None else tuple(row.alert_thresholds),
    )

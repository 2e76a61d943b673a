"""One tenant as its page shows it: every budget that applies (the tenant's own, in tokens
and in money; each key's; each end user's) with what its window has used, the keys with when
each was last used, and the end users by spend this month. The admin's tenant page and the
tenant's own view both read this; it is one read transaction of indexed, windowed queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session

from gateway.console.page_queries import (
    EndUserSpend,
    budget_used,
    end_users_by_spend,
    keys_last_used,
    scoped_budgets_of,
    tenant_keys,
)
from gateway.storage.tenants import TenantInfo, get_tenant
from policies.budget_period import budget_window
from policies.quota import TenantQuota
from policies.scoped_budgets import ScopedBudget, money_text, tenant_budgets

NUM_END_USERS_SHOWN = 20
LEVEL_NAMES = {"tenant": "Tenant", "key": "API key", "user": "End user"}


@dataclass(frozen=True)
class BudgetUse:
    budget: ScopedBudget
    used: int
    window_end: datetime | None  # None: a total budget, never reset

    @property
    def level(self) -> str:
        return LEVEL_NAMES[self.budget.scope]

    @property
    def share(self) -> float:
        return self.used / self.budget.limit if self.budget.limit else 1.0

    def amount(self, value: int, currency: str) -> str:
        """``1.25 USD`` or ``1,000 tokens``: how the budget table shows used and limit."""
        if self.budget.unit == "micros":
            return money_text(value, currency)
        return f"{value:,} tokens"


@dataclass(frozen=True)
class KeyView:
    id: str
    prefix: str
    name: str
    created_at: datetime
    revoked_at: datetime | None
    expires_at: datetime | None
    last_used_at: datetime | None

    def is_active(self, now: datetime) -> bool:
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)


@dataclass(frozen=True)
class TenantOverview:
    tenant: TenantInfo
    quota: TenantQuota
    budgets: list[BudgetUse]
    keys: list[KeyView]
    end_users: list[EndUserSpend]


def tenant_overview(session: Session, tenant_id: str, now: datetime) -> TenantOverview | None:
    """The tenant's overview, or None for no live tenant ``tenant_id``."""
    tenant = get_tenant(session, tenant_id)
    if tenant is None:
        return None
    quota = stored_quota(tenant)
    budgets = []
    for budget in [*tenant_budgets(quota), *scoped_budgets_of(session, tenant_id)]:
        window = budget_window(budget.period, now)
        used = budget_used(session, tenant_id, budget, window)
        budgets.append(BudgetUse(budget, used, window.end))
    rows = tenant_keys(session, tenant_id)
    last_used = keys_last_used(session, [row.id for row in rows])
    keys = [
        KeyView(
            row.id,
            row.prefix,
            row.name,
            row.created_at,
            row.revoked_at,
            row.expires_at,
            last_used.get(row.id),
        )
        for row in rows
    ]
    month = budget_window("month", now)
    end_users = (
        []
        if month.start is None or month.end is None
        else end_users_by_spend(session, tenant_id, month.start, month.end, NUM_END_USERS_SHOWN)
    )
    return TenantOverview(tenant, quota, budgets, keys, end_users)


def stored_quota(tenant: TenantInfo) -> TenantQuota:
    """The tenant's quota as admission reads it: stored, with the tenant's tier."""
    values: dict[str, Any] = {**tenant.quota, "tier": tenant.tier}
    return TenantQuota.from_dict(values)

"""A budget balance the ledger does not know, rebuilt from the usage records.

A ledger starts empty (a new gateway, a Redis restarted without its data, a period no request
has reserved in yet): its balance is then unknown, and admission refuses to reserve against
it (`gateway.admission.admission_store.BalanceUnknown`) until it is rebuilt: ``used`` is
what the records charge to the period, since every record's prompt and completion tokens
(and its ``cost_micros``) are exactly what its reservation settled to. A key's budget sums
the records of that key (``key_id``), an end user's those of that user within the tenant
(``end_user``), a money budget their ``cost_micros``.
"""

from __future__ import annotations

from datetime import datetime, timezone

import anyio

from gateway.ledger.budget_ledger import TENANT_TOKENS, BudgetAccount, BudgetLedger
from gateway.storage.database import Database
from gateway.storage.usage_store import sum_tokens
from policies.budget_period import BudgetWindow

_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_FAR_FUTURE = datetime(9999, 1, 1, tzinfo=timezone.utc)


class BalanceRebuild:
    def __init__(self, ledger: BudgetLedger, database: Database) -> None:
        self._ledger = ledger
        self._database = database

    async def rebuild(
        self, tenant_id: str, window: BudgetWindow, account: BudgetAccount = TENANT_TOKENS
    ) -> None:
        """Set the window's ``used`` from the records, unless the ledger knows it by now."""
        used = await anyio.to_thread.run_sync(self._used_in, tenant_id, window, account)
        await self._ledger.rebuild(tenant_id, window.key, used, account)

    def _used_in(self, tenant_id: str, window: BudgetWindow, account: BudgetAccount) -> int:
        with self._database.session() as session:
            totals = sum_tokens(
                session,
                tenant_id,
                window.start or _EPOCH,
                window.end or _FAR_FUTURE,
                key_id=account.subject if account.scope == "key" else None,
                end_user=account.subject if account.scope == "user" else None,
            )
        if account.unit == "micros":
            return totals.cost_micros
        return totals.prompt_tokens + totals.completion_tokens

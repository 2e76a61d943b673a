"""The admission step in process, for a single gateway (see ``admission_store``).

The ledger and rate-limit store it wraps never suspend inside their calls, so ``admit`` runs
from start to end without yielding to the event loop: atomic, as the Redis script is.
"""

from __future__ import annotations

from gateway.admission.admission_store import (
    AdmissionAsk,
    AdmissionResult,
    AuthChanged,
    BalanceUnknown,
    Counted,
)
from gateway.auth.epochs import MemoryAuthEpochs
from gateway.ledger.budget_ledger import Reservation
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.ratelimit.memory_store import MemoryRateLimitStore

_NO_BUDGET_PERIOD = "-"  # the tenant's token budget, when none is asked (never held)


class MemoryAdmissionStore:
    def __init__(
        self,
        ledger: MemoryBudgetLedger,
        rate_limits: MemoryRateLimitStore,
        epochs: MemoryAuthEpochs,
    ) -> None:
        self._ledger = ledger
        self._rate_limits = rate_limits
        self._epochs = epochs

    async def admit(self, ask: AdmissionAsk) -> AdmissionResult:
        epoch = self._epochs.current_now(ask.tenant_id)
        if epoch != ask.auth_epoch:
            return AuthChanged(epoch)
        if not ask.more_budgets:  # the tenant's token budget alone, or none
            return await self._admit_tenant_tokens(ask)
        asks = ask.hold_asks(_NO_BUDGET_PERIOD)
        asked = [(index, hold) for index, hold in enumerate(asks) if hold.limit >= 0]
        for index, hold in asked:
            if not await self._ledger.is_known(ask.tenant_id, hold.period_key, hold.account):
                return BalanceUnknown(index)
        window = None
        if ask.has_rate_limit:
            window = await self._rate_limits.hit(
                ask.tenant_id, ask.tokens, ask.rpm_limit, ask.tpm_limit, ask.now
            )
            if not window.is_admitted:
                return Counted(window)
        if not asked:
            return Counted(window)
        held = await self._ledger.reserve_all(ask.tenant_id, [h for _, h in asked], ask.ttl_s)
        if isinstance(held, Reservation):
            return Counted(window, held)
        return Counted(window, balance=held.balance, refused_by=asked[held.index][0])

    async def _admit_tenant_tokens(self, ask: AdmissionAsk) -> AdmissionResult:
        """`admit` with at most one balance: the same steps, without the bookkeeping of many."""
        budget = ask.budget
        if budget is not None and not await self._ledger.is_known(ask.tenant_id, budget.period_key):
            return BalanceUnknown()
        window = None
        if ask.has_rate_limit:
            window = await self._rate_limits.hit(
                ask.tenant_id, ask.tokens, ask.rpm_limit, ask.tpm_limit, ask.now
            )
            if not window.is_admitted:
                return Counted(window)
        if budget is None:
            return Counted(window)
        reservation = await self._ledger.reserve(
            ask.tenant_id, budget.period_key, budget.limit, ask.tokens, budget.ttl_s
        )
        if reservation is not None:
            return Counted(window, reservation)
        return Counted(window, balance=await self._ledger.balance(ask.tenant_id, budget.period_key))

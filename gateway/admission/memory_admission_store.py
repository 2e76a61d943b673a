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
from gateway.ledger.memory_ledger import MemoryBudgetLedger
from gateway.ratelimit.memory_store import MemoryRateLimitStore


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

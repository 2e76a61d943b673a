"""Admission's second step: a plan counted against the tenant's rate limits and budget.

One call of the `AdmissionStore` (in process, or one Redis script) hits the rate-limit window
and reserves the plan's tokens at once, after checking that the key's tenant did not change
since the key was cached (`AuthChanged`: the caller reads the key again and plans afresh). A
budget balance the store does not know is rebuilt from the usage records first
(`BalanceRebuild`). The policies then turn what was counted into headers or a refusal::

    rate limits (429 + Retry-After) -> budget reservation (429)

Redis unreachable (every call bounded by ``redis_timeout_s``): with ``redis_failure_mode:
closed`` this step answers 503 ``service_unavailable``; with ``open`` the request is admitted
uncounted (no rate limit, no reservation; logged at most once a second and counted in
``uncounted_admissions``) and its usage is recorded as usual. A call whose reply came too
late may have reserved on the server all the same: that reservation is released in the
background (``gateway.ledger.settle_retries``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone

from redis.exceptions import RedisError

from gateway.admission.admission_store import (
    AdmissionAsk,
    AdmissionStore,
    AdmissionTimedOut,
    AuthChanged,
    BalanceUnknown,
    BudgetAsk,
    Counted,
)
from gateway.admission.outcomes import Admission, Refusal
from gateway.admission.planning_step import AdmissionPlan
from gateway.auth.epochs import AuthEpochs
from gateway.auth.key_cache import CachedKey
from gateway.errors import state_unavailable
from gateway.ledger.balance_rebuild import BalanceRebuild
from gateway.ledger.budget_ledger import Balance
from gateway.ledger.settle_retries import LedgerRetries
from gateway.observability.metrics import GatewayMetrics
from policies import Rejection, admit_budget, budget_window, check_rate_limit
from policies.budget_period import BudgetWindow

logger = logging.getLogger(__name__)

REDIS_WARNING_INTERVAL_S = 1.0


class CountingStep:
    def __init__(
        self,
        store: AdmissionStore,
        epochs: AuthEpochs,
        rebuild: BalanceRebuild,
        *,
        reservation_ttl_s: float,
        is_fail_open: bool,
        metrics: GatewayMetrics | None = None,
        retries: LedgerRetries | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``is_fail_open``: ``redis_failure_mode: open``. ``clock``: the rate-limit window's
        (unix seconds); ``monotonic``: the Redis warnings' throttle."""
        self._store = store
        self._epochs = epochs
        self._rebuild = rebuild
        self._reservation_ttl_s = reservation_ttl_s
        self._is_fail_open = is_fail_open
        self._metrics = metrics
        self._retries = retries
        self._clock = clock
        self._monotonic = monotonic
        self._redis_warned_at = float("-inf")  # one log line a second while Redis is down
        self._num_unlogged = 0

    async def count(self, key: CachedKey, plan: AdmissionPlan) -> Admission | Refusal | AuthChanged:
        caller, quota, tokens = key.caller, key.caller.quota, plan.tokens
        budget = window = None
        if quota.budget_tokens is not None:
            window = budget_window(quota.budget_period, datetime.now(timezone.utc))
            budget = BudgetAsk(window.key, quota.budget_tokens, self._reservation_ttl_s)
        now = self._clock()
        ask = AdmissionAsk(caller.tenant_id, key.epoch, tokens, quota.rpm, quota.tpm, now, budget)
        try:
            result = await self._store.admit(ask)
            if isinstance(result, BalanceUnknown) and window is not None:
                await self._rebuild.rebuild(caller.tenant_id, window)
                result = await self._store.admit(ask)
        except RedisError as exc:
            return self._on_redis_failure(caller.tenant_id, plan, exc)
        if isinstance(result, AuthChanged):
            return result
        if not isinstance(result, Counted):  # unknown again: emptied twice in a row
            raise RuntimeError("the budget balance could not be rebuilt; please retry")
        headers: Mapping[str, str] = {}
        if result.window is not None:
            allowance = check_rate_limit(
                result.window, rpm=quota.rpm, tpm=quota.tpm, request_tokens=tokens, now=now
            )
            if isinstance(allowance, Rejection):
                return plan.refuse(allowance)
            headers = allowance.headers
        if result.balance is not None and window is not None and budget is not None:
            return plan.refuse(_budget_refusal(result.balance, tokens, budget.limit, window))
        return plan.admit(result.reservation, headers)

    async def current_epoch(self, tenant_id: str) -> str | None:
        """The tenant's auth epoch; ``None`` if Redis failed and the failure mode is open."""
        try:
            return await self._epochs.current(tenant_id)
        except RedisError:
            if not self._is_fail_open:
                raise
            return None

    def _on_redis_failure(self, tenant_id: str, plan: AdmissionPlan, exc: RedisError) -> Admission:
        """Redis failed: a 503 (``redis_failure_mode: closed``) or, fail-open, an admission
        that holds no reservation and passed no rate limit (its usage is still recorded)."""
        maybe_held = exc.reservation if isinstance(exc, AdmissionTimedOut) else None
        if maybe_held is not None and self._retries is not None:  # free what it may hold
            self._retries.later(maybe_held, 0)
        now = self._monotonic()
        if now - self._redis_warned_at < REDIS_WARNING_INTERVAL_S:
            self._num_unlogged += 1
        else:
            logger.warning(
                "Redis failed while admitting a request of tenant %s (%s); %s "
                "(%d more since the last line)",
                tenant_id,
                exc,
                "admitted without rate limits or budget" if self._is_fail_open else "answered 503",
                self._num_unlogged,
            )
            self._redis_warned_at, self._num_unlogged = now, 0
        if not self._is_fail_open:
            raise state_unavailable("its rate-limit and budget store") from None
        if self._metrics is not None:
            self._metrics.uncounted_admissions.inc()
        return plan.admit(None)


def _budget_refusal(balance: Balance, tokens: int, limit: int, window: BudgetWindow) -> Rejection:
    rejection = admit_budget(
        used=balance.used,
        reserved=balance.reserved,
        request_tokens=tokens,
        limit=limit,
        window=window,
    )
    # The store refused on the balance it saw, so the policy agrees; the fallback only keeps
    # the types honest.
    return rejection or Rejection(
        429, "insufficient_quota", "insufficient_quota", "You exceeded your token budget."
    )

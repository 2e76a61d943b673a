"""Admission's second step: a plan counted against the tenant's rate limits and budgets.

One call of the `AdmissionStore` (in process, or one Redis script) hits the rate-limit window
and reserves against every budget that applies at once, after checking that the key's tenant
did not change since the key was cached (`AuthChanged`: the caller reads the key again and
plans afresh). The budgets are the tenant's (its quota's tokens and money), its key's and
its end user's (`ScopedBudgetLookup`, cached under the same auth epoch); each reserves the
plan's worst case in its unit (`policies.scoped_budgets`). A budget balance the store does
not know is rebuilt from the usage records first (`BalanceRebuild`), one at a time. The
policies then turn what was counted into headers or a refusal::

    rate limits (429 + Retry-After) -> budget reservation (429 naming the budget that refused)

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
from dataclasses import dataclass, replace
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
from gateway.admission.scoped_budget_lookup import ScopedBudgetLookup
from gateway.auth.epochs import AuthEpochs
from gateway.auth.key_cache import CachedKey
from gateway.errors import state_unavailable
from gateway.ledger.balance_rebuild import BalanceRebuild
from gateway.ledger.budget_ledger import BudgetAccount, HoldAsk
from gateway.ledger.settle_retries import LedgerRetries
from gateway.observability.metrics import GatewayMetrics
from policies import Rejection, budget_window, check_rate_limit
from policies.budget_period import BudgetWindow
from policies.quota import BudgetPeriod
from policies.scoped_budgets import (
    DEFAULT_CURRENCY,
    BudgetCheck,
    PriceList,
    ScopedBudget,
    budget_refusal,
    reservation_amount,
    tenant_budgets,
)

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
        scoped: ScopedBudgetLookup | None = None,
        prices: Callable[[str], PriceList] | None = None,
        currency: str = DEFAULT_CURRENCY,
    ) -> None:
        """``is_fail_open``: ``redis_failure_mode: open``. ``clock``: the rate-limit window's
        (unix seconds); ``monotonic``: the Redis warnings' throttle. ``scoped``: where the
        key's and end user's budgets are read (none: the tenant's only); ``prices``: a model
        version's prices, for money budgets; ``currency``: the code they are in, for a
        refusal's message."""
        self._store = store
        self._epochs = epochs
        self._rebuild = rebuild
        self._reservation_ttl_s = reservation_ttl_s
        self._is_fail_open = is_fail_open
        self._metrics = metrics
        self._retries = retries
        self._clock = clock
        self._monotonic = monotonic
        self._scoped = scoped
        self._prices = prices
        self._currency = currency
        self._redis_warned_at = float("-inf")  # one log line a second while Redis is down
        self._num_unlogged = 0

    async def count(self, key: CachedKey, plan: AdmissionPlan) -> Admission | Refusal | AuthChanged:
        caller, quota, tokens = key.caller, key.caller.quota, plan.tokens
        budgets = tenant_budgets(quota)
        if self._scoped is not None:
            budgets += await self._scoped.budgets(
                caller.tenant_id, key.epoch, caller.key_id, plan.end_user
            )
        asked = self._asked(budgets, plan) if budgets else _Asked(None, (), [None])
        now = self._clock()
        ask = AdmissionAsk(
            caller.tenant_id,
            key.epoch,
            tokens,
            quota.rpm,
            quota.tpm,
            now,
            asked.budget,
            asked.more,
            self._reservation_ttl_s,
        )
        try:
            result = await self._store.admit(ask)
            for _ in range(len(asked.checks)):  # each unknown balance rebuilt once at most
                if not isinstance(result, BalanceUnknown):
                    break
                check = asked.checks[result.index]
                if check is None or check.window is None:
                    break
                account = BudgetAccount.of(check.budget)
                await self._rebuild.rebuild(caller.tenant_id, check.window, account)
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
        if result.balance is not None:
            refused = asked.checks[result.refused_by]
            if refused is not None:
                balance = result.balance
                check = replace(refused, used=balance.used, reserved=balance.reserved)
                return plan.refuse(budget_refusal(check, self._currency))
        return plan.admit(result.reservation, headers, tuple(budgets))

    def _asked(self, budgets: list[ScopedBudget], plan: AdmissionPlan) -> _Asked:
        """What the store is asked to hold for ``budgets``: the tenant's token budget as
        ``budget`` (index 0), every other in ``more`` (index 1 on), each with its amount."""
        now = datetime.now(timezone.utc)
        windows: dict[BudgetPeriod, BudgetWindow] = {}
        budget: BudgetAsk | None = None
        more: list[HoldAsk] = []
        checks: list[BudgetCheck | None] = [None]
        for scoped in budgets:
            window = windows.get(scoped.period)
            if window is None:
                window = windows[scoped.period] = budget_window(scoped.period, now)
            if scoped.unit == "tokens":
                amount = plan.tokens
            else:
                amount = reservation_amount(
                    "micros",
                    self._prices_of(plan.version),
                    plan.prompt_tokens,
                    plan.max_tokens,
                    plan.num_choices,
                )
            check = BudgetCheck(scoped, used=0, reserved=0, amount=amount, window=window)
            if scoped.scope == "tenant" and scoped.unit == "tokens":
                budget = BudgetAsk(window.key, scoped.limit, self._reservation_ttl_s)
                checks[0] = check
            else:
                more.append(HoldAsk(BudgetAccount.of(scoped), window.key, scoped.limit, amount))
                checks.append(check)
        return _Asked(budget, tuple(more), checks)

    def _prices_of(self, version: str) -> PriceList:
        if self._prices is None:
            raise RuntimeError("a money budget applies but the counting step was given no prices")
        return self._prices(version)

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


@dataclass(frozen=True)
class _Asked:
    """The budgets asked of the store and, by the store's index, each one's check."""

    budget: BudgetAsk | None
    more: tuple[HoldAsk, ...]
    checks: list[BudgetCheck | None]

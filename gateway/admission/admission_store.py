"""The admission store: everything a request counts against, checked and recorded at once.

One call per request, the counting step's (``counting_step``): one Redis script, or one
uninterrupted run on the event loop::

    auth epoch changed?  ──yes──► AuthChanged(epoch)   nothing counted; re-read the key, retry
         │ no
    a budget asked whose balance is unknown? ──yes──► BalanceUnknown(index)   nothing
         │ no                                                  counted; rebuild it
    rate limits asked: hit the window (``rate_limit_store``) ──refused──► Counted(window)
         │ admitted (or none asked)
    budgets asked: reserve all or none (``budget_ledger``) ──refused──► Counted(window,
         │                                           balance=..., refused_by=index)
         ▼
    Counted(window, reservation)

The budgets asked are the tenant's token budget (``budget``, index 0; it reserves the ask's
``tokens``) and ``more_budgets`` (index 1 on: the tenant's money budget, the key's, the end
user's), each with its own amount. A request with only the tenant's token budget costs what
it always did: one script, one balance.

The store only counts; the policies turn a ``Counted`` into a decision, headers and messages.
As before, a request the budget refuses keeps its rate-limit hit. Implementations:
``memory_admission_store`` (one gateway) and ``redis_admission_store`` (any number of
replicas). Settling and releasing a reservation stay with the ``BudgetLedger``.

A Redis store whose reply comes too late raises ``AdmissionTimedOut``: the script may still
run on the server, so the reservation it would have made is handed over to be released.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.ledger.budget_ledger import TENANT_TOKENS, Balance, HoldAsk, Reservation
from gateway.ratelimit.rate_limit_store import WindowState


class AdmissionTimedOut(RedisTimeoutError):
    """The admission step's reply came too late; ``reservation``: what it may have reserved
    (``None`` when no budget was asked)."""

    def __init__(self, message: str, reservation: Reservation | None) -> None:
        super().__init__(message)
        self.reservation = reservation


@dataclass(frozen=True)
class BudgetAsk:
    period_key: str
    limit: int
    ttl_s: float


@dataclass(frozen=True)
class AdmissionAsk:
    """What one request asks of the store. ``now`` is unix seconds, for the rate-limit window
    (the ledger uses its own clock); ``auth_epoch`` is the epoch its cached key was read under."""

    tenant_id: str
    auth_epoch: str
    tokens: int
    rpm_limit: int | None
    tpm_limit: int | None
    now: float
    budget: BudgetAsk | None
    more_budgets: tuple[HoldAsk, ...] = ()
    more_ttl_s: float = 0.0  # the hold's ttl when ``budget`` is None

    @property
    def has_rate_limit(self) -> bool:
        return self.rpm_limit is not None or self.tpm_limit is not None

    @property
    def ttl_s(self) -> float:
        return self.budget.ttl_s if self.budget is not None else self.more_ttl_s

    def hold_asks(self, no_budget_period: str) -> list[HoldAsk]:
        """Every budget asked, by index: the tenant's token budget first (its period
        ``no_budget_period`` and limit -1 when none is asked), then ``more_budgets``."""
        budget = self.budget
        first = (
            HoldAsk(TENANT_TOKENS, budget.period_key, budget.limit, self.tokens)
            if budget is not None
            else HoldAsk(TENANT_TOKENS, no_budget_period, -1, self.tokens)
        )
        return [first, *self.more_budgets]


@dataclass(frozen=True)
class Counted:
    """``window``: the rate-limit hit (``None``: no limit asked). ``reservation``: the budget
    holds (``None``: no budget asked, or refused). ``balance``: the balance that refused it,
    ``refused_by`` its index (0: ``budget``; 1 on: ``more_budgets``)."""

    window: WindowState | None
    reservation: Reservation | None = None
    balance: Balance | None = None
    refused_by: int = 0


@dataclass(frozen=True)
class AuthChanged:
    """The tenant's keys or quota changed since the key was cached; nothing was counted."""

    epoch: str


@dataclass(frozen=True)
class BalanceUnknown:
    """The balance of the budget at ``index`` (as in `Counted`) must be rebuilt from the
    usage records; nothing was counted."""

    index: int = 0


AdmissionResult = Counted | AuthChanged | BalanceUnknown


class AdmissionStore(Protocol):
    async def admit(self, ask: AdmissionAsk) -> AdmissionResult: ...

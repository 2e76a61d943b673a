"""Budget ledger: the one place that changes a budget's balance.

A balance belongs to one ``(tenant_id, account, period_key)``: the `BudgetAccount` is the
tenant's own token budget (`TENANT_TOKENS`, what every method takes by default), its money
budget, or one of its API keys' or end users' budgets (``policies.scoped_budgets``), each in
tokens or micros. The period key is opaque here (``"day:2025-06-01"``, ``"month:2025-06"``,
``"total"``: the caller chooses). A balance holds

- ``used``: what the engine reported as consumed (settled), in the account's unit, and
- live reservations: ``reservation_id -> amount``, each with an expiry.

A request that several budgets apply to reserves against all of them in one atomic step,
``reserve_all``: either every balance holds its amount under the one reservation id, or
none does and the first that would not fit is named (`Refused`). Its settle and release
finish every hold at once, each charged in its unit (`Charge`: tokens, or the usage
record's ``cost_micros``).

Life of one request::

    reserve(prompt_tokens + max_tokens) ──None──> 429 insufficient_quota
        │ Reservation
        ▼
    forward to the engine ──never started──> release(reservation)   (nothing was used)
        │
        ▼
    stream ends (done, error, or client gone) ──> settle(reservation, usage.total_tokens)
        │
        └── gateway dies instead: the reservation expires after ``ttl_s`` and stops counting

Invariant (every operation is atomic, across any number of gateway replicas for the Redis
ledger): ``reserve`` admits only if ``used + reserved + tokens <= limit``, where ``reserved``
is the sum of live (unexpired, unsettled, unreleased) reservations. So as long as each request
consumes at most what it reserved and settles before its reservation expires, ``used`` never
exceeds the limit. Settlement records the engine's real usage even when it is larger than the
reservation or arrives after expiry (the tokens *were* consumed), so pick ``ttl_s`` longer than
the longest request: a reservation that expires early frees budget that a late settle then
spends a second time.

``settle`` and ``release`` are idempotent and terminal: the first of them on a reservation
wins and later calls are no-ops. A ledger forgets a reservation once it is finished, so what
it holds follows the requests in flight, not the requests served; one that *expired*
unfinished is remembered for a retention period (an hour by default) so that its late settle
counts once. A settle the ledger cannot match to a reservation it holds or remembers
(finished before, lapsed longer ago than the retention, or lost with an emptied Redis) is a
no-op: the usage record still carries those tokens.

After a restart (memory) or an emptied Redis, a balance is *unknown*: the gateway sums its
usage records and calls ``rebuild``, which sets ``used`` only if no one rebuilt it first.
``reserve`` on an unknown balance counts ``used`` as 0, so check ``is_known`` first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from policies.scoped_budgets import BudgetScope, BudgetUnit, ScopedBudget

DEFAULT_SETTLED_RETENTION_S = 3600.0


@dataclass(frozen=True)
class BudgetAccount:
    """Whose balance, within a tenant: its own (``scope="tenant"``), one of its API keys' or
    one of its end users' (``subject``: the key's id, the user's id), in ``unit``."""

    scope: BudgetScope = "tenant"
    subject: str = ""
    unit: BudgetUnit = "tokens"

    @classmethod
    def of(cls, budget: ScopedBudget) -> BudgetAccount:
        if budget.scope == "tenant" and budget.unit == "tokens":
            return TENANT_TOKENS  # one object: dict keys compare it by identity, fast
        return cls(budget.scope, budget.subject, budget.unit)


TENANT_TOKENS = BudgetAccount()


@dataclass(frozen=True)
class Hold:
    """``amount`` (in the account's unit) held against one balance."""

    account: BudgetAccount
    period_key: str
    amount: int


@dataclass(frozen=True)
class HoldAsk:
    """Hold ``amount`` against the balance if ``used + reserved + amount <= limit``."""

    account: BudgetAccount
    period_key: str
    limit: int
    amount: int


@dataclass(frozen=True)
class Charge:
    """What a finished request settles to: ``tokens`` for token budgets, ``micros`` (its
    usage record's ``cost_micros``) for money budgets."""

    tokens: int
    micros: int = 0


@dataclass(frozen=True)
class Reservation:
    """What one in-flight request holds; ``expires_at`` is unix seconds (ledger clock).

    The first hold is ``(account, period_key, tokens)`` (``tokens``: its amount, in the
    account's unit); ``more`` are the others, reserved in the same atomic step."""

    reservation_id: str
    tenant_id: str
    period_key: str
    tokens: int
    expires_at: float
    account: BudgetAccount = TENANT_TOKENS
    more: tuple[Hold, ...] = ()

    @property
    def holds(self) -> tuple[Hold, ...]:
        return (Hold(self.account, self.period_key, self.tokens), *self.more)


@dataclass(frozen=True)
class Refused:
    """``reserve_all`` held nothing: ``index`` is the first ask that did not fit, ``balance``
    its balance when it was refused."""

    index: int
    balance: Balance


@dataclass(frozen=True)
class Balance:
    """``used``: settled tokens; ``reserved``: tokens held by live reservations."""

    used: int
    reserved: int

    def remaining(self, limit: int) -> int:
        """Tokens a new reservation may still take under ``limit`` (never negative)."""
        return max(0, limit - self.used - self.reserved)


class BudgetLedger(Protocol):
    """Balances per (tenant, account, period). Implementations: memory and Redis."""

    async def reserve(
        self, tenant_id: str, period_key: str, limit: int, tokens: int, ttl_s: float
    ) -> Reservation | None:
        """Hold ``tokens`` of the tenant's token budget if ``used + reserved + tokens <=
        limit``; ``None`` means refuse."""
        ...

    async def reserve_all(
        self, tenant_id: str, asks: Sequence[HoldAsk], ttl_s: float
    ) -> Reservation | Refused:
        """Hold every ask's amount under one reservation if each fits its limit, else none."""
        ...

    async def settle(
        self, reservation: Reservation, used_tokens: int, used_micros: int = 0
    ) -> None:
        """Drop the reservation's holds and add to each balance's ``used`` what it charges
        in its unit (``used_tokens`` or ``used_micros``). Idempotent."""
        ...

    async def release(self, reservation: Reservation) -> None:
        """Drop the reservation without recording usage (cancelled before any use)."""
        ...

    async def balance(
        self, tenant_id: str, period_key: str, account: BudgetAccount = TENANT_TOKENS
    ) -> Balance:
        """The current balance; expired reservations are not counted."""
        ...

    async def rebuild(
        self,
        tenant_id: str,
        period_key: str,
        used_tokens: int,
        account: BudgetAccount = TENANT_TOKENS,
    ) -> bool:
        """Set ``used`` (in the account's unit) from the usage records if the balance is
        unknown; True if it did."""
        ...

    async def is_known(
        self, tenant_id: str, period_key: str, account: BudgetAccount = TENANT_TOKENS
    ) -> bool:
        """Whether the balance was rebuilt since the store was last empty."""
        ...


def check_reserve_args(limit: int, tokens: int, ttl_s: float) -> None:
    """Raise ``ValueError`` for arguments no implementation accepts."""
    if limit < 0:
        raise ValueError(f"budget limit must be >= 0, got {limit}")
    if tokens <= 0:
        raise ValueError(f"a reservation must hold at least one token, got {tokens}")
    if not ttl_s > 0:
        raise ValueError(f"reservation ttl_s must be > 0, got {ttl_s}")


def check_asks(asks: Sequence[HoldAsk], ttl_s: float) -> None:
    """Raise ``ValueError`` unless ``asks`` name distinct balances, each a valid reserve."""
    if not asks:
        raise ValueError("reserve_all needs at least one budget to hold")
    for ask in asks:
        if ask.account.unit == "micros" and ask.amount == 0:  # a free model: it fits or not
            check_reserve_args(ask.limit, 1, ttl_s)
        else:
            check_reserve_args(ask.limit, ask.amount, ttl_s)
    if len({(ask.account, ask.period_key) for ask in asks}) != len(asks):
        raise ValueError("reserve_all was asked to hold one balance twice")


def charged(hold: Hold, used_tokens: int, used_micros: int) -> int:
    """What a settle adds to the hold's balance: the amount in its account's unit."""
    return used_micros if hold.account.unit == "micros" else used_tokens


def check_used_tokens(used_tokens: int) -> None:
    if used_tokens < 0:
        raise ValueError(f"used_tokens must be >= 0, got {used_tokens}")

"""Budgets at three levels, in tokens or in money: which apply to a request, what it
reserves against each, and which one refuses it.

A request is charged against every budget that applies to it: its tenant's (the quota's
``budget_tokens`` and ``budget_micros``), its API key's and its end user's (the request's
``user``, within its tenant). It is admitted only if it fits all of them; each keeps
``budget_admission``'s invariant, ``used + reserved + amount <= limit``, in its own unit::

    unit     reserved before forwarding (worst case)           settled after
    tokens   prompt + n * max_tokens                           prompt + completion
    micros   prompt at the input price                         the usage record's cost_micros
             + n * max_tokens at the output price              (cached input at its own price)

A money reservation prices the whole prompt at the input price because cache hits are known
only once the engine answers; the settlement then charges cached input at ``cached_input``,
as the usage record does (`PriceList.cost_micros` is the one pricing rule). A refusal names
the first budget, in the order tenant, key, end user, that the request does not fit, with its
level and unit, so a client can tell which budget to raise or wait for. Money is named in
the currency the prices are in (the gateway's ``currency`` setting, passed in: ``5.00 USD``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from policies.budget_admission import budget_rejection, fits_budget, reservation_tokens
from policies.budget_alerts import check_budget_thresholds
from policies.budget_period import BudgetWindow
from policies.decision import Rejection
from policies.quota import BUDGET_PERIODS, BudgetPeriod, TenantQuota

BudgetScope = Literal["tenant", "key", "user"]
BudgetUnit = Literal["tokens", "micros"]
BUDGET_SCOPES: tuple[BudgetScope, ...] = get_args(BudgetScope)
BUDGET_UNITS: tuple[BudgetUnit, ...] = get_args(BudgetUnit)
MICROS_PER_UNIT = 1_000_000
DEFAULT_CURRENCY = "USD"
_CURRENCY_CODE = re.compile(r"[A-Z]{3}")

_LEVEL_NAMES: dict[BudgetScope, str] = {
    "tenant": "your tenant's",
    "key": "the API key's",
    "user": "the end user's",
}


class PriceList(Protocol):
    """A model's prices (``gateway.settings.Prices``): micros per million tokens."""

    def cost_micros(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """The price of one request, cached input at its own price, rounded up."""
        ...


@dataclass(frozen=True)
class ScopedBudget:
    """One budget: ``limit`` in ``unit`` over ``period``. ``subject`` names whose it is (an
    API key's id, an end user's id; empty for the tenant's). ``alert_thresholds``: its own
    alert thresholds (percents of ``limit``, ascending); None: the settings' default."""

    scope: BudgetScope
    unit: BudgetUnit
    limit: int
    period: BudgetPeriod
    subject: str = ""
    alert_thresholds: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.scope not in BUDGET_SCOPES:
            raise ValueError(f"scope must be one of {', '.join(BUDGET_SCOPES)}, got {self.scope!r}")
        if self.unit not in BUDGET_UNITS:
            raise ValueError(f"unit must be one of {', '.join(BUDGET_UNITS)}, got {self.unit!r}")
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 0:
            raise ValueError(f"limit must be a non-negative integer, got {self.limit!r}")
        if self.period not in BUDGET_PERIODS:
            raise ValueError(
                f"period must be one of {', '.join(BUDGET_PERIODS)}, got {self.period!r}"
            )
        if (self.scope == "tenant") != (self.subject == ""):
            raise ValueError("a tenant's budget names no subject; a key's or user's names one")
        if self.alert_thresholds is not None:
            thresholds = check_budget_thresholds(self.alert_thresholds)
            object.__setattr__(self, "alert_thresholds", thresholds)

    def describe(self, currency: str) -> str:
        """``the API key's budget of 5.00 USD (5000000 micros)``, ``your tenant's budget of
        100 tokens``: how a refusal names it."""
        if self.unit == "micros":
            amount = f"{money_text(self.limit, currency)} ({self.limit} micros)"
        else:
            amount = f"{self.limit} tokens"
        return f"{_LEVEL_NAMES[self.scope]} budget of {amount}"


@dataclass(frozen=True)
class BudgetCheck:
    """One budget and what its ledger holds: ``amount`` is what the request would reserve."""

    budget: ScopedBudget
    used: int
    reserved: int
    amount: int
    window: BudgetWindow | None = None


def tenant_budgets(quota: TenantQuota) -> list[ScopedBudget]:
    """The tenant's own budgets, tokens first: none, one or both (with the quota's alert
    thresholds)."""
    budgets = []
    period, thresholds = quota.budget_period, quota.alert_thresholds
    if quota.budget_tokens is not None:
        budgets.append(
            ScopedBudget("tenant", "tokens", quota.budget_tokens, period, "", thresholds)
        )
    if quota.budget_micros is not None:
        budgets.append(
            ScopedBudget("tenant", "micros", quota.budget_micros, period, "", thresholds)
        )
    return budgets


def reservation_amount(
    unit: BudgetUnit, prices: PriceList, prompt_tokens: int, max_tokens: int, num_choices: int = 1
) -> int:
    """What a request reserves against a budget in ``unit``: its worst case, the whole
    prompt at the input price and every choice's ``max_tokens`` at the output price."""
    tokens = reservation_tokens(prompt_tokens, max_tokens, num_choices)  # validates the counts
    if unit == "tokens":
        return tokens
    return prices.cost_micros(prompt_tokens, 0, num_choices * max_tokens)


def settlement_amount(
    unit: BudgetUnit, prices: PriceList, prompt_tokens: int, cached_tokens: int, completion: int
) -> int:
    """What a finished request charges a budget in ``unit``: what its usage record says."""
    if unit == "tokens":
        return prompt_tokens + completion
    return prices.cost_micros(prompt_tokens, cached_tokens, completion)


def admit_budgets(checks: Sequence[BudgetCheck], currency: str) -> Rejection | None:
    """None if the request fits every budget; else the 429 of the first it does not fit."""
    for check in checks:
        if not fits_budget(
            used=check.used,
            reserved=check.reserved,
            request_tokens=check.amount,
            limit=check.budget.limit,
        ):
            return budget_refusal(check, currency)
    return None


def budget_refusal(check: BudgetCheck, currency: str) -> Rejection:
    """The 429 ``insufficient_quota`` naming the budget ``check`` does not fit (money in
    ``currency``, the code the prices are in)."""
    return budget_rejection(
        what=check.budget.describe(currency),
        in_micros=check.budget.unit == "micros",
        used=check.used,
        reserved=check.reserved,
        amount=check.amount,
        limit=check.budget.limit,
        window=check.window,
    )


def format_money(micros: int) -> str:
    """Micros as units with two decimals (``5000000`` -> ``5.00``), more where they matter."""
    units, rest = divmod(micros, MICROS_PER_UNIT)
    text = f"{units}.{rest:06d}".rstrip("0")
    whole, _, fraction = text.partition(".")
    return f"{whole}.{fraction.ljust(2, '0')}"


def money_text(micros: int, currency: str) -> str:
    """Micros as an amount in ``currency``: ``5.00 USD``."""
    return f"{format_money(micros)} {currency}"


def check_currency(code: object) -> str:
    """``code`` if it is a currency code as ISO 4217 spells one (three uppercase letters,
    ``USD``, ``EUR``); else ``ValueError`` naming the setting."""
    if not isinstance(code, str) or not _CURRENCY_CODE.fullmatch(code):
        raise ValueError(
            f"currency must be a three-letter uppercase currency code such as USD or EUR "
            f"(the one the models' prices are in), got {code!r}"
        )
    return code

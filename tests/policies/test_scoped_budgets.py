"""A budget's refusal names its money in the prices' currency; the currency code is checked;
a budget's own alert thresholds are checked with it and the tenant's come from its quota."""

from datetime import datetime, timezone

import pytest

from policies.budget_period import budget_window
from policies.quota import TenantQuota
from policies.scoped_budgets import (
    BudgetCheck,
    ScopedBudget,
    admit_budgets,
    check_currency,
    format_money,
    money_text,
    tenant_budgets,
)


def test_money_is_named_in_the_currency_given():
    assert format_money(5_000_000) == "5.00"  # what a form shows to edit: the number alone
    assert money_text(5_000_000, "USD") == "5.00 USD"
    assert money_text(1_234_567, "EUR") == "1.234567 EUR"
    budget = ScopedBudget("key", "micros", 5_000_000, "day", subject="key_1")
    assert budget.describe("JPY") == "the API key's budget of 5.00 JPY (5000000 micros)"
    tokens = ScopedBudget("tenant", "tokens", 100, "day")
    assert tokens.describe("JPY") == "your tenant's budget of 100 tokens"


def test_a_money_refusal_names_the_currency():
    budget = ScopedBudget("user", "micros", 5_000_000, "month", subject="alice")
    window = budget_window("month", datetime(2026, 12, 3, tzinfo=timezone.utc))
    check = BudgetCheck(budget, used=4_000_000, reserved=0, amount=2_000_000, window=window)
    rejection = admit_budgets([check], "EUR")
    assert rejection is not None
    assert "You exceeded the end user's budget of 5.00 EUR (5000000 micros)" in rejection.message
    assert admit_budgets([BudgetCheck(budget, 0, 0, 1)], "EUR") is None


@pytest.mark.parametrize("code", ["USD", "EUR", "CHF"])
def test_a_currency_is_three_uppercase_letters(code):
    assert check_currency(code) == code


@pytest.mark.parametrize("code", ["usd", "US", "USDT", "U$D", "", None, 840])
def test_another_currency_code_is_refused_naming_the_setting(code):
    with pytest.raises(ValueError, match=r"^currency must be a three-letter uppercase"):
        check_currency(code)


def test_thresholds_are_checked_and_the_tenants_come_from_its_quota():
    quota = TenantQuota(budget_tokens=10, budget_micros=20, alert_thresholds=(30, 60))
    assert [b.alert_thresholds for b in tenant_budgets(quota)] == [(30, 60), (30, 60)]
    assert ScopedBudget("key", "tokens", 1, "day", "k", [25]).alert_thresholds == (25,)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^alert_thresholds "):
        ScopedBudget("key", "tokens", 1, "day", "k", (50, 25))

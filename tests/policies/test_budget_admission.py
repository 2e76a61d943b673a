from datetime import datetime, timedelta, timezone

import pytest

from policies.budget_admission import admit_budget, fits_budget, reservation_tokens
from policies.budget_period import budget_window
from tests.policies.budget_cases import (
    SCOPED_CASES,
    Advance,
    BudgetCase,
    Reserve,
    ScopedCase,
    case_id,
    cases_for,
    run_scoped_on_policy,
    scoped_case_id,
)


def test_reservation_is_prompt_plus_max_tokens():
    assert reservation_tokens(100, 50) == 150
    with pytest.raises(ValueError, match="non-negative"):
        reservation_tokens(-1, 5)


def test_reservation_counts_the_prompts_once_and_max_tokens_per_choice():
    assert reservation_tokens(100, 50, num_choices=1) == 150
    assert reservation_tokens(100, 50, num_choices=4) == 300  # n=4: the prompt once
    assert reservation_tokens(30, 16, num_choices=128) == 30 + 128 * 16
    with pytest.raises(ValueError, match="num_choices"):
        reservation_tokens(100, 50, num_choices=0)


def test_one_over_limit_is_refused():
    r = admit_budget(used=600, reserved=300, request_tokens=101, limit=1000)
    assert r is not None
    assert (r.status, r.code, r.type) == (429, "insufficient_quota", "insufficient_quota")
    assert "Used 600 and 300 reserved" in r.message
    assert "101" in r.message
    assert "limit 1000" in r.message


def test_message_names_window_and_reset():
    window = budget_window("day", datetime(2026, 11, 29, 10, tzinfo=timezone.utc))
    r = admit_budget(used=1000, reserved=0, request_tokens=1, limit=1000, window=window)
    assert r is not None
    assert "day:2026-11-29" in r.message
    assert "2026-11-30T00:00:00+00:00" in r.message


def test_request_larger_than_whole_budget_says_so():
    window = budget_window("day", datetime(2026, 11, 29, 10, tzinfo=timezone.utc))
    r = admit_budget(used=0, reserved=0, request_tokens=1001, limit=1000, window=window)
    assert r is not None
    assert "more than the whole budget" in r.message
    assert "resets" not in r.message


def test_negative_inputs_refused():
    with pytest.raises(ValueError, match="reserved must be non-negative"):
        admit_budget(used=0, reserved=-1, request_tokens=1, limit=10)


# -- the table of cases (tests/policies/budget_cases.py), against the policy ----------------


@pytest.mark.parametrize("case", cases_for("policy"), ids=case_id)
def test_budget_cases_against_the_policy(case: BudgetCase) -> None:
    """Each decision is ``admit_budget``'s over the balance the table expects before it, and
    the period keys the case ends with are windows its clock passes through."""
    before, now = case.start_balance, case.start
    keys = {budget_window(case.period, now).key}
    for step, after in case.steps:
        if isinstance(step, Reserve):
            rejection = admit_budget(
                used=before.used,
                reserved=before.reserved,
                request_tokens=step.tokens,
                limit=case.limit,
            )
            assert (rejection is None) == step.is_admitted, f"{step} on {before}"
            is_fit = fits_budget(
                used=before.used,
                reserved=before.reserved,
                request_tokens=step.tokens,
                limit=case.limit,
            )
            assert is_fit == step.is_admitted
        elif isinstance(step, Advance):
            now += timedelta(seconds=step.seconds)
            keys.add(budget_window(case.period, now).key)
        before = after
    assert {key for key, _ in case.ends_with} <= keys


@pytest.mark.parametrize("case", SCOPED_CASES, ids=scoped_case_id)
def test_scoped_budget_cases_against_the_policy(case: ScopedCase) -> None:
    run_scoped_on_policy(case)

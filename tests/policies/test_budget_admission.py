from datetime import datetime, timezone

import pytest

from policies.budget_admission import admit_budget, reservation_tokens
from policies.budget_period import budget_window


def test_reservation_is_prompt_plus_max_tokens():
    assert reservation_tokens(100, 50) == 150
    with pytest.raises(ValueError, match="non-negative"):
        reservation_tokens(-1, 5)


def test_exactly_at_limit_is_admitted():
    assert admit_budget(used=600, reserved=300, request_tokens=100, limit=1000) is None


def test_one_over_limit_is_refused():
    r = admit_budget(used=600, reserved=300, request_tokens=101, limit=1000)
    assert r is not None
    assert (r.status, r.code, r.type) == (429, "insufficient_quota", "insufficient_quota")
    assert "Used 600 and 300 reserved" in r.message
    assert "101" in r.message and "limit 1000" in r.message


def test_reservations_in_flight_count():
    # Nothing used yet, but in-flight reservations fill the budget.
    assert admit_budget(used=0, reserved=1000, request_tokens=1, limit=1000) is not None
    assert admit_budget(used=0, reserved=999, request_tokens=1, limit=1000) is None


def test_unlimited():
    assert admit_budget(used=10**12, reserved=10**12, request_tokens=10**9, limit=None) is None


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

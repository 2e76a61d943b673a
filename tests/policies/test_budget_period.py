from datetime import datetime, timedelta, timezone

import pytest

from policies.budget_period import budget_window, period_key

UTC = timezone.utc


def at(*args):
    return datetime(*args, tzinfo=UTC)


def test_day_window():
    w = budget_window("day", at(2026, 11, 29, 13, 45))
    assert w.key == "day:2026-11-29"
    assert w.start == at(2026, 11, 29)
    assert w.end == at(2026, 11, 30)


def test_day_rolls_over_exactly_at_utc_midnight():
    last = at(2026, 11, 29, 23, 59, 59, 999999)
    assert period_key("day", last) == "day:2026-11-29"
    assert period_key("day", last + timedelta(microseconds=1)) == "day:2026-11-30"


def test_other_timezones_are_converted_to_utc():
    tokyo = timezone(timedelta(hours=9))
    # 08:00 in Tokyo on the 30th is still the 29th in UTC.
    assert period_key("day", datetime(2026, 11, 30, 8, 0, tzinfo=tokyo)) == "day:2026-11-29"
    assert period_key("day", datetime(2026, 11, 30, 9, 0, tzinfo=tokyo)) == "day:2026-11-30"


def test_month_window_and_month_end():
    w = budget_window("month", at(2026, 11, 30, 23, 59, 59))
    assert w.key == "month:2026-11"
    assert (w.start, w.end) == (at(2026, 11, 1), at(2026, 12, 1))
    assert period_key("month", at(2026, 12, 1)) == "month:2026-12"


def test_december_ends_in_next_year():
    w = budget_window("month", at(2026, 12, 31, 12))
    assert (w.key, w.start, w.end) == ("month:2026-12", at(2026, 12, 1), at(2027, 1, 1))
    assert period_key("day", at(2026, 12, 31, 23, 59, 59)) == "day:2026-12-31"
    assert budget_window("day", at(2026, 12, 31)).end == at(2027, 1, 1)


def test_february_leap_year():
    assert budget_window("day", at(2028, 2, 28)).end == at(2028, 2, 29)
    assert budget_window("month", at(2028, 2, 29)).end == at(2028, 3, 1)


def test_total_is_unbounded():
    w = budget_window("total", at(2026, 11, 29))
    assert (w.key, w.start, w.end) == ("total", None, None)
    assert w.seconds_until_reset(at(2026, 11, 29)) is None


def test_seconds_until_reset():
    w = budget_window("day", at(2026, 11, 29, 23, 0))
    assert w.seconds_until_reset(at(2026, 11, 29, 23, 0)) == 3600.0


def test_naive_datetime_refused():
    with pytest.raises(ValueError, match="timezone-aware"):
        budget_window("day", datetime(2026, 11, 29))


def test_unknown_period_refused():
    with pytest.raises(ValueError, match="day, month or total"):
        budget_window("week", at(2026, 11, 29))  # type: ignore[arg-type]

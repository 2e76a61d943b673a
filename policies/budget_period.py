"""Budget periods as calendar windows in UTC.

A budget resets at UTC midnight (``day``), at 00:00 UTC on the first of the month
(``month``), or never (``total``). A window is half-open, ``[start, end)``: the
instant of midnight already belongs to the new day. The key names the window in
the ledger::

    day   -> "day:2026-11-29"   [2026-11-29T00:00Z, 2026-11-30T00:00Z)
    month -> "month:2026-11"    [2026-11-01T00:00Z, 2026-12-01T00:00Z)
    total -> "total"            unbounded (start and end are None)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from policies.quota import BudgetPeriod


@dataclass(frozen=True)
class BudgetWindow:
    key: str
    start: datetime | None
    end: datetime | None

    def seconds_until_reset(self, now: datetime) -> float | None:
        """Seconds from ``now`` to the end of the window; None for a ``total`` budget."""
        if self.end is None:
            return None
        return (self.end - _as_utc(now)).total_seconds()


def budget_window(period: BudgetPeriod, now: datetime) -> BudgetWindow:
    """The window of ``period`` that contains ``now`` (a timezone-aware datetime)."""
    now = _as_utc(now)
    if period == "total":
        return BudgetWindow("total", None, None)
    if period == "day":
        start = datetime(now.year, now.month, now.day, tzinfo=timezone.utc)
        return BudgetWindow(f"day:{start:%Y-%m-%d}", start, start + timedelta(days=1))
    if period == "month":
        start = datetime(now.year, now.month, 1, tzinfo=timezone.utc)
        if now.month == 12:
            end = datetime(now.year + 1, 1, 1, tzinfo=timezone.utc)
        else:
            end = datetime(now.year, now.month + 1, 1, tzinfo=timezone.utc)
        return BudgetWindow(f"month:{start:%Y-%m}", start, end)
    raise ValueError(f"budget period must be day, month or total, got {period!r}")


def period_key(period: BudgetPeriod, now: datetime) -> str:
    """Shorthand for ``budget_window(period, now).key``."""
    return budget_window(period, now).key


def _as_utc(now: datetime) -> datetime:
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError(
            f"budget periods need a timezone-aware datetime, got naive {now.isoformat()}; "
            "use datetime.now(timezone.utc)"
        )
    return now.astimezone(timezone.utc)

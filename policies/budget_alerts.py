"""Budget alerts: which thresholds (percentages of a budget's limit) a step of usage crossed.

A threshold's *level* is ``ceil(limit * percent / 100)`` in the budget's unit (tokens or
micros), and it is crossed when usage goes from below its level to at or above it::

    limit 1000, thresholds 50 / 80 / 100  ->  levels 500 / 800 / 1000
    used_before 450, used_after 820         ->  crossed: 50, 80

The edge is half-open, ``used_before < level <= used_after``, so consecutive steps
``(0, a], (a, b], (b, c]`` cross each level exactly once. That is why the gateway passes as
``used_before`` the highest usage it checked before for the same budget and period, not
``used_after`` minus the step's tokens: two settles that both read the balance after both
landed would otherwise each see only their own share and together skip a level between.
"Once per budget period" across gateway replicas is the alert outbox's unique key (budget,
period, threshold), not this function: two replicas may both see a crossing, one event is
kept.

A budget may name its own thresholds (`check_budget_thresholds`: stored with it, written as
the admin typed them, so they must already be ascending and unique); one that names none uses
the ``alerts:`` settings' default.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

DEFAULT_ALERT_THRESHOLDS: tuple[int, ...] = (50, 80, 100)
MAX_THRESHOLD_PERCENT = 1000  # an alert at 10x the limit still means something; beyond, a typo


def check_thresholds(percents: Iterable[object]) -> tuple[int, ...]:
    """The thresholds sorted and unique; ``ValueError`` naming a bad one (each a whole percent
    in 1..1000: 100 is the limit itself, more fires for usage past a soft limit)."""
    checked: set[int] = set()
    for percent in percents:
        if (
            isinstance(percent, bool)
            or not isinstance(percent, int)
            or not 1 <= percent <= MAX_THRESHOLD_PERCENT
        ):
            raise ValueError(
                f"alert thresholds must be whole percents of the limit in "
                f"1..{MAX_THRESHOLD_PERCENT} (e.g. [50, 80, 100]), got {percent!r}"
            )
        checked.add(percent)
    if not checked:
        raise ValueError("alert thresholds must name at least one percent, e.g. [50, 80, 100]")
    return tuple(sorted(checked))


def check_budget_thresholds(percents: object) -> tuple[int, ...]:
    """A budget's own thresholds: a list of whole percents in 1..1000, ascending and unique
    (``[50, 80, 100]``); ``ValueError`` starting with the field's name, ``alert_thresholds``,
    so a 400 can point at it. Unlike `check_thresholds` nothing is sorted or merged: a list
    out of order is more likely a typo than a wish."""
    hint = (
        f"a list of whole percents in 1..{MAX_THRESHOLD_PERCENT}, ascending and unique, "
        "e.g. [50, 80, 100]"
    )
    if isinstance(percents, str | bytes) or not isinstance(percents, list | tuple):
        raise ValueError(f"alert_thresholds must be {hint}, got {percents!r}")
    if not percents:
        raise ValueError(f"alert_thresholds must name at least one percent: {hint}")
    previous = 0
    for percent in percents:
        if (
            isinstance(percent, bool)
            or not isinstance(percent, int)
            or not 1 <= percent <= MAX_THRESHOLD_PERCENT
        ):
            raise ValueError(f"alert_thresholds must be {hint}; {percent!r} is not")
        if percent <= previous:
            raise ValueError(f"alert_thresholds must be {hint}; {percent} follows {previous}")
        previous = percent
    return tuple(percents)


def threshold_level(limit: int, percent: int) -> int:
    """The usage at which ``percent`` of ``limit`` is reached, rounded up (80% of 999 tokens
    is reached at 800, never at 799)."""
    if limit < 0:
        raise ValueError(f"a budget limit must be >= 0, got {limit}")
    return -(-limit * percent // 100)


def crossed_thresholds(
    *, used_before: int, used_after: int, limit: int, thresholds: Sequence[int]
) -> tuple[int, ...]:
    """The thresholds whose level lies in ``(used_before, used_after]``, in ascending order.

    A limit of 0 has every level at 0, which no usage crosses from below: it admits nothing,
    so there is nothing to warn about. Usage that went down (a new period read against the
    old one's mark) crosses nothing.
    """
    for name, value in (("used_before", used_before), ("used_after", used_after)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    return tuple(
        percent
        for percent in sorted(thresholds)
        if used_before < threshold_level(limit, percent) <= used_after
    )

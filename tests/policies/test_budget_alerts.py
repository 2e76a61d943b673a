import itertools

import pytest

from policies.budget_alerts import (
    DEFAULT_ALERT_THRESHOLDS,
    check_budget_thresholds,
    check_thresholds,
    crossed_thresholds,
    threshold_level,
)


def crossed(used_before: int, used_after: int, limit: int = 1000) -> tuple[int, ...]:
    return crossed_thresholds(
        used_before=used_before,
        used_after=used_after,
        limit=limit,
        thresholds=DEFAULT_ALERT_THRESHOLDS,
    )


def test_one_step_may_cross_several_thresholds():
    assert crossed(450, 820) == (50, 80)
    assert crossed(0, 5000) == (50, 80, 100)


def test_the_edge_is_half_open_so_each_level_is_crossed_once():
    assert crossed(0, 499) == ()
    assert crossed(0, 500) == (50,)
    assert crossed(500, 501) == ()  # at the level before: crossed by the step before
    steps = [0, 120, 500, 799, 800, 1000, 1200]
    fired = [p for a, b in itertools.pairwise(steps) for p in crossed(a, b)]
    assert fired == [50, 80, 100]


def test_levels_round_up():
    assert threshold_level(999, 80) == 800  # 799.2 is not yet 80%
    assert crossed_thresholds(used_before=799, used_after=799, limit=999, thresholds=[80]) == ()
    assert crossed_thresholds(used_before=799, used_after=800, limit=999, thresholds=[80]) == (80,)


def test_a_zero_limit_and_falling_usage_cross_nothing():
    assert crossed(0, 10, limit=0) == ()
    assert crossed(900, 100) == ()


def test_thresholds_above_the_limit():
    assert crossed_thresholds(used_before=1000, used_after=1500, limit=1000, thresholds=[150]) == (
        150,
    )


def test_negative_usage_is_refused():
    with pytest.raises(ValueError, match="used_before"):
        crossed(-1, 10)


def test_check_thresholds_sorts_and_refuses_bad_values():
    assert check_thresholds([100, 50, 80, 50]) == (50, 80, 100)
    for bad in ([0], [1001], [50.5], [True], ["80"]):
        with pytest.raises(ValueError, match="whole percents"):
            check_thresholds(bad)
    with pytest.raises(ValueError, match="at least one"):
        check_thresholds([])


def test_a_budgets_own_thresholds_must_be_ascending_unique_whole_percents():
    assert check_budget_thresholds([25]) == (25,)
    assert check_budget_thresholds((1, 80, 1000)) == (1, 80, 1000)
    for bad in ([80, 50], [50, 50], [0], [1001], [50.0], [True], ["50"], [], "50", None, 50):
        with pytest.raises(ValueError, match=r"^alert_thresholds "):
            check_budget_thresholds(bad)

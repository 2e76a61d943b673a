from __future__ import annotations

from datetime import datetime, timedelta, timezone

from gateway.console.svg_charts import OTHERS, Series, budget_bar, legend, stacked_bars, top_series

T0 = datetime(2026, 11, 20, tzinfo=timezone.utc)


def test_names_are_escaped_in_the_chart_and_the_legend() -> None:
    name = "<script>alert(1)</script>"
    buckets = [T0, T0 + timedelta(hours=1)]
    chart = stacked_bars(buckets, [Series(name, [3, 0])], label=name, unit="tokens")
    assert "<script>" not in chart
    assert "&lt;script&gt;" in chart
    assert "<script>" not in legend([name])
    assert "style=" not in chart  # the CSP allows no inline style


def test_bars_stack_to_their_total_on_a_round_axis() -> None:
    chart = stacked_bars([T0], [Series("a", [30]), Series("b", [70])], label="t", unit="tokens")
    heights = [float(part.split('"')[0]) for part in chart.split('height="')[2:]]
    assert len(heights) == 2  # one rect per non-zero series (the svg's own height first)
    assert abs(sum(heights) - (220 - 24 - 8)) < 0.2  # 100 of an axis topped at 100


def test_budget_bar_colour_and_width_follow_the_share() -> None:
    assert 'fill="#59a14f"' in budget_bar(10, 100)
    assert 'data-used-percent="10.0"' in budget_bar(10, 100)
    assert 'fill="#edc948"' in budget_bar(80, 100)
    over = budget_bar(150, 100)
    assert 'fill="#e15759"' in over
    assert 'width="240.0"' in over


def test_top_series_keeps_the_largest_and_sums_the_rest() -> None:
    values = {f"m{i}": [i, i] for i in range(12)}
    shown = top_series(values, limit=3)
    assert [s.name for s in shown] == ["m11", "m10", "m9", OTHERS]
    assert shown[-1].values == [sum(range(9))] * 2

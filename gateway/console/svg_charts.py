"""Charts drawn on the server as inline SVG: no script, no stylesheet of their own.

Everything is a presentation attribute (``fill``, ``width``), which the console's
Content-Security-Policy allows, where a ``style`` attribute would need ``'unsafe-inline'``.
Every text that reaches the markup (a model's or a tenant's name) is escaped here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from markupsafe import Markup, escape

PALETTE = (
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
    "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
)  # fmt: skip
OTHERS = "others"
CHART_WIDTH, CHART_HEIGHT = 760, 220
_LEFT, _BOTTOM, _TOP = 64, 24, 8


@dataclass(frozen=True)
class Series:
    name: str
    values: Sequence[int]  # one per bucket


def series_color(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def stacked_bars(
    buckets: Sequence[datetime], series: Sequence[Series], *, label: str, unit: str
) -> Markup:
    """Bars per bucket, stacked by series (in the order given), with a y axis and a legend."""
    totals = [sum(s.values[i] for s in series) for i in range(len(buckets))]
    top = _nice_ceiling(max(totals, default=0))
    plot_w, plot_h = CHART_WIDTH - _LEFT - 8, CHART_HEIGHT - _BOTTOM - _TOP
    slot = plot_w / max(1, len(buckets))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" width="{CHART_WIDTH}" '
        f'height="{CHART_HEIGHT}" viewBox="0 0 {CHART_WIDTH} {CHART_HEIGHT}" role="img" '
        f'aria-label="{escape(label)}">',
        f"<title>{escape(label)}</title>",
    ]
    for step in range(5):
        value = top * step / 4
        y = _TOP + plot_h - plot_h * step / 4
        parts.append(
            f'<line x1="{_LEFT}" x2="{CHART_WIDTH - 8}" y1="{y:.1f}" y2="{y:.1f}" '
            'stroke="#ddd" stroke-width="1"/>'
            f'<text x="{_LEFT - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="10" '
            f'fill="#555">{escape(_short(value))}</text>'
        )
    for i, at in enumerate(buckets):
        x = _LEFT + i * slot + slot * 0.1
        y = float(_TOP + plot_h)
        for index, one in enumerate(series):
            value = one.values[i]
            if value <= 0:
                continue
            height = plot_h * value / top
            y -= height
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{slot * 0.8:.1f}" height="{height:.1f}" '
                f'fill="{series_color(index)}"><title>{escape(one.name)} '
                f"{at:%Y-%m-%d %H:%M}: {value} {escape(unit)}</title></rect>"
            )
    for i in _tick_indices(len(buckets)):
        x = _LEFT + i * slot + slot / 2
        parts.append(
            f'<text x="{x:.1f}" y="{CHART_HEIGHT - 6}" text-anchor="middle" font-size="10" '
            f'fill="#555">{buckets[i]:%m-%d %H:%M}</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def legend(names: Sequence[str]) -> Markup:
    """Swatches and names, in the chart's colours."""
    items = [
        f'<li><svg width="10" height="10" aria-hidden="true"><rect width="10" height="10" '
        f'fill="{series_color(i)}"/></svg> {escape(name)}</li>'
        for i, name in enumerate(names)
    ]
    return Markup('<ul class="legend">' + "".join(items) + "</ul>")


def budget_bar(used: int, limit: int) -> Markup:
    """Used of limit as a bar: green below 80%, amber to 100%, red beyond."""
    share = used / limit if limit > 0 else 1.0
    width = 240
    fill = "#59a14f" if share < 0.8 else "#edc948" if share < 1.0 else "#e15759"
    used_w = min(1.0, share) * width
    return Markup(
        f'<svg xmlns="http://www.w3.org/2000/svg" class="budget-bar" width="{width}" height="14" '
        f'role="img" aria-label="{share:.0%} used" data-used-percent="{share * 100:.1f}">'
        f'<rect width="{width}" height="14" rx="3" fill="#eee"/>'
        f'<rect width="{used_w:.1f}" height="14" rx="3" fill="{fill}"/></svg>'
    )


def top_series(values: Mapping[str, Sequence[int]], limit: int = len(PALETTE) - 1) -> list[Series]:
    """The ``limit`` largest series by total, the rest summed as ``others``."""
    ranked = sorted(values.items(), key=lambda item: (-sum(item[1]), item[0]))
    shown = [Series(name, list(v)) for name, v in ranked[:limit]]
    rest = [v for _, v in ranked[limit:]]
    if rest:
        shown.append(Series(OTHERS, [sum(column) for column in zip(*rest, strict=True)]))
    return shown


def _nice_ceiling(value: int) -> int:
    """The axis' top: 1, 2, 4, 5 or 8 times a power of ten, at least ``value`` (and 4)."""
    scale = 1
    while True:
        for step in (1, 2, 4, 5, 8):
            if step * scale >= max(4, value):
                return step * scale
        scale *= 10


def _short(value: float) -> str:
    for size, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if value >= size:
            return f"{value / size:g}{suffix}"
    return f"{value:g}"


def _tick_indices(num_buckets: int, num_ticks: int = 6) -> list[int]:
    if num_buckets <= 0:
        return []
    step = max(1, num_buckets // num_ticks)
    return list(range(0, num_buckets, step))

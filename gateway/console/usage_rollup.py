"""A window's usage as the Usage page draws it, folded in the database: per bucket for the
chart's top series, per series for the table's top rows, and everything else summed as
``OTHERS``, in one statement whose answer is a few hundred rows whatever the window holds.

A month by tenant holds some 30,000 (bucket, tenant) groups for 1,000 tenants; sending them
to Python to rank and fold costs more than summing the window itself. Here the groups stay
in a CTE, ranked once by cost, then tokens, then name::

    g       (bucket, series) -> sums                  one index-only scan of the window
    ranked  series -> sums, rank                      rank 1 = the largest spender
    answer  'chart' rows: bucket, series if rank <= num_chart_series else OTHERS
            'table' rows: series, sums, for rank <= num_table_rows
            'rest'  row : the sums of every series ranked below the table

Every record of the window lands in exactly one chart row and in exactly one table or rest
row, so both add up to the window's totals (the page's sums are the records').
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    String,
    case,
    cast,
    func,
    literal,
    null,
    select,
    union_all,
)
from sqlalchemy.orm import Session

from gateway.console.page_queries import (
    NO_MODEL,
    ZERO,
    SeriesBy,
    UsagePoint,
    UsageTotals,
    bucket_index_of,
    hash_aggregate_in_memory,
)
from gateway.storage.models import UsageRecord

OTHERS = "(others)"  # no tenant id or model name: ids are [A-Za-z0-9._-]
NUM_CHART_SERIES = 9
NUM_TABLE_ROWS = 50
_SUMS = ("num_requests", "prompt_tokens", "cached_tokens", "completion_tokens", "cost_micros")


@dataclass(frozen=True)
class UsageRollup:
    points: list[UsagePoint]  # the chart's: top series and OTHERS, per bucket
    table: list[tuple[str, UsageTotals]]  # the top series by cost, largest first
    rest: UsageTotals  # every series below the table's, summed
    num_series: int  # how many series the window holds

    @property
    def total(self) -> UsageTotals:
        total = self.rest
        for _, totals in self.table:
            total = add(total, totals)
        return total


def usage_rollup(
    session: Session,
    start: datetime,
    end: datetime,
    bucket: timedelta,
    by: SeriesBy,
    tenant_id: str | None = None,
    *,
    num_chart_series: int = NUM_CHART_SERIES,
    num_table_rows: int = NUM_TABLE_ROWS,
) -> UsageRollup:
    size = int(bucket.total_seconds())
    column = UsageRecord.tenant_id if by == "tenant" else UsageRecord.served_model
    bucket_index = bucket_index_of(session, size)
    series = func.coalesce(column, NO_MODEL)
    grouped = (
        select(
            bucket_index.label("bucket"),
            series.label("series"),
            func.count().label("num_requests"),
            *(func.sum(getattr(UsageRecord, name)).label(name) for name in _SUMS[1:]),
        )
        .where(UsageRecord.created_at >= start, UsageRecord.created_at < end)
        .group_by(bucket_index, series)
    )
    if tenant_id is not None:
        grouped = grouped.where(UsageRecord.tenant_id == tenant_id)
    g = grouped.cte("g")
    spent = func.sum(g.c.cost_micros)
    tokens = func.sum(g.c.prompt_tokens + g.c.completion_tokens)
    ranked = (
        select(
            g.c.series,
            *(func.sum(g.c[name]).label(name) for name in _SUMS),
            func.row_number()
            .over(order_by=(spent.desc(), tokens.desc(), g.c.series))
            .label("rank"),
        )
        .group_by(g.c.series)
        .cte("ranked")
    )
    chart_series = case((ranked.c.rank <= num_chart_series, g.c.series), else_=literal(OTHERS))
    chart = (
        select(
            literal("chart").label("kind"),
            g.c.bucket,
            chart_series.label("series"),
            *_sums_of(g),
        )
        .join_from(g, ranked, ranked.c.series == g.c.series)
        .group_by(g.c.bucket, chart_series)
    )
    table = select(
        literal("table"), cast(ranked.c.rank, BigInteger), ranked.c.series,
        *(cast(ranked.c[name], BigInteger) for name in _SUMS),
    ).where(ranked.c.rank <= num_table_rows)  # fmt: skip
    rest = select(
        literal("rest"), cast(func.count(), BigInteger), cast(null(), String),
        *(cast(func.coalesce(func.sum(ranked.c[name]), 0), BigInteger) for name in _SUMS),
    ).where(ranked.c.rank > num_table_rows)  # fmt: skip
    hash_aggregate_in_memory(session)
    points: list[UsagePoint] = []
    rows: list[tuple[int, str, UsageTotals]] = []
    others, num_below = ZERO, 0
    answer: Sequence[Any] = session.execute(union_all(chart, table, rest)).all()
    for row in answer:
        kind, position, name = str(row[0]), int(row[1] or 0), str(row[2])
        totals = UsageTotals(*(int(value or 0) for value in row[3:]))
        if kind == "chart":
            at = datetime.fromtimestamp(position * size, tz=timezone.utc)
            points.append(UsagePoint(at, name, totals))
        elif kind == "table":
            rows.append((position, name, totals))
        else:
            others, num_below = totals, position
    points.sort(key=lambda point: (point.bucket_start, point.series == OTHERS, point.series))
    rows.sort()
    return UsageRollup(points, [(n, t) for _, n, t in rows], others, len(rows) + num_below)


def _sums_of(g: Any) -> list[ColumnElement[Any]]:
    return [cast(func.sum(g.c[name]), BigInteger).label(name) for name in _SUMS]


def add(a: UsageTotals, b: UsageTotals) -> UsageTotals:
    return UsageTotals(
        a.num_requests + b.num_requests,
        a.prompt_tokens + b.prompt_tokens,
        a.cached_tokens + b.cached_tokens,
        a.completion_tokens + b.completion_tokens,
        a.cost_micros + b.cost_micros,
    )

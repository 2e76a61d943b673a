"""Usage over time: tokens and cost by model or by tenant for a chosen window, with the
cached share, as charts and a table, and the same numbers as CSV; and the tenant's own view
(its usage, by model, and its budgets), the only page a tenant session reaches.

The numbers are the usage records' sums over the window (`page_queries.usage_series`), so
the page, its CSV and the records agree by construction; a test holds them to it.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TypeVar

from markupsafe import Markup
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from gateway.console.console_auth import ConsoleDenied
from gateway.console.console_context import ConsoleContext
from gateway.console.page_queries import (
    DEFAULT_USAGE_WINDOW,
    USAGE_WINDOWS,
    ZERO,
    SeriesBy,
    UsagePoint,
    UsageTotals,
    UsageWindow,
    usage_series,
)
from gateway.console.svg_charts import Series, legend, stacked_bars, top_series
from gateway.console.tenant_overview import TenantOverview, tenant_overview
from gateway.storage.tenants import get_tenant

T = TypeVar("T")
CSV_COLUMNS = (
    "bucket_start", "series", "num_requests", "prompt_tokens", "cached_tokens",
    "completion_tokens", "total_tokens", "cost_micros",
)  # fmt: skip


@dataclass(frozen=True)
class UsageReport:
    """A window's usage: per bucket and series, and the totals per series and overall."""

    window: UsageWindow
    by: SeriesBy
    start: datetime
    end: datetime
    buckets: list[datetime]
    points: list[UsagePoint]
    totals_by_series: list[tuple[str, UsageTotals]]
    total: UsageTotals
    tokens_chart: Markup
    cost_chart: Markup
    chart_legend: Markup


class UsagePages:
    def __init__(self, context: ConsoleContext) -> None:
        self._context = context

    async def usage_page(self, request: Request) -> Response:
        session = await self._context.guard.admin(request)
        window, by, tenant_id = self._query(request, allow_tenant=True)
        report = await self._report(window, by, tenant_id)
        return self._context.render(
            request, "usage.html", session, report=report, tenant_filter=tenant_id,
            windows=list(USAGE_WINDOWS),
        )  # fmt: skip

    async def usage_csv(self, request: Request) -> Response:
        await self._context.guard.admin(request)
        window, by, tenant_id = self._query(request, allow_tenant=True)
        return _csv(await self._report(window, by, tenant_id), tenant_id)

    async def own_page(self, request: Request) -> Response:
        session = await self._context.guard.session(request)
        if session.is_admin or session.tenant_id is None:
            raise ConsoleDenied(404, "The admin has no tenant view: see Tenants and Usage.")
        window, _, _ = self._query(request, allow_tenant=False)
        report = await self._report(window, "model", session.tenant_id)
        overview = await self._overview(session.tenant_id)
        return self._context.render(
            request, "own_view.html", session, report=report, overview=overview,
            windows=list(USAGE_WINDOWS), now=self._context.now(),
        )  # fmt: skip

    async def own_csv(self, request: Request) -> Response:
        session = await self._context.guard.session(request)
        if session.is_admin or session.tenant_id is None:
            raise ConsoleDenied(404, "The admin has no tenant view: see Usage.")
        window, _, _ = self._query(request, allow_tenant=False)
        return _csv(await self._report(window, "model", session.tenant_id), session.tenant_id)

    def _query(
        self, request: Request, *, allow_tenant: bool
    ) -> tuple[UsageWindow, SeriesBy, str | None]:
        params = request.query_params
        name = params.get("window") or DEFAULT_USAGE_WINDOW
        if name not in USAGE_WINDOWS:
            raise ConsoleDenied(
                400, f"Unknown window {name!r}: use one of {', '.join(USAGE_WINDOWS)}."
            )
        by_name = params.get("by") or "model"
        if by_name not in ("model", "tenant"):
            raise ConsoleDenied(400, "Show usage by model or by tenant.")
        by: SeriesBy = "tenant" if by_name == "tenant" else "model"
        named = params.get("tenant") or None
        if named is not None and not allow_tenant:
            raise ConsoleDenied(403, "A tenant sees only its own usage.")
        return USAGE_WINDOWS[name], by, named

    async def _report(
        self, window: UsageWindow, by: SeriesBy, tenant_id: str | None
    ) -> UsageReport:
        start, end = window.bounds(self._context.now())

        def read(db: Session) -> list[UsagePoint]:
            if tenant_id is not None and get_tenant(db, tenant_id, include_deleted=True) is None:
                raise ConsoleDenied(404, f"No tenant {tenant_id!r}.")
            return usage_series(db, start, end, window.bucket, by, tenant_id)

        points = await self._read(read)
        return usage_report(window, by, start, end, points)

    async def _overview(self, tenant_id: str) -> TenantOverview:
        now = self._context.now()
        found = await self._read(lambda db: tenant_overview(db, tenant_id, now))
        if found is None:
            raise ConsoleDenied(404, "This tenant no longer exists.")
        return found

    async def _read(self, work: Callable[[Session], T]) -> T:
        def run() -> T:
            with self._context.database.session() as db:
                return work(db)

        return await run_in_threadpool(run)


def usage_report(
    window: UsageWindow, by: SeriesBy, start: datetime, end: datetime, points: Sequence[UsagePoint]
) -> UsageReport:
    buckets = []
    at = start
    while at < end:
        buckets.append(at)
        at += window.bucket
    position = {at: i for i, at in enumerate(buckets)}
    tokens: dict[str, list[int]] = defaultdict(lambda: [0] * len(buckets))
    cost: dict[str, list[int]] = defaultdict(lambda: [0] * len(buckets))
    sums: dict[str, UsageTotals] = defaultdict(lambda: ZERO)
    for point in points:
        i = position.get(point.bucket_start)
        if i is not None:
            tokens[point.series][i] += point.totals.tokens
            cost[point.series][i] += point.totals.cost_micros
        sums[point.series] = _add(sums[point.series], point.totals)
    token_series = top_series(tokens)
    order = [one.name for one in token_series]
    cost_series = _in_order(top_series(cost, limit=len(tokens)), order)
    total = ZERO
    for totals in sums.values():
        total = _add(total, totals)
    what = "tenant" if by == "tenant" else "model"
    return UsageReport(
        window=window,
        by=by,
        start=start,
        end=end,
        buckets=buckets,
        points=list(points),
        totals_by_series=sorted(
            sums.items(), key=lambda item: (-item[1].cost_micros, -item[1].tokens, item[0])
        ),
        total=total,
        tokens_chart=stacked_bars(buckets, token_series, label=f"Tokens by {what}", unit="tokens"),
        cost_chart=stacked_bars(
            buckets, cost_series, label=f"Cost (micros) by {what}", unit="micros"
        ),
        chart_legend=legend(order),
    )


def _in_order(series: list[Series], order: list[str]) -> list[Series]:
    """The cost chart's series in the tokens chart's order (its colours), the rest summed."""
    by_name = {one.name: one for one in series}
    shown = [by_name[name] for name in order if name in by_name]
    rest = [one for one in series if one.name not in order]
    if rest:
        width = len(rest[0].values)
        shown.append(Series("others", [sum(one.values[i] for one in rest) for i in range(width)]))
    return shown


def _add(a: UsageTotals, b: UsageTotals) -> UsageTotals:
    return UsageTotals(
        a.num_requests + b.num_requests,
        a.prompt_tokens + b.prompt_tokens,
        a.cached_tokens + b.cached_tokens,
        a.completion_tokens + b.completion_tokens,
        a.cost_micros + b.cost_micros,
    )


def _csv(report: UsageReport, tenant_id: str | None) -> Response:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for point in report.points:
        t = point.totals
        writer.writerow(
            [point.bucket_start.isoformat(), _csv_text(point.series), t.num_requests,
             t.prompt_tokens, t.cached_tokens, t.completion_tokens, t.tokens, t.cost_micros]
        )  # fmt: skip
    name = f"usage-{tenant_id or 'all'}-{report.window.name}-{report.start:%Y%m%dT%H%M}.csv"
    return Response(
        out.getvalue(),
        media_type="text/csv; charset=utf-8",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )


def _csv_text(value: str) -> str:
    """A cell a spreadsheet will not run as a formula (``=``, ``+``, ``-``, ``@`` first)."""
    return "'" + value if value[:1] in ("=", "+", "-", "@", "\t", "\r") else value

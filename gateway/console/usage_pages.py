"""Usage over time: tokens and cost by model or by tenant for a chosen window, with the
cached share, as charts and a table, and the same numbers as CSV; and the tenant's own view
(its usage, by model, and its budgets), the only page a tenant session reaches.

The numbers are the usage records' sums over the window (`page_queries.usage_series`), so
the page, its CSV and the records agree by construction; a test holds them to it. Money is
named in the gateway's ``currency`` (the cost chart, the CSV's ``cost_micros_USD``).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
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
    SeriesBy,
    UsagePoint,
    UsageTotals,
    UsageWindow,
    usage_series,
)
from gateway.console.svg_charts import Series, legend, stacked_bars
from gateway.console.tenant_overview import TenantOverview, tenant_overview
from gateway.console.usage_rollup import NUM_CHART_SERIES, OTHERS, UsageRollup, usage_rollup
from gateway.storage.tenants import get_tenant

T = TypeVar("T")
CSV_COLUMNS = (
    "bucket_start", "series", "num_requests", "prompt_tokens", "cached_tokens",
    "completion_tokens", "total_tokens", "cost_micros",
)  # fmt: skip


@dataclass(frozen=True)
class UsageReport:
    """A window's usage as the page shows it: the charts (top series and the rest, per
    bucket), the table (the top series by cost, then the rest in one row) and the totals."""

    window: UsageWindow
    by: SeriesBy
    start: datetime
    end: datetime
    totals_by_series: list[tuple[str, UsageTotals]]
    rest: UsageTotals
    num_rest: int  # how many series the rest row sums
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
        points = await self._points(window, by, tenant_id)
        return _csv(window, *points, tenant_id, self._context.gateway.currency)

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
        points = await self._points(window, "model", session.tenant_id)
        return _csv(window, *points, session.tenant_id, self._context.gateway.currency)

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

        def read(db: Session) -> UsageRollup:
            if tenant_id is not None and get_tenant(db, tenant_id, include_deleted=True) is None:
                raise ConsoleDenied(404, f"No tenant {tenant_id!r}.")
            return usage_rollup(db, start, end, window.bucket, by, tenant_id)

        rollup = await self._read(read)
        return usage_report(window, by, start, end, rollup, self._context.gateway.currency)

    async def _points(
        self, window: UsageWindow, by: SeriesBy, tenant_id: str | None
    ) -> tuple[datetime, list[UsagePoint]]:
        """Every series in every bucket (the CSV's rows), and the window's start."""
        start, end = window.bounds(self._context.now())

        def read(db: Session) -> list[UsagePoint]:
            if tenant_id is not None and get_tenant(db, tenant_id, include_deleted=True) is None:
                raise ConsoleDenied(404, f"No tenant {tenant_id!r}.")
            return usage_series(db, start, end, window.bucket, by, tenant_id)

        return start, await self._read(read)

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
    window: UsageWindow,
    by: SeriesBy,
    start: datetime,
    end: datetime,
    rollup: UsageRollup,
    currency: str,
) -> UsageReport:
    buckets = []
    at = start
    while at < end:
        buckets.append(at)
        at += window.bucket
    position = {at: i for i, at in enumerate(buckets)}
    names = [name for name, _ in rollup.table[:NUM_CHART_SERIES]]
    if rollup.num_series > NUM_CHART_SERIES:
        names.append(OTHERS)
    tokens = {name: [0] * len(buckets) for name in names}
    cost = {name: [0] * len(buckets) for name in names}
    for point in rollup.points:
        i = position.get(point.bucket_start)
        if i is not None and point.series in tokens:
            tokens[point.series][i] += point.totals.tokens
            cost[point.series][i] += point.totals.cost_micros
    what = "tenant" if by == "tenant" else "model"
    return UsageReport(
        window=window,
        by=by,
        start=start,
        end=end,
        totals_by_series=rollup.table,
        rest=rollup.rest,
        num_rest=rollup.num_series - len(rollup.table),
        total=rollup.total,
        tokens_chart=stacked_bars(
            buckets, [Series(n, tokens[n]) for n in names], label=f"Tokens by {what}", unit="tokens"
        ),
        cost_chart=stacked_bars(
            buckets,
            [Series(n, cost[n]) for n in names],
            label=f"Cost by {what} ({currency})",
            unit=f"micros {currency}",
        ),
        chart_legend=legend(names),
    )


def _csv(
    window: UsageWindow,
    start: datetime,
    points: list[UsagePoint],
    tenant_id: str | None,
    currency: str,
) -> Response:
    """The rows of `CSV_COLUMNS`, the cost's header naming its currency (``cost_micros_USD``)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(
        [f"{name}_{currency}" if name == "cost_micros" else name for name in CSV_COLUMNS]
    )
    for point in points:
        t = point.totals
        writer.writerow(
            [point.bucket_start.isoformat(), _csv_text(point.series), t.num_requests,
             t.prompt_tokens, t.cached_tokens, t.completion_tokens, t.tokens, t.cost_micros]
        )  # fmt: skip
    name = f"usage-{tenant_id or 'all'}-{window.name}-{start:%Y%m%dT%H%M}.csv"
    return Response(
        out.getvalue(),
        media_type="text/csv; charset=utf-8",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )


def _csv_text(value: str) -> str:
    """A cell a spreadsheet will not run as a formula (``=``, ``+``, ``-``, ``@`` first)."""
    return "'" + value if value[:1] in ("=", "+", "-", "@", "\t", "\r") else value

"""A tenant's self-service API (``GET /v1/usage``, ``GET /v1/budget``) and usage reports.

Isolation: the tenant is always the one the bearer key belongs to. A ``tenant_id`` query
parameter naming the caller's own tenant is accepted (and changes nothing); one naming any
other tenant is refused with 403 ``permission_error``, so a client bug shows up instead of
silently returning the caller's own data under another name.

The usage-report machinery here is shared with the admin API: query parsing
(``start``/``end``/``cursor``/``limit``/``format``), the JSON, JSONL and CSV bodies, totals per
tenant and model, and budget status.

Query parameters: a parameter given with an empty value (``?start=``) is refused with 400,
like any other value that is not of its type; leave it out to take its default. A parameter
the route does not know is a 400 too (a misspelt filter must not widen the answer).
``start == end`` is a valid, empty window.

Formats::

    format=json   (default) one page: {"object": "list", "data": [...], "next_cursor": n | null,
                  "has_more": bool, "resume_cursor": n | null}
    format=jsonl  one record per line        } with ``limit``: one page, the next cursor in the
    format=csv    a header row, then records } ``X-Next-Cursor`` header (absent on the last page)
                                               and ``X-Resume-Cursor``; without: every record
                                               after ``cursor``, streamed from the database one
                                               page at a time

Every record carries ``id``, its row's primary key: stable across reads, and the cursor itself
(a page holds the records with ``id > cursor``; CSV puts it in the last column, so positional
readers of the older columns keep working). ``next_cursor`` is null on the last page, as
before, so a loop ``while next_cursor`` ends; a follower that polls for new records passes
``resume_cursor`` (the last ``id`` returned, else the cursor it sent), or the last record's
``id`` from a stream, and gets only records stored since, none twice and none skipped:
``usage_store`` makes ids commit in id order on PostgreSQL too.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, TypeAdapter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from gateway.api.budget_standing import BudgetStanding, standings_of
from gateway.api.iso_datetime import parse_iso_datetime
from gateway.auth.bearer_keys import authenticate_request
from gateway.errors import ApiError, invalid_request
from gateway.ledger.budget_ledger import Balance, BudgetLedger
from gateway.storage.database import Database
from gateway.storage.models import utc_now
from gateway.storage.usage_store import (
    MAX_PAGE_SIZE,
    ModelUsageTotals,
    UsageEntry,
    UsagePage,
    list_usage,
    sum_tokens,
    summarize_usage,
)
from openai_protocol.field_rules import MAX_USER_CHARS
from policies.budget_period import BudgetWindow, budget_window
from policies.decision import Rejection
from policies.quota import BUDGET_PERIODS, BudgetPeriod, TenantQuota
from policies.scoped_budgets import DEFAULT_CURRENCY

UsageFormat = Literal["json", "jsonl", "csv"]
USAGE_FORMATS: tuple[UsageFormat, ...] = ("json", "jsonl", "csv")
DEFAULT_PAGE_SIZE = 100
NEXT_CURSOR_HEADER = "X-Next-Cursor"
RESUME_CURSOR_HEADER = "X-Resume-Cursor"
# Bounds for an open-ended window ("total" budgets, reports without start or end).
EARLIEST = datetime(1970, 1, 1, tzinfo=timezone.utc)
LATEST = datetime(9999, 1, 1, tzinfo=timezone.utc)

T = TypeVar("T")
_CONTENT_TYPES: dict[UsageFormat, str] = {
    "jsonl": "application/x-ndjson",
    "csv": "text/csv; charset=utf-8",
}


@dataclass(frozen=True, kw_only=True)
class ExportedUsage(UsageEntry):
    """A usage record as exported: the entry and its row ``id`` (stable; the cursor)."""

    id: int


_CSV_COLUMNS = tuple(f.name for f in fields(ExportedUsage))  # ``id`` last
_RECORD = TypeAdapter(ExportedUsage)  # the same JSON as every other date-time here (…Z)


class UsageList(BaseModel):
    """One page of usage records, oldest first."""

    object: Literal["list"] = "list"
    data: list[ExportedUsage]
    next_cursor: int | None  # null on the last page
    has_more: bool  # next_cursor is not null
    resume_cursor: int | None  # poll from here for newer records; null: from the start


class Budget(BaseModel):
    """The caller's token budget in the current window; ``limit``/``remaining`` null: unlimited.
    ``budgets``: every budget that applies (the tenant's tokens and money, the key's, and the
    end user's named by ``?user=``), each as admission sees it. ``currency``: the code the
    models' prices, and so every money budget, are in."""

    object: Literal["budget"] = "budget"
    tenant_id: str
    limit: int | None
    period: BudgetPeriod
    window_start: datetime | None
    window_end: datetime | None
    used: int
    reserved: int
    remaining: int | None
    currency: str
    budgets: list[BudgetStanding] = []


class ModelTotals(BaseModel):
    tenant_id: str
    served_model: str | None  # null: rejected before an engine was chosen
    model_version: str | None  # the version of a rollout that served it; else served_model
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    total_tokens: int
    cost_micros: int


class UsageSummary(BaseModel):
    """Totals over ``[start, end)``; a null bound is open (``period=total``)."""

    object: Literal["usage.summary"] = "usage.summary"
    period: BudgetPeriod | None  # null: an explicit start/end
    start: datetime | None
    end: datetime | None
    data: list[ModelTotals]


@dataclass(frozen=True)
class UsageQuery:
    start: datetime | None
    end: datetime | None
    cursor: int | None
    limit: int | None  # None: default page (json) or everything (jsonl, csv)
    format: UsageFormat


def parse_time(params: Mapping[str, str], name: str) -> datetime | None:
    """An ISO 8601 date or date-time query parameter; naive values are UTC."""
    value = params.get(name)
    if value is None:
        return None
    try:
        parsed = parse_iso_datetime(value)
        if parsed.tzinfo is None:
            return parsed.replace(tzinfo=timezone.utc)
        return parsed.astimezone(timezone.utc)
    except (ValueError, OverflowError):
        raise invalid_request(
            f"Invalid '{name}': {value!r} is not an ISO 8601 date or date-time "
            "(e.g. 2025-03-01 or 2025-03-01T12:00:00Z).",
            param=name,
        ) from None


def parse_int(params: Mapping[str, str], name: str, low: int, high: int) -> int | None:
    value = params.get(name)
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()) or not low <= int(value) <= high:
        raise invalid_request(
            f"Invalid '{name}': expected an integer from {low} to {high}, got {value!r}.",
            param=name,
        )
    return int(value)


def check_window(start: datetime | None, end: datetime | None) -> None:
    """``[start, end)``; ``start == end`` is a valid, empty window."""
    if start is not None and end is not None and start > end:
        raise invalid_request("'start' must not be after 'end'.", param="start")


USAGE_PARAMS = frozenset({"tenant_id", "start", "end", "cursor", "limit", "format"})
SUMMARY_PARAMS = frozenset({"tenant_id", "period", "start", "end"})


def refuse_unknown_params(params: Mapping[str, str], known: frozenset[str]) -> None:
    """A query parameter the route does not know is a 400, not ignored: a misspelt filter
    (``?tenant=acme``) would otherwise answer for every tenant."""
    unknown = sorted(set(params) - known)
    if unknown:
        raise invalid_request(
            f"Unknown query parameter {unknown[0]!r}; this route takes "
            f"{', '.join(sorted(known)) or 'none'}.",
            param=unknown[0],
        )


def parse_usage_query(params: Mapping[str, str]) -> UsageQuery:
    refuse_unknown_params(params, USAGE_PARAMS)
    start, end = parse_time(params, "start"), parse_time(params, "end")
    check_window(start, end)
    format_ = _choice(params, "format", {name: name for name in USAGE_FORMATS}, "json")
    return UsageQuery(
        start=start,
        end=end,
        cursor=parse_int(params, "cursor", 0, 2**63 - 1),
        limit=parse_int(params, "limit", 1, MAX_PAGE_SIZE),
        format=format_,
    )


async def usage_response(db: Database, tenant_id: str | None, query: UsageQuery) -> Response:
    """The records of ``tenant_id`` (all tenants if None) that ``query`` selects."""

    def fetch(cursor: int | None, limit: int) -> UsagePage:
        with db.session() as session:
            return list_usage(
                session,
                tenant_id=tenant_id,
                start=query.start,
                end=query.end,
                cursor=cursor,
                limit=limit,
            )

    if query.format == "json":
        page = await run_in_threadpool(fetch, query.cursor, query.limit or DEFAULT_PAGE_SIZE)
        body = {
            "object": "list",
            "data": _exported(page),
            "next_cursor": page.next_cursor,
            "has_more": page.has_more,
            "resume_cursor": page.resume_cursor,
        }
        return JSONResponse(body)
    # The first page is read before the response starts, so a failure is still a clean error.
    first = await run_in_threadpool(fetch, query.cursor, query.limit or MAX_PAGE_SIZE)
    headers = {}
    if query.limit is not None:
        if first.next_cursor is not None:
            headers[NEXT_CURSOR_HEADER] = str(first.next_cursor)
        if first.resume_cursor is not None:
            headers[RESUME_CURSOR_HEADER] = str(first.resume_cursor)

    async def pages() -> AsyncIterator[UsagePage]:
        page = first
        yield page
        while query.limit is None and page.next_cursor is not None:
            page = await run_in_threadpool(fetch, page.next_cursor, MAX_PAGE_SIZE)
            yield page

    encode = _csv_lines if query.format == "csv" else _jsonl_lines
    return StreamingResponse(
        _chunks(pages(), encode, header=_csv_row(_CSV_COLUMNS) if query.format == "csv" else ""),
        media_type=_CONTENT_TYPES[query.format],
        headers=headers,
    )


def parse_summary_window(
    params: Mapping[str, str], now: datetime
) -> tuple[BudgetPeriod | None, datetime | None, datetime | None]:
    """``period`` (day, month or total; month by default) or an explicit ``start``/``end``."""
    refuse_unknown_params(params, SUMMARY_PARAMS)
    start, end = parse_time(params, "start"), parse_time(params, "end")
    check_window(start, end)
    if start is not None or end is not None:
        if "period" in params:
            raise invalid_request("Pass either 'period' or 'start'/'end', not both.", "period")
        return None, start, end
    period = _choice(params, "period", {name: name for name in BUDGET_PERIODS}, "month")
    window = budget_window(period, now)
    return period, window.start, window.end


def _choice(params: Mapping[str, str], name: str, choices: Mapping[str, T], default: T) -> T:
    value = params.get(name)
    if value is None:
        return default
    if value not in choices:
        raise invalid_request(
            f"Invalid '{name}': use one of {', '.join(choices)}, got {value!r}.", param=name
        )
    return choices[value]


async def usage_summary(
    db: Database,
    tenant_id: str | None,
    period: BudgetPeriod | None,
    start: datetime | None,
    end: datetime | None,
) -> UsageSummary:
    def summarize() -> list[ModelUsageTotals]:
        with db.session() as session:
            return summarize_usage(
                session, start=start or EARLIEST, end=end or LATEST, tenant_id=tenant_id
            )

    rows = await run_in_threadpool(summarize)
    data = [
        ModelTotals(
            tenant_id=row.tenant_id,
            served_model=row.served_model,
            model_version=row.model_version,
            total_tokens=row.totals.prompt_tokens + row.totals.completion_tokens,
            **asdict(row.totals),
        )
        for row in rows
    ]
    return UsageSummary(period=period, start=start, end=end, data=data)


async def _chunks(
    pages: AsyncIterator[UsagePage], encode: Callable[[UsagePage], str], header: str
) -> AsyncIterator[str]:
    if header:
        yield header
    async for page in pages:
        if page.records:
            yield encode(page)


def _exported(page: UsagePage) -> list[dict[str, Any]]:
    """The page's records as JSON values, each with its ``id``."""
    return [
        _RECORD.dump_python(ExportedUsage(id=id_, **entry.to_dict()), mode="json")
        for id_, entry in zip(page.ids, page.records, strict=True)
    ]


def _jsonl_lines(page: UsagePage) -> str:
    return "".join(json.dumps(record, separators=(",", ":")) + "\n" for record in _exported(page))


def _csv_lines(page: UsagePage) -> str:
    return "".join(
        _csv_row([_csv_cell(record[name]) for name in _CSV_COLUMNS]) for record in _exported(page)
    )


def _csv_row(cells: tuple[str, ...] | list[str]) -> str:
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow(cells)
    return out.getvalue()


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


async def budget_status(
    db: Database,
    ledger: BudgetLedger,
    tenant_id: str,
    quota: TenantQuota,
    now: datetime,
    currency: str,
) -> Budget:
    """The balance of the current window, as admission sees it.

    A limited budget reads the ledger, rebuilding it from the usage records first if it does
    not know the balance (as admission does). An unlimited one is never reserved against or
    settled, so its ``used`` is summed from the records and the ledger is left alone: a
    balance rebuilt now would be stale if the tenant got a limit later in the window.
    ``used`` counts ``prompt_tokens + completion_tokens``, what the request path settles.
    """
    window = budget_window(quota.budget_period, now)
    limit = quota.budget_tokens
    if limit is None:
        used = await run_in_threadpool(used_tokens, db, tenant_id, window)
        balance = Balance(used=used, reserved=0)
    else:
        if not await ledger.is_known(tenant_id, window.key):
            used = await run_in_threadpool(used_tokens, db, tenant_id, window)
            await ledger.rebuild(tenant_id, window.key, used)  # a no-op if someone was first
        balance = await ledger.balance(tenant_id, window.key)
    return Budget(
        tenant_id=tenant_id,
        limit=limit,
        period=quota.budget_period,
        window_start=window.start,
        window_end=window.end,
        used=balance.used,
        reserved=balance.reserved,
        remaining=None if limit is None else balance.remaining(limit),
        currency=currency,
    )


def used_tokens(db: Database, tenant_id: str, window: BudgetWindow) -> int:
    """Tokens a tenant's usage records count against the budget window (blocking)."""
    with db.session() as session:
        totals = sum_tokens(session, tenant_id, window.start or EARLIEST, window.end or LATEST)
    return totals.prompt_tokens + totals.completion_tokens


def tenant_routes(
    db: Database,
    ledger: BudgetLedger,
    now: Callable[[], datetime] = utc_now,
    *,
    currency: str = DEFAULT_CURRENCY,
) -> list[BaseRoute]:
    """``GET /v1/usage`` and ``GET /v1/budget``, authenticated with the tenant's own API key;
    ``currency``: the code the prices are in (the gateway's setting)."""

    async def usage(request: Request) -> Response:
        """The caller's own usage records (JSON page, JSONL or CSV).
        ---
        {params: [OwnTenant, Start, End, Cursor, Limit, Format], 200: UsageList, streams: true,
         errors: [400, 403]}
        """
        caller = await authenticate_request(db, request)
        _refuse_other_tenant(request.query_params, caller.tenant_id)
        return await usage_response(db, caller.tenant_id, parse_usage_query(request.query_params))

    async def budget(request: Request) -> Response:
        """The caller's token budget, used, reserved and remaining in the current window,
        and every budget that applies to it (its key's; an end user's with ``?user=``).
        ---
        {params: [OwnTenant, EndUser], 200: Budget, errors: [400, 403]}
        """
        caller = await authenticate_request(db, request)
        params = request.query_params
        refuse_unknown_params(params, frozenset({"tenant_id", "user"}))
        _refuse_other_tenant(params, caller.tenant_id)
        end_user = params.get("user")
        if end_user is not None and not 0 < len(end_user) <= MAX_USER_CHARS:
            raise invalid_request(
                f"Invalid 'user': 1 to {MAX_USER_CHARS} characters, as a request's user.",
                param="user",
            )
        at = now()
        status = await budget_status(db, ledger, caller.tenant_id, caller.quota, at, currency)
        status.budgets = await standings_of(
            db, ledger, caller.tenant_id, caller.quota, caller.key_id, end_user, at, currency
        )
        return JSONResponse(status.model_dump(mode="json"))

    return [
        Route("/v1/usage", usage, methods=["GET"]),
        Route("/v1/budget", budget, methods=["GET"]),
    ]


def _refuse_other_tenant(params: Mapping[str, str], own_tenant_id: str) -> None:
    named = params.get("tenant_id") or None
    if named is not None and named != own_tenant_id:
        raise ApiError(
            Rejection(
                403,
                "permission_denied",
                "permission_error",
                "An API key can read only its own tenant's usage and budget; "
                "drop 'tenant_id' or use that tenant's key.",
                "tenant_id",
            )
        )

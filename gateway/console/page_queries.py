"""The console's reads: every one windowed in time and served by an index of
``usage_records`` (tenant+time, time, tenant+end user+time, key+time), so a page costs the
rows of its window, not the table. On PostgreSQL the time index carries the summed columns
(migration 0007), so a window's sums are an index-only scan. The Usage page's chart and
table come folded from `usage_rollup`; `usage_series` gives every series (the CSV).

Sums here are the usage records' own: ``tokens`` is ``prompt_tokens + completion_tokens``
(what a token budget settles) and ``cost_micros`` the recorded price (what a money budget
settles), cached input included at its own price. Time buckets are computed in SQL, per
dialect (PostgreSQL's epoch, SQLite's ``strftime('%s')``), so a chart reads one grouped row
per bucket and series instead of the records.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from sqlalchemy import BigInteger, ColumnElement, Integer, cast, func, select, text
from sqlalchemy.orm import Session

from gateway.storage.models import ApiKeyRow, UsageRecord
from gateway.storage.models import ScopedBudget as ScopedBudgetRow
from policies.budget_period import BudgetWindow
from policies.quota import BudgetPeriod
from policies.scoped_budgets import BudgetScope, BudgetUnit, ScopedBudget

SeriesBy = Literal["model", "tenant"]
NO_MODEL = "(refused before a model)"
AGGREGATE_WORK_MEM = "64MB"


@dataclass(frozen=True)
class UsageWindow:
    """A chart's window: ``span`` back from now, in buckets of ``bucket``."""

    name: str
    span: timedelta
    bucket: timedelta

    def bounds(self, now: datetime) -> tuple[datetime, datetime]:
        """``[start, end)`` aligned to whole buckets, ``end`` the bucket after ``now``."""
        size = int(self.bucket.total_seconds())
        end_s = (int(now.timestamp()) // size + 1) * size
        end = datetime.fromtimestamp(end_s, tz=timezone.utc)
        return end - self.span, end


USAGE_WINDOWS = {
    w.name: w
    for w in (
        UsageWindow("1h", timedelta(hours=1), timedelta(minutes=5)),
        UsageWindow("24h", timedelta(hours=24), timedelta(hours=1)),
        UsageWindow("7d", timedelta(days=7), timedelta(hours=6)),
        UsageWindow("30d", timedelta(days=30), timedelta(days=1)),
    )
}
DEFAULT_USAGE_WINDOW = "24h"


@dataclass(frozen=True)
class UsageTotals:
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_micros: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def cached_share(self) -> float:
        """Cached input over all input (0.0 when there was none)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


ZERO = UsageTotals(0, 0, 0, 0, 0)


@dataclass(frozen=True)
class UsagePoint:
    """One series' sums in one bucket (``bucket_start``)."""

    bucket_start: datetime
    series: str  # a served model, or a tenant id
    totals: UsageTotals


@dataclass(frozen=True)
class TenantSpend:
    tenant_id: str
    totals: UsageTotals


@dataclass(frozen=True)
class EndUserSpend:
    end_user: str
    totals: UsageTotals


def usage_series(
    session: Session,
    start: datetime,
    end: datetime,
    bucket: timedelta,
    by: SeriesBy,
    tenant_id: str | None = None,
) -> list[UsagePoint]:
    """Sums per bucket and model (or tenant) over ``[start, end)``, ``tenant_id``'s only if
    given; ordered by bucket, then series."""
    size = int(bucket.total_seconds())
    bucket_index = bucket_index_of(session, size).label("bucket")
    series = (UsageRecord.tenant_id if by == "tenant" else UsageRecord.served_model).label("series")
    query = (
        select(bucket_index, series, *_sum_columns())
        .where(UsageRecord.created_at >= start, UsageRecord.created_at < end)
        .group_by(bucket_index, series)
    )
    if tenant_id is not None:
        query = query.where(UsageRecord.tenant_id == tenant_id)
    hash_aggregate_in_memory(session)
    points = []
    starts: dict[int, datetime] = {}
    for row in session.execute(query):
        index, name, sums = int(row[0]), row[1], row[2:]
        at = starts.get(index)
        if at is None:
            at = starts[index] = datetime.fromtimestamp(index * size, tz=timezone.utc)
        points.append(UsagePoint(at, name or NO_MODEL, _totals(sums)))
    points.sort(key=lambda point: (point.bucket_start, point.series))
    return points


def tenant_spend(
    session: Session, tenant_ids: Sequence[str], start: datetime, end: datetime
) -> dict[str, UsageTotals]:
    """Each listed tenant's sums over ``[start, end)`` (one indexed range per tenant)."""
    if not tenant_ids:
        return {}
    query = (
        select(UsageRecord.tenant_id, *_sum_columns())
        .where(
            UsageRecord.tenant_id.in_(list(tenant_ids)),
            UsageRecord.created_at >= start,
            UsageRecord.created_at < end,
        )
        .group_by(UsageRecord.tenant_id)
    )
    return {row[0]: _totals(row[1:]) for row in session.execute(query)}


def end_users_by_spend(
    session: Session, tenant_id: str, start: datetime, end: datetime, limit: int
) -> list[EndUserSpend]:
    """The tenant's end users (the requests' ``user``) by cost, then tokens, most first."""
    cost = func.sum(UsageRecord.cost_micros)
    tokens = func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens)
    query = (
        select(UsageRecord.end_user, *_sum_columns())
        .where(
            UsageRecord.tenant_id == tenant_id,
            UsageRecord.end_user.is_not(None),
            UsageRecord.created_at >= start,
            UsageRecord.created_at < end,
        )
        .group_by(UsageRecord.end_user)
        .order_by(cost.desc(), tokens.desc(), UsageRecord.end_user)
        .limit(limit)
    )
    return [EndUserSpend(row[0], _totals(row[1:])) for row in session.execute(query)]


def keys_last_used(session: Session, key_ids: Sequence[str]) -> dict[str, datetime]:
    """When each key last made a request (keys that never did are absent)."""
    if not key_ids:
        return {}
    query = (
        select(UsageRecord.key_id, func.max(UsageRecord.created_at))
        .where(UsageRecord.key_id.in_(list(key_ids)))
        .group_by(UsageRecord.key_id)
    )
    found: dict[str, datetime] = {}
    for key_id, at in session.execute(query):
        if key_id is not None:
            found[key_id] = _utc(at)
    return found


def tenant_keys(session: Session, tenant_id: str) -> list[ApiKeyRow]:
    return list(
        session.scalars(
            select(ApiKeyRow).where(ApiKeyRow.tenant_id == tenant_id).order_by(ApiKeyRow.created_at)
        )
    )


def scoped_budgets_of(session: Session, tenant_id: str) -> list[ScopedBudget]:
    """The tenant's key and end-user budgets, keys first."""
    rows = session.scalars(
        select(ScopedBudgetRow)
        .where(ScopedBudgetRow.tenant_id == tenant_id)
        .order_by(ScopedBudgetRow.scope, ScopedBudgetRow.subject)
    )
    return [
        ScopedBudget(
            scope=_scope(row.scope),
            unit=_unit(row.unit),
            limit=row.amount,
            period=_period(row.period),
            subject=row.subject,
            alert_thresholds=None if row.alert_thresholds is None else tuple(row.alert_thresholds),
        )
        for row in rows
    ]


def budget_used(
    session: Session, tenant_id: str, budget: ScopedBudget, window: BudgetWindow
) -> int:
    """What the usage records charge ``budget`` in ``window``: tokens or micros."""
    amount = (
        func.sum(UsageRecord.cost_micros)
        if budget.unit == "micros"
        else func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens)
    )
    query = select(func.coalesce(amount, 0)).where(UsageRecord.tenant_id == tenant_id)
    if budget.scope == "key":
        query = query.where(UsageRecord.key_id == budget.subject)
    elif budget.scope == "user":
        query = query.where(UsageRecord.end_user == budget.subject)
    if window.start is not None:
        query = query.where(UsageRecord.created_at >= window.start)
    if window.end is not None:
        query = query.where(UsageRecord.created_at < window.end)
    return int(session.scalar(query) or 0)


def hash_aggregate_in_memory(session: Session) -> None:
    """Let PostgreSQL group a window in memory. It cannot estimate how many (bucket, series)
    groups a window holds, guesses one per record, finds that too big for the default
    ``work_mem`` (4 MB) and sorts the window on disk instead: twice the time for a month. The
    real table is small (about 6 MB for 1,000 tenants over 30 days); this transaction only."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"SET LOCAL work_mem = '{AGGREGATE_WORK_MEM}'"))


def bucket_index_of(session: Session, size: int) -> ColumnElement[Any]:
    if session.get_bind().dialect.name == "postgresql":
        # date_part is double precision; extract() is numeric since PostgreSQL 14, and
        # numeric arithmetic on every row of a month's window costs a third more time.
        epoch = func.date_part("epoch", UsageRecord.created_at)
        return cast(func.floor(epoch / size), BigInteger)
    return cast(func.strftime("%s", UsageRecord.created_at), Integer) / size


def _sum_columns() -> list[ColumnElement[Any]]:
    return [
        func.count(),
        func.coalesce(func.sum(UsageRecord.prompt_tokens), 0),
        func.coalesce(func.sum(UsageRecord.cached_tokens), 0),
        func.coalesce(func.sum(UsageRecord.completion_tokens), 0),
        func.coalesce(func.sum(UsageRecord.cost_micros), 0),
    ]


def _totals(values: Sequence[Any]) -> UsageTotals:
    return UsageTotals(*(int(v) for v in values))


def _utc(at: datetime) -> datetime:
    return at.replace(tzinfo=timezone.utc) if at.tzinfo is None else at.astimezone(timezone.utc)


def _scope(value: str) -> BudgetScope:
    if value not in ("key", "user"):
        raise ValueError(f"stored budget scope {value!r} is not key or user")
    return "key" if value == "key" else "user"


def _unit(value: str) -> BudgetUnit:
    return "micros" if value == "micros" else "tokens"


def _period(value: str) -> BudgetPeriod:
    if value == "day":
        return "day"
    return "total" if value == "total" else "month"

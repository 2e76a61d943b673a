"""Usage records: idempotent inserts, cursor pages, and totals for billing and ledger rebuilds.

A record is keyed by ``request_id``: inserting one that is already stored does nothing, so a
retried write (after a timeout whose commit did land, or a spill-file replay) never duplicates.

The export's record ``id`` is the row's primary key, and the cursor is the last ``id`` a reader
has: a page holds the rows with ``id > cursor``. That returns every row exactly once, even to a
follower polling while rows arrive, only if ids become visible in id order. Records are never
deleted, so SQLite's rowid (max + 1, assigned under its single write lock) is. A PostgreSQL
sequence is not by itself: two gateways' transactions can draw ids 7 and 8 and commit 8 first,
and a reader that saw 8 would skip 7 for good. So ``insert_usage`` takes a transaction-scoped
advisory lock before drawing ids: writers of usage records commit one at a time (each a short
batch insert), and a row with a smaller id is always committed before one with a larger id.

::

    gateway A: lock ── ids 7..9 ── commit, unlock
    gateway B:   waits ─────────────────────────── lock ── ids 10..12 ── commit, unlock
    follower:  cursor 6 → sees nothing or 7..9 (never 10 before 7) → cursor 9 → 10..12
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from gateway.storage.models import MAX_FINISH_REASON_LENGTH, UsageRecord, UsageStatus

MAX_PAGE_SIZE = 1000
# The pg_advisory_xact_lock key that orders usage-record commits by id: any fixed bigint
# ("tollus" in ASCII) that no other lock of ours uses.
USAGE_INSERT_LOCK_KEY = 0x746F6C6C7573
_DATETIME_FIELDS = ("created_at", "finished_at")


@dataclass(frozen=True)
class UsageEntry:
    """One request's usage, as the stream relay measured it. Immutable once written."""

    request_id: str
    tenant_id: str
    key_id: str | None
    requested_model: str
    served_model: str | None
    routing_decision: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_micros: int
    status: UsageStatus
    reject_reason: str | None
    streamed: bool
    created_at: datetime
    finished_at: datetime | None = None
    ttft_ms: int | None = None
    model_version: str | None = None  # the version of a rollout that served it (see models)
    # The answer's finish reason as the engine sent it ("stop", "length", "tool_calls",
    # "abort"...); None when none came back (refused, failed, the client gone first).
    finish_reason: str | None = None
    # The request's ``user`` (its end user, within the tenant); None when it named none.
    end_user: str | None = None

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > 64:
            raise ValueError("request_id must be 1 to 64 characters")
        counts = (self.prompt_tokens, self.cached_tokens, self.completion_tokens, self.cost_micros)
        if min(counts) < 0:
            raise ValueError("token counts and cost must not be negative")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("cached_tokens cannot exceed prompt_tokens")
        if (self.status is UsageStatus.REJECTED) != (self.reject_reason is not None):
            raise ValueError("reject_reason is required for, and only for, rejected requests")
        if self.created_at.tzinfo is None:
            raise ValueError("created_at must be timezone-aware")
        if self.finish_reason is not None and not 0 < len(self.finish_reason) <= (
            MAX_FINISH_REASON_LENGTH
        ):
            raise ValueError(f"finish_reason must be 1 to {MAX_FINISH_REASON_LENGTH} characters")

    def to_dict(self) -> dict[str, Any]:
        """The fields by name (a shallow ``dataclasses.asdict``: every field is immutable)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    def to_json_dict(self) -> dict[str, Any]:
        data = self.to_dict()
        data["status"] = self.status.value
        for name in _DATETIME_FIELDS:
            if data[name] is not None:
                data[name] = data[name].isoformat()
        return data

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> UsageEntry:
        data = dict(data)
        data["status"] = UsageStatus(data["status"])
        for name in _DATETIME_FIELDS:
            if data.get(name) is not None:
                data[name] = datetime.fromisoformat(data[name])
        return cls(**data)

    @classmethod
    def from_row(cls, row: UsageRecord) -> UsageEntry:
        return cls(**{name: getattr(row, name) for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class UsagePage:
    """Records oldest first, with their row ids (``ids[i]`` is ``records[i]``'s ``id``)."""

    records: list[UsageEntry]
    ids: list[int]
    next_cursor: int | None  # pass back as ``cursor``; None when this was the last page
    # Where to poll from for records stored after this page: the last id returned, else the
    # cursor the page was read from (None: from the start). Set on every page, the last included.
    resume_cursor: int | None

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.records):
            raise ValueError("a page needs one id per record")

    @property
    def has_more(self) -> bool:
        return self.next_cursor is not None


@dataclass(frozen=True)
class UsageTotals:
    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_micros: int


@dataclass(frozen=True)
class ModelUsageTotals:
    tenant_id: str
    served_model: str | None  # None: rejected before an engine was chosen
    model_version: str | None  # the model entry (a rollout's version) that served it
    totals: UsageTotals


def insert_usage(session: Session, entries: Iterable[UsageEntry]) -> int:
    """Insert the records not yet stored (by ``request_id``); returns how many were new."""
    rows: dict[str, dict[str, Any]] = {}
    for entry in entries:
        rows.setdefault(entry.request_id, entry.to_dict())
    if not rows:
        return 0
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        # Held to the end of the transaction: ids commit in id order (see the module docstring).
        session.execute(select(func.pg_advisory_xact_lock(USAGE_INSERT_LOCK_KEY)))
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    statement = (
        insert(UsageRecord)
        .on_conflict_do_nothing(index_elements=["request_id"])
        .returning(UsageRecord.id)
    )
    result = session.execute(statement, list(rows.values()))
    return len(result.all())


def list_usage(
    session: Session,
    *,
    tenant_id: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    cursor: int | None = None,
    limit: int = 100,
) -> UsagePage:
    """Records in ``[start, end)`` with ``id > cursor``, oldest first, at most ``limit``
    (capped) per page."""
    if limit < 1:
        raise ValueError("limit must be at least 1")
    limit = min(limit, MAX_PAGE_SIZE)
    query = select(UsageRecord).where(*_filters(tenant_id, start, end)).order_by(UsageRecord.id)
    if cursor is not None:
        query = query.where(UsageRecord.id > cursor)
    rows = list(session.scalars(query.limit(limit + 1)))
    has_more = len(rows) > limit
    rows = rows[:limit]
    return UsagePage(
        records=[UsageEntry.from_row(row) for row in rows],
        ids=[row.id for row in rows],
        next_cursor=rows[-1].id if has_more else None,
        resume_cursor=rows[-1].id if rows else cursor,
    )


def summarize_usage(
    session: Session, *, start: datetime, end: datetime, tenant_id: str | None = None
) -> list[ModelUsageTotals]:
    """Totals per tenant, served model and version for records created in ``[start, end)``
    (each version of a rollout has its own prices, so a bill shows them apart)."""
    keys = (UsageRecord.tenant_id, UsageRecord.served_model, UsageRecord.model_version)
    query = (
        select(*keys, *_total_columns())
        .where(*_filters(tenant_id, start, end))
        .group_by(*keys)
        .order_by(*keys)
    )
    return [
        ModelUsageTotals(
            tenant_id=row[0], served_model=row[1], model_version=row[2], totals=_totals(row[3:])
        )
        for row in session.execute(query)
    ]


def sum_tokens(
    session: Session,
    tenant_id: str,
    start: datetime,
    end: datetime,
    *,
    key_id: str | None = None,
    end_user: str | None = None,
) -> UsageTotals:
    """One tenant's totals over ``[start, end)``, or those of one of its keys or end users:
    what a budget ledger rebuilds from (and what spend per key or user sums to).

    Served by the ``(tenant_id, created_at)``, ``(key_id, created_at)`` and ``(tenant_id,
    end_user, created_at)`` indexes.
    """
    filters = _filters(tenant_id, start, end)
    if key_id is not None:
        filters.append(UsageRecord.key_id == key_id)
    if end_user is not None:
        filters.append(UsageRecord.end_user == end_user)
    row = session.execute(select(*_total_columns()).where(*filters)).one()
    return _totals(row)


def _filters(
    tenant_id: str | None, start: datetime | None, end: datetime | None
) -> list[ColumnElement[bool]]:
    filters: list[ColumnElement[bool]] = []
    if tenant_id is not None:
        filters.append(UsageRecord.tenant_id == tenant_id)
    if start is not None:
        filters.append(UsageRecord.created_at >= start)
    if end is not None:
        filters.append(UsageRecord.created_at < end)
    return filters


def _total_columns() -> list[ColumnElement[Any]]:
    return [
        func.count(UsageRecord.id),
        func.coalesce(func.sum(UsageRecord.prompt_tokens), 0),
        func.coalesce(func.sum(UsageRecord.cached_tokens), 0),
        func.coalesce(func.sum(UsageRecord.completion_tokens), 0),
        func.coalesce(func.sum(UsageRecord.cost_micros), 0),
    ]


def _totals(values: Sequence[Any]) -> UsageTotals:
    # PostgreSQL returns SUM(bigint) as NUMERIC: convert to exact ints.
    count, prompt, cached, completion, cost = (int(value) for value in values)
    return UsageTotals(
        num_requests=count,
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        cost_micros=cost,
    )

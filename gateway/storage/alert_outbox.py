"""The budget alerts' outbox: events written when a crossing is recorded, read until sent.

Life of an event::

    add_event ──(budget, period, threshold) seen before──> nothing (fired once per period)
        │ pending, due now
        ▼
    claim_due: due pending events, leased (next attempt pushed lease_s on, one more attempt
        │      counted) so another replica does not post them meanwhile
        ├── receiver answered 2xx ───────────> mark_delivered: delivered
        └── refused / unreachable / timeout ─> mark_attempt_failed: due again after a backoff,
                                               or failed after the last attempt

A gateway that stops between its claim and its mark leaves the event pending with its lease:
once the lease lapses any replica (or this one, restarted) claims it again. Delivery is
therefore at least once, and every attempt carries the same event id. On PostgreSQL the
claim skips rows another replica holds locked (``FOR UPDATE SKIP LOCKED``); SQLite has one
writer at a time anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert as postgresql_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from gateway.storage.models import AlertEvent

EVENT_STATES = ("pending", "delivered", "failed")
MAX_ERROR_LENGTH = 500


@dataclass(frozen=True)
class NewAlert:
    event_id: str
    created_at: datetime
    tenant_id: str
    budget_level: str
    budget_id: str
    unit: str
    period_key: str
    threshold_percent: int
    body: str  # the exact JSON every attempt sends


@dataclass(frozen=True)
class DueAlert:
    """A claimed event: what to post, and how many attempts it has had with this one."""

    event_id: str
    body: str
    num_attempts: int


@dataclass(frozen=True)
class AlertRecord:
    id: int
    event_id: str
    created_at: datetime
    tenant_id: str
    budget_level: str
    budget_id: str
    unit: str
    period_key: str
    threshold_percent: int
    body: str
    state: str
    num_attempts: int
    next_attempt_at: datetime | None
    last_error: str | None
    delivered_at: datetime | None

    @classmethod
    def from_row(cls, row: AlertEvent) -> AlertRecord:
        return cls(
            id=row.id,
            event_id=row.event_id,
            created_at=row.created_at,
            tenant_id=row.tenant_id,
            budget_level=row.budget_level,
            budget_id=row.budget_id,
            unit=row.unit,
            period_key=row.period_key,
            threshold_percent=row.threshold_percent,
            body=row.body,
            state=row.state,
            num_attempts=row.num_attempts,
            next_attempt_at=row.next_attempt_at,
            last_error=row.last_error,
            delivered_at=row.delivered_at,
        )


@dataclass(frozen=True)
class AlertPage:
    records: list[AlertRecord]
    next_cursor: int | None  # pass as ``cursor`` for the next (older) page; None: last page


def add_event(session: Session, alert: NewAlert) -> bool:
    """Write ``alert`` as pending and due at once; False (nothing written) when its budget
    (tenant, level, id, unit), period and threshold already have an event, from this replica
    or another."""
    values = {
        "event_id": alert.event_id,
        "created_at": alert.created_at,
        "tenant_id": alert.tenant_id,
        "budget_level": alert.budget_level,
        "budget_id": alert.budget_id,
        "unit": alert.unit,
        "period_key": alert.period_key,
        "threshold_percent": alert.threshold_percent,
        "body": alert.body,
        "state": "pending",
        "num_attempts": 0,
        "next_attempt_at": alert.created_at,
    }
    is_postgresql = session.get_bind().dialect.name == "postgresql"
    insert = postgresql_insert if is_postgresql else sqlite_insert
    statement = insert(AlertEvent).values(**values).on_conflict_do_nothing()
    # RETURNING, not rowcount: psycopg's rowcount does not tell a skipped row from a written one
    return session.execute(statement.returning(AlertEvent.id)).first() is not None


def claim_due(session: Session, *, now: datetime, lease_s: float, limit: int) -> list[DueAlert]:
    """Lease up to ``limit`` pending events due by ``now``, oldest due first."""
    query = (
        select(AlertEvent)
        .where(AlertEvent.state == "pending", AlertEvent.next_attempt_at <= now)
        .order_by(AlertEvent.next_attempt_at, AlertEvent.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    claimed = []
    for row in session.scalars(query):
        row.num_attempts += 1
        row.next_attempt_at = now + timedelta(seconds=lease_s)
        claimed.append(DueAlert(row.event_id, row.body, row.num_attempts))
    session.flush()
    return claimed


def mark_delivered(session: Session, event_id: str, *, now: datetime) -> None:
    session.execute(
        update(AlertEvent)
        .where(AlertEvent.event_id == event_id, AlertEvent.state == "pending")
        .values(state="delivered", delivered_at=now, next_attempt_at=None, last_error=None)
    )


def mark_attempt_failed(
    session: Session, event_id: str, *, error: str, retry_at: datetime | None
) -> None:
    """Record a failed attempt: due again at ``retry_at``, or ``failed`` when None (the last
    attempt). An event another replica delivered meanwhile stays delivered."""
    values: dict[str, object] = {
        "last_error": error[:MAX_ERROR_LENGTH],
        "next_attempt_at": retry_at,
    }
    if retry_at is None:
        values["state"] = "failed"
    session.execute(
        update(AlertEvent)
        .where(AlertEvent.event_id == event_id, AlertEvent.state == "pending")
        .values(**values)
    )


def next_due_at(session: Session) -> datetime | None:
    """When the earliest pending event is due (None: nothing pending)."""
    query = select(AlertEvent.next_attempt_at).where(AlertEvent.state == "pending")
    return session.scalar(query.order_by(AlertEvent.next_attempt_at).limit(1))


def num_pending(session: Session) -> int:
    """Events not yet delivered nor given up (every replica's: the outbox is shared)."""
    query = select(func.count()).select_from(AlertEvent).where(AlertEvent.state == "pending")
    return int(session.scalar(query) or 0)


def alert_page(
    session: Session,
    *,
    tenant_id: str | None,
    state: str | None,
    cursor: int | None,
    limit: int,
) -> AlertPage:
    """Events newest first, ``limit`` at most: of ``tenant_id`` and in ``state`` (None: any),
    older than event ``cursor`` (its ``id``)."""
    query = select(AlertEvent).order_by(AlertEvent.id.desc()).limit(limit + 1)
    if tenant_id is not None:
        query = query.where(AlertEvent.tenant_id == tenant_id)
    if state is not None:
        query = query.where(AlertEvent.state == state)
    if cursor is not None:
        query = query.where(AlertEvent.id < cursor)
    rows = list(session.scalars(query))
    records = [AlertRecord.from_row(row) for row in rows[:limit]]
    return AlertPage(records, records[-1].id if len(rows) > limit else None)

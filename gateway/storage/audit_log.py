"""The audit log: every admin change, written in the change's own transaction, listed newest
first.

`record_change` takes the caller's ``Session``: the row commits or rolls back with the change
it describes, so the log never claims a change that did not happen nor misses one that did.
The values before and after are JSON objects (the admin API's views of the target: a tenant,
its quota, a key's metadata, a budget, a rollout's weights). A key's secret and its hash are
never among them: `record_change` drops any field named like one (`SECRET_FIELDS`) at any
depth, so a view that grows such a field later still cannot leak it here.

Actions are ``<target>.<verb>``: ``tenant.created``, ``tenant.updated``, ``tenant.deleted``,
``quota.replaced``, ``key.created``, ``key.revoked``, ``budget.set``, ``budget.clear``,
``rollout.weights_changed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gateway.storage.models import AuditEntry

SECRET_FIELDS = frozenset({"key", "key_hash", "secret", "api_key", "token", "admin_key_hash"})


@dataclass(frozen=True)
class AuditRecord:
    id: int
    created_at: datetime
    actor: str
    action: str
    tenant_id: str | None
    target_type: str
    target_id: str
    before: Mapping[str, Any] | None
    after: Mapping[str, Any] | None

    @classmethod
    def from_row(cls, row: AuditEntry) -> AuditRecord:
        return cls(
            id=row.id,
            created_at=row.created_at,
            actor=row.actor,
            action=row.action,
            tenant_id=row.tenant_id,
            target_type=row.target_type,
            target_id=row.target_id,
            before=row.before,
            after=row.after,
        )


@dataclass(frozen=True)
class AuditPage:
    records: list[AuditRecord]
    next_cursor: int | None  # pass as ``cursor`` for the next (older) page; None: last page


def record_change(
    session: Session,
    *,
    actor: str,
    action: str,
    target_type: str,
    target_id: str,
    tenant_id: str | None,
    before: Mapping[str, Any] | None,
    after: Mapping[str, Any] | None,
    now: datetime,
) -> None:
    """Add one entry to the session's transaction (flushed, so a failure shows here)."""
    session.add(
        AuditEntry(
            created_at=now,
            actor=actor,
            action=action,
            tenant_id=tenant_id,
            target_type=target_type,
            target_id=target_id,
            before=None if before is None else _without_secrets(before),
            after=None if after is None else _without_secrets(after),
        )
    )
    session.flush()


def audit_page(
    session: Session,
    *,
    tenant_id: str | None,
    start: datetime | None,
    end: datetime | None,
    cursor: int | None,
    limit: int,
) -> AuditPage:
    """Entries newest first, ``limit`` at most: of ``tenant_id`` (None: all), created in
    ``[start, end)``, older than entry ``cursor``."""
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit + 1)
    if tenant_id is not None:
        query = query.where(AuditEntry.tenant_id == tenant_id)
    if start is not None:
        query = query.where(AuditEntry.created_at >= start)
    if end is not None:
        query = query.where(AuditEntry.created_at < end)
    if cursor is not None:
        query = query.where(AuditEntry.id < cursor)
    rows = list(session.scalars(query))
    records = [AuditRecord.from_row(row) for row in rows[:limit]]
    next_cursor = records[-1].id if len(rows) > limit else None
    return AuditPage(records, next_cursor)


def _without_secrets(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _scrubbed(v) for k, v in values.items() if k not in SECRET_FIELDS}


def _scrubbed(value: Any) -> Any:
    if isinstance(value, Mapping):
        return _without_secrets(value)
    if isinstance(value, list | tuple):
        return [_scrubbed(item) for item in value]
    return value

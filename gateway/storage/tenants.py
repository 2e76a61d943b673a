"""Tenant repository: create, read, update and soft-delete tenants.

Functions take a ``Session`` and leave the transaction to the caller
(``with database.transaction() as session: ...``). A deleted tenant keeps its row (usage records
and keys still name it), so its id stays taken.

Ids are unique regardless of case: ``Acme`` is refused beside ``acme`` (a unique index on
``lower(id)``, migration 0004, backs the check against concurrent creates). An id keeps the
spelling it was created with and lookups are exact: the id is also the name of the tenant's
keys, usage records and ledger entries, so it must not change or have two spellings.

Listings come in pages ordered by id; the cursor is the last id seen, so paging by
``id > cursor`` returns every tenant once, whichever are created or deleted meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from gateway.storage.models import Tenant, utc_now


class TenantExistsError(ValueError):
    """The tenant id, in any case, is already taken (possibly by a deleted tenant)."""

    def __init__(self, existing_id: str) -> None:
        super().__init__(f"tenant {existing_id!r} already exists")
        self.existing_id = existing_id


@dataclass(frozen=True)
class TenantInfo:
    id: str
    name: str
    tier: str
    quota: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    deleted_at: datetime | None

    @property
    def is_deleted(self) -> bool:
        return self.deleted_at is not None

    @classmethod
    def from_row(cls, row: Tenant) -> TenantInfo:
        return cls(
            id=row.id,
            name=row.name,
            tier=row.tier,
            quota=dict(row.quota),
            created_at=row.created_at,
            updated_at=row.updated_at,
            deleted_at=row.deleted_at,
        )


def create_tenant(
    session: Session,
    tenant_id: str,
    *,
    name: str,
    tier: str,
    quota: dict[str, Any],
    now: datetime | None = None,
) -> TenantInfo:
    if not tenant_id or len(tenant_id) > 64:
        raise ValueError("tenant id must be 1 to 64 characters")
    existing = session.scalar(
        select(Tenant.id).where(func.lower(Tenant.id) == func.lower(tenant_id)).limit(1)
    )
    if existing is not None:
        raise TenantExistsError(existing)
    now = now or utc_now()
    row = Tenant(
        id=tenant_id,
        name=name,
        tier=tier,
        quota=dict(quota),
        created_at=now,
        updated_at=now,
        deleted_at=None,
    )
    session.add(row)
    session.flush()
    return TenantInfo.from_row(row)


def get_tenant(
    session: Session, tenant_id: str, *, include_deleted: bool = False
) -> TenantInfo | None:
    row = session.get(Tenant, tenant_id)
    if row is None or (row.deleted_at is not None and not include_deleted):
        return None
    return TenantInfo.from_row(row)


def list_tenants(session: Session, *, include_deleted: bool = False) -> list[TenantInfo]:
    query = select(Tenant).order_by(Tenant.id)
    if not include_deleted:
        query = query.where(Tenant.deleted_at.is_(None))
    return [TenantInfo.from_row(row) for row in session.scalars(query)]


@dataclass(frozen=True)
class TenantPage:
    tenants: list[TenantInfo]
    next_cursor: str | None  # pass back as ``cursor``; None when this was the last page


def tenant_page(
    session: Session, *, include_deleted: bool = False, cursor: str | None = None, limit: int
) -> TenantPage:
    """At most ``limit`` tenants with ids after ``cursor``, by id."""
    if limit < 1:
        raise ValueError("limit must be at least 1")
    query = select(Tenant).order_by(Tenant.id).limit(limit + 1)
    if not include_deleted:
        query = query.where(Tenant.deleted_at.is_(None))
    if cursor is not None:
        query = query.where(Tenant.id > cursor)
    rows = list(session.scalars(query))
    has_more = len(rows) > limit
    rows = rows[:limit]
    return TenantPage(
        tenants=[TenantInfo.from_row(row) for row in rows],
        next_cursor=rows[-1].id if has_more else None,
    )


def update_tenant(
    session: Session,
    tenant_id: str,
    *,
    name: str | None = None,
    tier: str | None = None,
    quota: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> TenantInfo | None:
    """Change the given fields of a live tenant; ``None`` if there is no such tenant."""
    row = session.get(Tenant, tenant_id)
    if row is None or row.deleted_at is not None:
        return None
    if name is not None:
        row.name = name
    if tier is not None:
        row.tier = tier
    if quota is not None:
        row.quota = dict(quota)
    row.updated_at = now or utc_now()
    session.flush()
    return TenantInfo.from_row(row)


def delete_tenant(session: Session, tenant_id: str, *, now: datetime | None = None) -> bool:
    """Soft-delete a live tenant; ``False`` if there was none. Its keys stop working at once."""
    row = session.get(Tenant, tenant_id)
    if row is None or row.deleted_at is not None:
        return False
    row.deleted_at = row.updated_at = now or utc_now()
    session.flush()
    return True

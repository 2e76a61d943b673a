"""SQLAlchemy models: tenants, API keys, usage records, scoped budgets, the audit log and the
alert outbox.

Timestamps are timezone-aware UTC in Python on every backend. SQLite has no time zone type, so
:class:`UtcDateTime` stores naive UTC there and puts the zone back on the way out; comparisons
stay correct because every stored value is UTC.

``usage_records`` has no foreign keys on purpose: it is an append-only billing ledger, and a
record must never be refused because an admin row changed (a tenant purged by an operator, a key
row edited by hand). Tenants are only ever soft-deleted by the application.
"""

from __future__ import annotations

import enum
import json
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Enum,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    func,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_N_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC ``datetime`` on every backend; naive values are refused."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware datetime")
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


class JsonDict(TypeDecorator[dict[str, Any]]):
    """A JSON object kept as text (stable key order), portable across backends."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: dict[str, Any] | None, dialect: Dialect) -> str | None:
        return None if value is None else json.dumps(value, sort_keys=True)

    def process_result_value(self, value: str | None, dialect: Dialect) -> dict[str, Any] | None:
        if value is None:
            return None
        loaded = json.loads(value)
        if not isinstance(loaded, dict):
            raise ValueError(f"expected a JSON object, got {type(loaded).__name__}")
        return loaded


# The longest finish reason a usage record keeps: OpenAI's and our engine's are at most 14
# characters ("content_filter"); an upstream that sends a longer one has it recorded as null.
MAX_FINISH_REASON_LENGTH = 32


class UsageStatus(str, enum.Enum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"  # the client went away before the end
    UPSTREAM_ERROR = "upstream_error"
    REJECTED = "rejected"  # refused before reaching an engine; see reject_reason


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    """A tenant. Ids are unique regardless of case (migration 0004): ``Acme`` cannot be
    created beside ``acme``, while every id keeps the spelling it was created with."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    tier: Mapped[str] = mapped_column(String(32))
    quota: Mapped[dict[str, Any]] = mapped_column(JsonDict)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)
    deleted_at: Mapped[datetime | None] = mapped_column(UtcDateTime)


Index("uq_tenants_lower_id", func.lower(Tenant.id), unique=True)


class ApiKeyRow(Base):
    """An API key, stored only as the SHA-256 of the full key (see ``api_keys``)."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    name: Mapped[str] = mapped_column(String(200))
    priority: Mapped[str | None] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime)


class UsageRecord(Base):
    """One immutable row per request. ``id`` only grows, so it is the pagination cursor."""

    __tablename__ = "usage_records"
    __table_args__ = (
        Index("ix_usage_records_tenant_id_created_at", "tenant_id", "created_at"),
        # Covering the console's sums over a window on PostgreSQL (migration 0007).
        Index(
            "ix_usage_records_created_at",
            "created_at",
            postgresql_include=[
                "tenant_id",
                "served_model",
                "prompt_tokens",
                "cached_tokens",
                "completion_tokens",
                "cost_micros",
            ],
        ),
        # Spend per end user and per key over a window (migration 0005).
        Index(
            "ix_usage_records_tenant_id_end_user_created_at", "tenant_id", "end_user", "created_at"
        ),
        Index("ix_usage_records_key_id_created_at", "key_id", "created_at"),
    )

    # BIGINT on PostgreSQL; on SQLite only INTEGER PRIMARY KEY is the autoincrementing rowid.
    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    request_id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    key_id: Mapped[str | None] = mapped_column(String(40))
    requested_model: Mapped[str] = mapped_column(String(200))
    served_model: Mapped[str | None] = mapped_column(String(200))
    # The model entry that served it: a rollout's version, else ``served_model`` (migration 0002).
    model_version: Mapped[str | None] = mapped_column(String(200))
    routing_decision: Mapped[str | None] = mapped_column(String(200))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    cost_micros: Mapped[int] = mapped_column(BigInteger)  # millionths of a currency unit
    status: Mapped[UsageStatus] = mapped_column(
        Enum(
            UsageStatus,
            native_enum=False,
            create_constraint=True,
            length=16,
            name="status",
            values_callable=lambda members: [m.value for m in members],
            validate_strings=True,
        )
    )
    reject_reason: Mapped[str | None] = mapped_column(String(200))
    streamed: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    ttft_ms: Mapped[int | None] = mapped_column(Integer)
    # The answer's finish reason as the engine sent it ("stop", "length", "tool_calls"...);
    # null when none came back (migration 0003).
    finish_reason: Mapped[str | None] = mapped_column(String(MAX_FINISH_REASON_LENGTH))
    # The request's ``user`` field, within its tenant; null when it named none (migration 0005).
    end_user: Mapped[str | None] = mapped_column(String(256))


class ScopedBudget(Base):
    """A budget below the tenant (migration 0005): on an API key (``scope="key"``, ``subject``
    its id) or on an end user (``scope="user"``, ``subject`` the request's ``user``), in
    ``tokens`` or ``micros`` over a period. A tenant's own budget stays in its quota.
    ``alert_thresholds`` (migration 0008): its own alert percents as a JSON list, ascending;
    null: the ``alerts:`` settings' default."""

    __tablename__ = "scoped_budgets"
    __table_args__ = (
        PrimaryKeyConstraint("tenant_id", "scope", "subject"),
        CheckConstraint("scope IN ('key', 'user')", name="scope"),
        CheckConstraint("unit IN ('tokens', 'micros')", name="unit"),
        CheckConstraint("period IN ('day', 'month', 'total')", name="period"),
        CheckConstraint("amount >= 0", name="amount"),
    )

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    scope: Mapped[str] = mapped_column(String(8))
    subject: Mapped[str] = mapped_column(String(256))
    unit: Mapped[str] = mapped_column(String(8))
    amount: Mapped[int] = mapped_column(BigInteger)
    period: Mapped[str] = mapped_column(String(8))
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)
    alert_thresholds: Mapped[list[int] | None] = mapped_column(JSON)


class AuditEntry(Base):
    """One admin change (migration 0006), written in the change's own transaction: who (an
    identifier of the admin credential, never the credential), when, what, and the target's
    values before and after as JSON (no key secret or key hash is ever among them). ``id``
    only grows: the newest-first listing pages by it."""

    __tablename__ = "audit_log"
    __table_args__ = (
        Index("ix_audit_log_created_at", "created_at"),
        Index("ix_audit_log_tenant_id_created_at", "tenant_id", "created_at"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    actor: Mapped[str] = mapped_column(String(80))
    action: Mapped[str] = mapped_column(String(40))
    tenant_id: Mapped[str | None] = mapped_column(String(64))
    target_type: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str] = mapped_column(String(300))
    before: Mapped[dict[str, Any] | None] = mapped_column(JsonDict)
    after: Mapped[dict[str, Any] | None] = mapped_column(JsonDict)


class AlertEvent(Base):
    """A budget alert in the outbox (migration 0006): written in the step that records the
    crossing, delivered by the gateway's webhook task (``gateway.alerts``). The unique key
    on (budget, period, threshold) is what fires each threshold once per period across
    replicas. ``body`` is the exact JSON every attempt sends; ``event_id`` is its
    idempotency id, the same on every attempt."""

    __tablename__ = "alert_events"
    __table_args__ = (
        UniqueConstraint(
            "tenant_id",
            "budget_level",
            "budget_id",
            "unit",
            "period_key",
            "threshold_percent",
            name="uq_alert_events_budget_period_threshold",
        ),
        CheckConstraint("state IN ('pending', 'delivered', 'failed')", name="state"),
        Index("ix_alert_events_state_next_attempt_at", "state", "next_attempt_at"),
        Index("ix_alert_events_tenant_id_id", "tenant_id", "id"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    event_id: Mapped[str] = mapped_column(String(40), unique=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    tenant_id: Mapped[str] = mapped_column(String(64))
    budget_level: Mapped[str] = mapped_column(String(8))
    budget_id: Mapped[str] = mapped_column(String(256))
    unit: Mapped[str] = mapped_column(String(8))  # tokens or micros: a tenant may have both
    period_key: Mapped[str] = mapped_column(String(32))
    threshold_percent: Mapped[int] = mapped_column(Integer)
    body: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16))
    num_attempts: Mapped[int] = mapped_column(Integer)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    last_error: Mapped[str | None] = mapped_column(String(500))
    delivered_at: Mapped[datetime | None] = mapped_column(UtcDateTime)

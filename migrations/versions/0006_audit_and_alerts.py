"""audit_log (every admin change, who and when, before and after) and alert_events (the
budget alerts' outbox).

``audit_log`` is append-only: a row is written in the same transaction as the change it
records, so a change without its row (or a row without its change) cannot be committed.
``alert_events`` holds each budget alert from the moment its crossing is recorded until its
webhook is delivered (or given up, ``failed``); the gateway's delivery task reads it at
start, so an event left undelivered by a restart is still sent. Its unique key on (budget,
period, threshold) fires each threshold once per budget period across replicas. Neither
table has foreign keys: both outlive the rows they name (a deleted tenant's history stays).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(80), nullable=False),
        sa.Column("action", sa.String(40), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=True),
        sa.Column("target_type", sa.String(32), nullable=False),
        sa.Column("target_id", sa.String(300), nullable=False),
        sa.Column("before", sa.Text(), nullable=True),
        sa.Column("after", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_audit_log"),
    )
    op.create_index("ix_audit_log_created_at", "audit_log", ["created_at"])
    op.create_index("ix_audit_log_tenant_id_created_at", "audit_log", ["tenant_id", "created_at"])
    op.create_table(
        "alert_events",
        sa.Column("id", _ID, primary_key=True, autoincrement=True),
        sa.Column("event_id", sa.String(40), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("budget_level", sa.String(8), nullable=False),
        sa.Column("budget_id", sa.String(256), nullable=False),
        sa.Column("unit", sa.String(8), nullable=False),
        sa.Column("period_key", sa.String(32), nullable=False),
        sa.Column("threshold_percent", sa.Integer(), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("num_attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.String(500), nullable=True),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_alert_events"),
        sa.UniqueConstraint("event_id", name="uq_alert_events_event_id"),
        sa.UniqueConstraint(
            "tenant_id",
            "budget_level",
            "budget_id",
            "unit",
            "period_key",
            "threshold_percent",
            name="uq_alert_events_budget_period_threshold",
        ),
        sa.CheckConstraint(
            "state IN ('pending', 'delivered', 'failed')", name="ck_alert_events_state"
        ),
    )
    op.create_index(
        "ix_alert_events_state_next_attempt_at", "alert_events", ["state", "next_attempt_at"]
    )
    op.create_index("ix_alert_events_tenant_id_id", "alert_events", ["tenant_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_alert_events_tenant_id_id", table_name="alert_events")
    op.drop_index("ix_alert_events_state_next_attempt_at", table_name="alert_events")
    op.drop_table("alert_events")
    op.drop_index("ix_audit_log_tenant_id_created_at", table_name="audit_log")
    op.drop_index("ix_audit_log_created_at", table_name="audit_log")
    op.drop_table("audit_log")

"""Budgets below the tenant: on an API key and on an end user; the end user on usage records.

``scoped_budgets`` holds one budget per (tenant, scope, subject): scope ``key`` names an API
key's id, scope ``user`` an end user (the request's ``user`` field, which only means something
within its tenant, hence the tenant in the key). Each is in ``tokens`` or in ``micros``
(millionths of the currency the model prices are in) over a period, as a tenant's own budget
is (which stays in the tenant's quota). No foreign key on ``subject``: an end user has no row
anywhere, and a revoked key's budget is kept with its history.

``usage_records.end_user`` is null for requests that named no user and for rows from before
this revision (never recorded: null, not a guess). Two indexes let spend be summed over a time
window per key and per tenant + end user without scanning the tenant's records.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "scoped_budgets",
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("scope", sa.String(8), nullable=False),
        sa.Column("subject", sa.String(256), nullable=False),
        sa.Column("unit", sa.String(8), nullable=False),
        sa.Column("amount", sa.BigInteger(), nullable=False),
        sa.Column("period", sa.String(8), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("scope IN ('key', 'user')", name="ck_scoped_budgets_scope"),
        sa.CheckConstraint("unit IN ('tokens', 'micros')", name="ck_scoped_budgets_unit"),
        sa.CheckConstraint("period IN ('day', 'month', 'total')", name="ck_scoped_budgets_period"),
        sa.CheckConstraint("amount >= 0", name="ck_scoped_budgets_amount"),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name="fk_scoped_budgets_tenant_id_tenants"
        ),
        sa.PrimaryKeyConstraint("tenant_id", "scope", "subject", name="pk_scoped_budgets"),
    )
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(sa.Column("end_user", sa.String(256), nullable=True))
    op.create_index(
        "ix_usage_records_tenant_id_end_user_created_at",
        "usage_records",
        ["tenant_id", "end_user", "created_at"],
    )
    op.create_index("ix_usage_records_key_id_created_at", "usage_records", ["key_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_usage_records_key_id_created_at", table_name="usage_records")
    op.drop_index("ix_usage_records_tenant_id_end_user_created_at", table_name="usage_records")
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("end_user")
    op.drop_table("scoped_budgets")

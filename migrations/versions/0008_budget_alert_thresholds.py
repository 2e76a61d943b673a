"""A key's or end user's budget names its own alert thresholds.

``scoped_budgets.alert_thresholds`` is a JSON list of whole percents of the budget's limit,
ascending and unique (``[25, 50, 100]``), checked by the admin API and the console before it
is written; null (every row from before this revision) uses the ``alerts:`` settings'
default. A tenant's own budgets keep theirs in its quota (``alert_thresholds``), as they keep
their limits.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("scoped_budgets") as batch:
        batch.add_column(sa.Column("alert_thresholds", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("scoped_budgets") as batch:
        batch.drop_column("alert_thresholds")

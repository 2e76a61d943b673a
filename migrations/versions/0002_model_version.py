"""usage_records.model_version: the model entry (a rollout's version) that served a request.

Rows written before it are backfilled with their served model: until rollouts existed, the
served model was the entry that served them.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.add_column(sa.Column("model_version", sa.String(200), nullable=True))
    op.execute("UPDATE usage_records SET model_version = served_model")


def downgrade() -> None:
    with op.batch_alter_table("usage_records") as batch:
        batch.drop_column("model_version")

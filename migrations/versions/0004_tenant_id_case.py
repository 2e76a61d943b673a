"""tenants: ids unique regardless of case (a unique index on ``lower(id)``).

Existing ids keep their spelling: they are named by API keys, usage records and the
ledger's Redis keys, so rewriting them would move billing history. A database that already
holds ids differing only in case cannot take the index; the upgrade stops and names them, so
an operator decides which tenant to rename (nothing is renamed behind anyone's back).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    rows = op.get_bind().execute(
        sa.text(
            "SELECT id FROM tenants WHERE lower(id) IN "
            "(SELECT lower(id) FROM tenants GROUP BY lower(id) HAVING count(*) > 1) ORDER BY id"
        )
    )
    clashing = [row[0] for row in rows]
    if clashing:
        raise RuntimeError(
            "tenant ids that differ only in case cannot coexist from migration 0004 on; "
            f"rename all but one of each group first (tenants, api_keys and usage_records "
            f"name them): {', '.join(clashing)}"
        )
    op.create_index("uq_tenants_lower_id", "tenants", [sa.text("lower(id)")], unique=True)


def downgrade() -> None:
    op.drop_index("uq_tenants_lower_id", table_name="tenants")

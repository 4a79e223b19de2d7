"""core: index the dead-token records by `invalidated_at`

The hourly sweep (`sweep_invalid_tokens`: `DELETE ... WHERE invalidated_at < cutoff`),
run by every gateway node, read every row of `pushgw_invalid_tokens` on SQLite and
PostgreSQL: the column had no index.

Revision ID: core_0002
Revises: core_0001
"""

from alembic import op

revision = "core_0002"
down_revision = "core_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_pushgw_invalid_tokens_invalidated_at", "pushgw_invalid_tokens", ["invalidated_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_pushgw_invalid_tokens_invalidated_at", table_name="pushgw_invalid_tokens")

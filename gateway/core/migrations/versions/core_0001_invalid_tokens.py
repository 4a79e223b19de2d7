"""core: invalid token records

Revision ID: core_0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "core_0001"
down_revision = None
branch_labels = ("core",)
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pushgw_invalid_tokens",
        sa.Column("plugin", sa.String(64), primary_key=True),
        sa.Column("app_id", sa.String(255), primary_key=True),
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("provider", sa.String(8), nullable=True),
        sa.Column("reason", sa.String(64), nullable=True),
        sa.Column("invalidated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("pushgw_invalid_tokens")

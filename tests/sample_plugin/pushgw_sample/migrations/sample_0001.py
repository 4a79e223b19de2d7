"""sample: invalid tokens table

Revision ID: sample_0001
"""

import sqlalchemy as sa
from alembic import op

revision = "sample_0001"
down_revision = None
branch_labels = ("sample",)
depends_on = "core_0001"


def upgrade() -> None:
    op.create_table(
        "sample_invalid",
        sa.Column("token_hash", sa.String(64), primary_key=True),
        sa.Column("reason", sa.String(64)),
    )


def downgrade() -> None:
    op.drop_table("sample_invalid")

"""zulip: when each device registration was last made (`registered_at`)

A provider's token-invalid answer to a push sent before the device registered its
token again ended the registration the device had just made: its notifications were
then not sent until it registered once more. `registered_at` is set at every
registration; an answer (or a dead-token file) older than it leaves the row alone.
Rows made before this revision keep NULL: registered before any answer.

Revision ID: zulip_0003
Revises: zulip_0002
"""

import sqlalchemy as sa
from alembic import op

revision = "zulip_0003"
down_revision = "zulip_0002"
branch_labels = None
depends_on = None

TABLES = ("zulip_e2ee_devices", "zulip_legacy_devices")


def upgrade() -> None:
    for table in TABLES:
        op.add_column(table, sa.Column("registered_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("registered_at")

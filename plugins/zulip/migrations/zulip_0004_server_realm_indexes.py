"""zulip: indexes for server registration and the gc's realm and server sweeps

A new server's registration (`remotes/server/register`, `pushgw zulip add-server`) looks
for an active server of the same `hostname`, and `pushgw zulip gc` (and the periodic
collection) looks for realms deleted or deactivated before the cutoff
(`locally_deleted_at`, `deactivated_at`) and servers deactivated before it
(`deactivated_at`). None of these columns had an index: on PostgreSQL and SQLite each of
them read the whole of `zulip_servers` or `zulip_realms`.

Built inside the migration's transaction, as every revision is: writes to the two
tables wait while they are built (docs/cli.md, `pushgw db upgrade`); both are small next
to the device tables.

Revision ID: zulip_0004
Revises: zulip_0003
"""

from alembic import op

revision = "zulip_0004"
down_revision = "zulip_0003"
branch_labels = None
depends_on = None

INDEXES = (
    ("ix_zulip_servers_hostname", "zulip_servers", "hostname"),
    ("ix_zulip_servers_deactivated_at", "zulip_servers", "deactivated_at"),
    ("ix_zulip_realms_locally_deleted_at", "zulip_realms", "locally_deleted_at"),
    ("ix_zulip_realms_deactivated_at", "zulip_realms", "deactivated_at"),
)


def upgrade() -> None:
    for name, table, column in INDEXES:
        op.create_index(name, table, [column])


def downgrade() -> None:
    for name, table, _column in reversed(INDEXES):
        op.drop_index(name, table_name=table)

"""zulip: indexes for garbage collection (expired E2EE devices, legacy devices by realm)

`pushgw zulip gc` (and the periodic collection) deleted expired E2EE registrations
(`expired_at < cutoff`) and legacy registrations of gone realms (`realm_id IN (...)`)
by reading every row of the device tables on PostgreSQL: neither column had an index.
`zulip_legacy_devices.realm_id` is also a foreign key (ON DELETE SET NULL), which
PostgreSQL does not index by itself: deleting a realm read the whole table too.

Revision ID: zulip_0002
Revises: zulip_0001
"""

from alembic import op

revision = "zulip_0002"
down_revision = "zulip_0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_zulip_e2ee_devices_expired_at", "zulip_e2ee_devices", ["expired_at"])
    op.create_index("ix_zulip_legacy_devices_realm_id", "zulip_legacy_devices", ["realm_id"])


def downgrade() -> None:
    op.drop_index("ix_zulip_legacy_devices_realm_id", table_name="zulip_legacy_devices")
    op.drop_index("ix_zulip_e2ee_devices_expired_at", table_name="zulip_e2ee_devices")

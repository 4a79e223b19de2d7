"""zulip: servers, realms, E2EE and legacy device registrations

Revision ID: zulip_0001
Revises:
Depends on: core_0001
"""

import sqlalchemy as sa
from alembic import op

revision = "zulip_0001"
down_revision = None
branch_labels = ("zulip",)
depends_on = "core_0001"


def upgrade() -> None:
    op.create_table(
        "zulip_servers",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("uuid", sa.String(36), nullable=False, unique=True),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("contact_email", sa.String(255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_request_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deactivated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("push_disabled", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("disabled_reason", sa.String(255), nullable=True),
        sa.Column("version", sa.String(128), nullable=True),
        sa.Column("merge_base", sa.String(128), nullable=True),
        sa.Column("api_feature_level", sa.Integer, nullable=True),
        sa.Column("last_realm_count_id", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("last_installation_count_id", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("last_realmauditlog_id", sa.BigInteger, nullable=False, server_default="0"),
    )
    op.create_table(
        "zulip_realms",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column(
            "server_id",
            sa.Integer,
            sa.ForeignKey("zulip_servers.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("uuid", sa.String(36), nullable=False, unique=True),
        sa.Column("host", sa.String(255), nullable=False, server_default=""),
        sa.Column("name", sa.Text, nullable=False, server_default=""),
        sa.Column("org_type", sa.Integer, nullable=True),
        sa.Column("deactivated", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("deactivated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("is_system_bot_realm", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("locally_deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("push_disabled", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("disabled_reason", sa.String(255), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_request_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_zulip_realms_server_id", "zulip_realms", ["server_id"])
    op.create_table(
        "zulip_e2ee_devices",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column(
            "realm_id",
            sa.Integer,
            sa.ForeignKey("zulip_realms.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("token_id", sa.BigInteger, nullable=False),
        sa.Column("token", sa.Text, nullable=False),
        sa.Column("token_kind", sa.String(8), nullable=False),
        sa.Column("ios_app_id", sa.String(255), nullable=True),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("token_key", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("realm_id", "token_id", name="uq_zulip_e2ee_devices_realm_token_id"),
    )
    op.create_index("ix_zulip_e2ee_devices_token_hash", "zulip_e2ee_devices", ["token_hash"])
    op.create_index("ix_zulip_e2ee_devices_token_key", "zulip_e2ee_devices", ["token_key"])
    op.create_table(
        "zulip_legacy_devices",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column(
            "server_id",
            sa.Integer,
            sa.ForeignKey("zulip_servers.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column(
            "realm_id",
            sa.Integer,
            sa.ForeignKey("zulip_realms.id", ondelete="SET NULL"),
            nullable=True,
        ),
        sa.Column("user_id", sa.BigInteger, nullable=True),
        sa.Column("user_uuid", sa.String(64), nullable=True),
        sa.Column("kind", sa.SmallInteger, nullable=False),
        sa.Column("token", sa.Text, nullable=False),
        sa.Column("token_key", sa.String(64), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("ios_app_id", sa.String(255), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint(
            "server_id", "user_id", "kind", "token_key", name="uq_zulip_legacy_devices_user_id"
        ),
        sa.UniqueConstraint(
            "server_id",
            "user_uuid",
            "kind",
            "token_key",
            name="uq_zulip_legacy_devices_user_uuid",
        ),
    )
    op.create_index("ix_zulip_legacy_devices_token_key", "zulip_legacy_devices", ["token_key"])
    op.create_index("ix_zulip_legacy_devices_token_hash", "zulip_legacy_devices", ["token_hash"])


def downgrade() -> None:
    op.drop_table("zulip_legacy_devices")
    op.drop_table("zulip_e2ee_devices")
    op.drop_table("zulip_realms")
    op.drop_table("zulip_servers")

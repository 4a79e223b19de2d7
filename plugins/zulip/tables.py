"""The zulip plugin's tables (created by the Alembic branch in `migrations/`).

Tokens are stored in clear because they must be sent; lookups go through hashes so
that no index holds a 4 KB token:

- `token_hash`: the core's keyed hash of the exact token (`context.token_hash`), which
  receipts carry, to find rows from `pushgw tokens retire`.
- `token_key`: SHA-256 hex of the token's comparison key (lower case for APNs, whose hex
  tokens are case-insensitive; the token itself for FCM).

`registered_at` is when the device last registered the token (insert or registration
again): a provider's token-invalid answer to a request sent before it, or a dead-token
file made from older receipts, does not end the registration (NULL: made before
zulip_0003, as if registered before any answer).

Server keys are stored as SHA-256 hex only. Analytics rows are never stored: only the
highest row ids seen (`last_*_id`).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
    false,
)

__all__ = ["e2ee_devices", "legacy_devices", "metadata", "realms", "servers"]

metadata = MetaData()

servers = Table(
    "zulip_servers",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("uuid", String(36), nullable=False, unique=True),
    Column("key_hash", String(64), nullable=False),
    Column("hostname", String(255), nullable=False),
    Column("contact_email", String(255), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("last_request_at", DateTime(timezone=True), nullable=True),
    Column("deactivated_at", DateTime(timezone=True), nullable=True),
    Column("push_disabled", Boolean, nullable=False, default=False, server_default=false()),
    Column("disabled_reason", String(255), nullable=True),
    Column("version", String(128), nullable=True),
    Column("merge_base", String(128), nullable=True),
    Column("api_feature_level", Integer, nullable=True),
    Column("last_realm_count_id", BigInteger, nullable=False, default=0, server_default="0"),
    Column("last_installation_count_id", BigInteger, nullable=False, default=0, server_default="0"),
    Column("last_realmauditlog_id", BigInteger, nullable=False, default=0, server_default="0"),
    Index("ix_zulip_servers_hostname", "hostname"),  # registration (zulip_0004)
    Index("ix_zulip_servers_deactivated_at", "deactivated_at"),  # gc (zulip_0004)
)

realms = Table(
    "zulip_realms",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column(
        "server_id", Integer, ForeignKey("zulip_servers.id", ondelete="CASCADE"), nullable=False
    ),
    Column("uuid", String(36), nullable=False, unique=True),
    Column("host", String(255), nullable=False, default="", server_default=""),
    Column("name", Text, nullable=False, default="", server_default=""),
    Column("org_type", Integer, nullable=True),
    Column("deactivated", Boolean, nullable=False, default=False, server_default=false()),
    Column("deactivated_at", DateTime(timezone=True), nullable=True),
    Column("is_system_bot_realm", Boolean, nullable=False, default=False, server_default=false()),
    Column("locally_deleted_at", DateTime(timezone=True), nullable=True),
    Column("push_disabled", Boolean, nullable=False, default=False, server_default=false()),
    Column("disabled_reason", String(255), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("last_request_at", DateTime(timezone=True), nullable=True),
    Index("ix_zulip_realms_server_id", "server_id"),
    Index("ix_zulip_realms_locally_deleted_at", "locally_deleted_at"),  # gc (zulip_0004)
    Index("ix_zulip_realms_deactivated_at", "deactivated_at"),  # gc (zulip_0004)
)

e2ee_devices = Table(
    "zulip_e2ee_devices",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("realm_id", Integer, ForeignKey("zulip_realms.id", ondelete="CASCADE"), nullable=False),
    Column("token_id", BigInteger, nullable=False),
    Column("token", Text, nullable=False),
    Column("token_kind", String(8), nullable=False),
    Column("ios_app_id", String(255), nullable=True),
    Column("token_hash", String(64), nullable=False),
    Column("token_key", String(64), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("expired_at", DateTime(timezone=True), nullable=True),
    Column("registered_at", DateTime(timezone=True), nullable=True),  # zulip_0003
    UniqueConstraint("realm_id", "token_id", name="uq_zulip_e2ee_devices_realm_token_id"),
    Index("ix_zulip_e2ee_devices_token_hash", "token_hash"),
    Index("ix_zulip_e2ee_devices_token_key", "token_key"),
    Index("ix_zulip_e2ee_devices_expired_at", "expired_at"),  # gc (zulip_0002)
)

legacy_devices = Table(
    "zulip_legacy_devices",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column(
        "server_id", Integer, ForeignKey("zulip_servers.id", ondelete="CASCADE"), nullable=False
    ),
    Column("realm_id", Integer, ForeignKey("zulip_realms.id", ondelete="SET NULL"), nullable=True),
    Column("user_id", BigInteger, nullable=True),
    Column("user_uuid", String(64), nullable=True),
    Column("kind", SmallInteger, nullable=False),
    Column("token", Text, nullable=False),
    Column("token_key", String(64), nullable=False),
    Column("token_hash", String(64), nullable=False),
    Column("ios_app_id", String(255), nullable=True),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("registered_at", DateTime(timezone=True), nullable=True),  # zulip_0003
    UniqueConstraint(
        "server_id", "user_id", "kind", "token_key", name="uq_zulip_legacy_devices_user_id"
    ),
    UniqueConstraint(
        "server_id", "user_uuid", "kind", "token_key", name="uq_zulip_legacy_devices_user_uuid"
    ),
    Index("ix_zulip_legacy_devices_token_key", "token_key"),
    Index("ix_zulip_legacy_devices_token_hash", "token_hash"),
    Index("ix_zulip_legacy_devices_realm_id", "realm_id"),  # gc, FK (zulip_0002)
)

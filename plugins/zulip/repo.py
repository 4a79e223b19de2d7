"""Repository: every database statement of the zulip plugin (SQLite and PostgreSQL).

Functions take an `AsyncConnection` so that a route can run several of them in one
transaction (`async with engine.begin() as conn`). Only SQLAlchemy Core constructs
that both dialects understand are used; uniqueness races are settled by the unique
constraints (an `IntegrityError` means another request won, which is fine for every
idempotent operation here).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeAlias, TypeVar

from sqlalchemy import (
    BigInteger,
    and_,
    bindparam,
    case,
    delete,
    literal,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.engine import Row
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from plugins.zulip.tables import e2ee_devices, legacy_devices, realms, servers

DbRow: TypeAlias = Row[*tuple[Any, ...]]
"""A result row of any width."""

__all__ = [
    "DbRow",
    "GcCounts",
    "RealmInfo",
    "hash_server_key",
    "now_utc",
    "token_key",
]

APNS_KIND = "apns"
FCM_KIND = "fcm"

IN_CHUNK = 500
"""Values per `IN (...)` list: one bound parameter each, far below the limits of SQLite
(32,766) and asyncpg (32,767), whatever the length of the list a request names."""

T = TypeVar("T")


def _chunks(items: Sequence[T], size: int = IN_CHUNK) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def now_utc() -> datetime:
    return datetime.now(UTC)


def hash_server_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def server_key_matches(row: DbRow, key: str) -> bool:
    return hmac.compare_digest(str(row.key_hash), hash_server_key(key))


def token_key(token: str, apns: bool) -> str:
    """Comparison key of a token: APNs hex tokens are case-insensitive."""
    return hashlib.sha256((token.lower() if apns else token).encode("utf-8")).hexdigest()


# --- servers ---------------------------------------------------------------------------


async def get_server(conn: AsyncConnection, uuid: str) -> DbRow | None:
    result = await conn.execute(select(servers).where(servers.c.uuid == uuid))
    return result.first()


async def hostname_in_use(conn: AsyncConnection, hostname: str, other_than: str) -> bool:
    result = await conn.execute(
        select(servers.c.id).where(
            servers.c.hostname == hostname,
            servers.c.uuid != other_than,
            servers.c.deactivated_at.is_(None),
        )
    )
    return result.first() is not None


async def create_server(
    conn: AsyncConnection, uuid: str, key: str, hostname: str, contact_email: str
) -> bool:
    """Insert a server; False when a concurrent request created it first."""
    try:
        async with conn.begin_nested():
            await conn.execute(
                servers.insert().values(
                    uuid=uuid,
                    key_hash=hash_server_key(key),
                    hostname=hostname,
                    contact_email=contact_email,
                    created_at=now_utc(),
                    push_disabled=False,
                    last_realm_count_id=0,
                    last_installation_count_id=0,
                    last_realmauditlog_id=0,
                )
            )
        return True
    except IntegrityError:
        return False


async def update_server(conn: AsyncConnection, server_id: int, **values: Any) -> None:
    if "key" in values:
        key = values.pop("key")
        if key is not None:
            values["key_hash"] = hash_server_key(key)
    if values:
        await conn.execute(update(servers).where(servers.c.id == server_id).values(**values))


async def set_server_disabled(
    conn: AsyncConnection, uuid: str, disabled: bool, reason: str | None
) -> bool:
    result = await conn.execute(
        update(servers)
        .where(servers.c.uuid == uuid)
        .values(push_disabled=disabled, disabled_reason=reason if disabled else None)
    )
    return bool(result.rowcount)


async def list_servers(conn: AsyncConnection) -> Sequence[DbRow]:
    result = await conn.execute(select(servers).order_by(servers.c.id))
    return result.all()


async def record_analytics_ids(
    conn: AsyncConnection, server: DbRow, ids: Mapping[str, int], meta: Mapping[str, Any]
) -> None:
    """Keep only the highest row ids seen per analytics table, plus version metadata.

    The comparison is made by the database against the stored value, not against
    `server` (the row read at login): two uploads of one server running at once both
    read the old ids, and the one with the lower ids could otherwise write last and
    lower them. The UPDATE locks the row (PostgreSQL re-evaluates the CASE on the
    newest version; SQLite serialises writers), so the highest id always wins.
    """
    values: dict[str, Any] = {}
    for column, seen in ids.items():
        if seen > 0:
            stored = servers.c[column]
            values[column] = case((stored < seen, literal(seen, BigInteger)), else_=stored)
    values.update({k: v for k, v in meta.items() if v is not None})
    await update_server(conn, server.id, **values)


# --- realms ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RealmInfo:
    """What `server/analytics` may store about a realm (no secrets, no stats)."""

    uuid: str
    host: str
    name: str
    org_type: int | None
    deactivated: bool
    is_system_bot_realm: bool


async def get_realm(conn: AsyncConnection, uuid: str) -> DbRow | None:
    result = await conn.execute(select(realms).where(realms.c.uuid == uuid))
    return result.first()


async def realms_of_other_servers(
    conn: AsyncConnection, server_id: int, uuids: Iterable[str]
) -> list[str]:
    found: list[str] = []
    for chunk in _chunks(sorted(set(uuids))):
        result = await conn.execute(
            select(realms.c.uuid).where(realms.c.uuid.in_(chunk), realms.c.server_id != server_id)
        )
        found.extend(r.uuid for r in result)
    return found


async def adopt_realms_of_deactivated_servers(
    conn: AsyncConnection, server_id: int, uuids: Iterable[str]
) -> None:
    """Give `server_id` the realms of `uuids` that a deactivated server holds.

    A Zulip server whose registration was deactivated (`server/deactivate`, `pushgw
    zulip deactivate`) can only register again under a new `zulip_org_id`, and uploads
    the same realm UUIDs: held by the old registration for good, each upload was
    "Duplicate registration detected.", which Zulip 8.0+ answers by switching push off.
    The realm moves with its E2EE registrations; its legacy ones stay with the old
    server (keyed by server) for `gc`. Realms of an active server are never moved.
    """
    deactivated = select(servers.c.id).where(servers.c.deactivated_at.is_not(None))
    for chunk in _chunks(sorted(set(uuids))):
        await conn.execute(
            update(realms)
            .where(realms.c.uuid.in_(chunk), realms.c.server_id.in_(deactivated))
            .values(server_id=server_id)
        )


async def upsert_realms(
    conn: AsyncConnection, server_id: int, infos: Sequence[RealmInfo], *, complete: bool
) -> dict[str, DbRow]:
    """Create or update the server's realms; with `complete`, mark missing ones deleted.

    Returns this server's realms by UUID: a realm of `infos` that is missing from it
    belongs to another server (claimed concurrently).

    A bounded number of statements whatever the number of realms: the new ones are
    inserted by one executemany, the changed ones updated by another (an upload
    that repeats what is stored, the usual case, writes nothing), the missing ones
    marked in chunks.
    """
    now = now_utc()
    existing = {
        r.uuid: r
        for r in (await conn.execute(select(realms).where(realms.c.server_id == server_id))).all()
    }
    new: list[dict[str, Any]] = []
    changed: list[dict[str, Any]] = []
    # In UUID order: two uploads claiming the same new realms in opposite orders would
    # each wait on the other's uncommitted insert (a deadlock PostgreSQL breaks with an
    # error, a 500) instead of one of them getting "Duplicate registration detected.".
    # The executemany below inserts in this order.
    for info in sorted(infos, key=lambda i: i.uuid):
        values: dict[str, Any] = {
            "host": info.host,
            "name": info.name,
            "org_type": info.org_type,
            "deactivated": info.deactivated,
            "is_system_bot_realm": info.is_system_bot_realm,
            "locally_deleted_at": None,
        }
        row = existing.get(info.uuid)
        if row is None:
            new.append(
                {
                    "server_id": server_id,
                    "uuid": info.uuid,
                    "created_at": now,
                    "push_disabled": False,
                    "deactivated_at": now if info.deactivated else None,
                    **values,
                }
            )
            continue
        values["deactivated_at"] = (row.deactivated_at or now) if info.deactivated else None
        if any(getattr(row, column) != value for column, value in values.items()):
            changed.append({"realm_id": row.id, **values})
    if new:
        try:
            async with conn.begin_nested():
                await conn.execute(realms.insert(), new)
        except IntegrityError:
            # Some were created concurrently: one at a time, to tell which.
            for values in new:
                await _insert_realm(conn, server_id, values)
    if changed:
        # The SET clause is the other keys of the parameter sets (all alike).
        await conn.execute(update(realms).where(realms.c.id == bindparam("realm_id")), changed)
    if complete:
        listed = {i.uuid for i in infos}
        missing = sorted(
            r.id for u, r in existing.items() if u not in listed and r.locally_deleted_at is None
        )
        for chunk in _chunks(missing):
            await conn.execute(
                update(realms).where(realms.c.id.in_(chunk)).values(locally_deleted_at=now)
            )
    result = await conn.execute(select(realms).where(realms.c.server_id == server_id))
    return {r.uuid: r for r in result.all()}


async def _insert_realm(conn: AsyncConnection, server_id: int, values: dict[str, Any]) -> None:
    try:
        async with conn.begin_nested():
            await conn.execute(realms.insert().values(**values))
    except IntegrityError:
        # Created concurrently, by this server (fine: update it) or by another one whose
        # transaction committed after the caller's "Duplicate registration" check. Then
        # nothing is updated, the realm is missing from the result, and the caller must
        # refuse the upload.
        kept = ("server_id", "uuid", "created_at", "push_disabled", "deactivated_at")
        await conn.execute(
            update(realms)
            .where(realms.c.uuid == values["uuid"], realms.c.server_id == server_id)
            .values({k: v for k, v in values.items() if k not in kept})
        )


async def touch_realm(conn: AsyncConnection, realm_id: int) -> None:
    await conn.execute(
        update(realms).where(realms.c.id == realm_id).values(last_request_at=now_utc())
    )


async def set_realm_disabled(
    conn: AsyncConnection, uuid: str, disabled: bool, reason: str | None
) -> bool:
    result = await conn.execute(
        update(realms)
        .where(realms.c.uuid == uuid)
        .values(push_disabled=disabled, disabled_reason=reason if disabled else None)
    )
    return bool(result.rowcount)


# --- E2EE devices ----------------------------------------------------------------------


async def register_e2ee(
    conn: AsyncConnection,
    *,
    realm_id: int,
    token_id: int,
    token: str,
    token_kind: str,
    ios_app_id: str | None,
    token_hash: str,
) -> bool:
    """Idempotent on (realm, token_id); reactivates an expired row. True when inserted."""
    key = token_key(token, token_kind == APNS_KIND)
    refresh = {
        "expired_at": None,
        "token_kind": token_kind,
        "ios_app_id": ios_app_id,
        "registered_at": now_utc(),
    }
    where = and_(e2ee_devices.c.realm_id == realm_id, e2ee_devices.c.token_id == token_id)
    found = (await conn.execute(select(e2ee_devices.c.id).where(where))).first()
    if found is None:
        try:
            async with conn.begin_nested():
                await conn.execute(
                    e2ee_devices.insert().values(
                        realm_id=realm_id,
                        token_id=token_id,
                        token=token,
                        token_hash=token_hash,
                        token_key=key,
                        created_at=now_utc(),
                        **refresh,
                    )
                )
            return True
        except IntegrityError:
            pass  # registered concurrently: refresh below
    await conn.execute(update(e2ee_devices).where(where).values(**refresh))
    return False


async def active_e2ee_devices(
    conn: AsyncConnection, realm_id: int, token_ids: Iterable[int]
) -> dict[int, DbRow]:
    out: dict[int, DbRow] = {}
    for chunk in _chunks(sorted(set(token_ids))):
        result = await conn.execute(
            select(e2ee_devices).where(
                e2ee_devices.c.realm_id == realm_id,
                e2ee_devices.c.token_id.in_(chunk),
                e2ee_devices.c.expired_at.is_(None),
            )
        )
        out.update({r.token_id: r for r in result.all()})
    return out


async def expire_e2ee_by_id(conn: AsyncConnection, device_id: int) -> None:
    await conn.execute(
        update(e2ee_devices)
        .where(e2ee_devices.c.id == device_id, e2ee_devices.c.expired_at.is_(None))
        .values(expired_at=now_utc())
    )


def _registered_before(table: Any, before: datetime | None) -> Any:
    """Rows registered before `before` (all when None; NULL: made before zulip_0003)."""
    if before is None:
        return true()
    return or_(table.c.registered_at.is_(None), table.c.registered_at < before)


async def expire_e2ee_by_token(
    conn: AsyncConnection,
    token: str,
    apns: bool,
    ios_app_id: str | None = None,
    before: datetime | None = None,
) -> int:
    """Expire the registrations of a token (every realm; only those of `ios_app_id` if given;
    only those registered before `before` if given)."""
    kind = APNS_KIND if apns else FCM_KIND
    clauses = [
        e2ee_devices.c.token_key == token_key(token, apns),
        e2ee_devices.c.token_kind == kind,
        e2ee_devices.c.expired_at.is_(None),
        _registered_before(e2ee_devices, before),
    ]
    if ios_app_id is not None:
        clauses.append(e2ee_devices.c.ios_app_id == ios_app_id)
    result = await conn.execute(update(e2ee_devices).where(*clauses).values(expired_at=now_utc()))
    return int(result.rowcount or 0)


async def e2ee_by_token_hash(conn: AsyncConnection, token_hash: str) -> Sequence[DbRow]:
    """Rows of the hash, expired ones too (`expired_at` says which: kept until gc)."""
    result = await conn.execute(
        select(
            e2ee_devices.c.token,
            e2ee_devices.c.token_kind,
            e2ee_devices.c.ios_app_id,
            e2ee_devices.c.expired_at,
        ).where(e2ee_devices.c.token_hash == token_hash)
    )
    return result.all()


# --- legacy devices --------------------------------------------------------------------


def _user_clause(user_id: int | None, user_uuid: str | None) -> Any:
    clauses = []
    if user_id is not None:
        clauses.append(legacy_devices.c.user_id == user_id)
    if user_uuid is not None:
        clauses.append(legacy_devices.c.user_uuid == user_uuid)
    return or_(*clauses)


async def legacy_register(
    conn: AsyncConnection,
    *,
    server_id: int,
    user_id: int | None,
    user_uuid: str | None,
    realm_id: int | None,
    kind: int,
    token: str,
    token_hash: str,
    ios_app_id: str | None,
    apns: bool,
) -> bool:
    """Insert, or mark an existing row registered now (`registered_at`); with both ids,
    the `user_id` row for this token is replaced. True when inserted."""
    key = token_key(token, apns)
    if user_id is not None and user_uuid is not None:
        await conn.execute(
            delete(legacy_devices).where(
                legacy_devices.c.server_id == server_id,
                legacy_devices.c.user_id == user_id,
                legacy_devices.c.user_uuid.is_(None),
                legacy_devices.c.kind == kind,
                legacy_devices.c.token_key == key,
            )
        )
        user_id = None  # register by user_uuid only (zulip/zulip#24969)
    ident = (
        legacy_devices.c.user_uuid == user_uuid
        if user_uuid is not None
        else legacy_devices.c.user_id == user_id
    )
    where = and_(
        legacy_devices.c.server_id == server_id,
        ident,
        legacy_devices.c.kind == kind,
        legacy_devices.c.token_key == key,
    )
    now = now_utc()
    found = (await conn.execute(select(legacy_devices.c.id).where(where))).first()
    if found is None:
        try:
            async with conn.begin_nested():
                await conn.execute(
                    legacy_devices.insert().values(
                        server_id=server_id,
                        realm_id=realm_id,
                        user_id=user_id,
                        user_uuid=user_uuid,
                        kind=kind,
                        token=token,
                        token_key=key,
                        token_hash=token_hash,
                        ios_app_id=ios_app_id,
                        created_at=now,
                        registered_at=now,
                    )
                )
            return True
        except IntegrityError:
            pass  # registered concurrently: mark it registered now, below
    # Registered again: a token-invalid answer to a push sent before now must not end it.
    await conn.execute(update(legacy_devices).where(where).values(registered_at=now))
    return False


async def legacy_unregister(
    conn: AsyncConnection,
    *,
    server_id: int,
    user_id: int | None,
    user_uuid: str | None,
    kind: int,
    token: str,
    apns: bool,
) -> int:
    result = await conn.execute(
        delete(legacy_devices).where(
            legacy_devices.c.server_id == server_id,
            _user_clause(user_id, user_uuid),
            legacy_devices.c.kind == kind,
            legacy_devices.c.token_key == token_key(token, apns),
        )
    )
    return int(result.rowcount or 0)


async def legacy_unregister_all(
    conn: AsyncConnection, *, server_id: int, user_id: int | None, user_uuid: str | None
) -> int:
    result = await conn.execute(
        delete(legacy_devices).where(
            legacy_devices.c.server_id == server_id, _user_clause(user_id, user_uuid)
        )
    )
    return int(result.rowcount or 0)


async def legacy_user_devices(
    conn: AsyncConnection, *, server_id: int, user_id: int | None, user_uuid: str | None
) -> Sequence[DbRow]:
    result = await conn.execute(
        select(legacy_devices)
        .where(legacy_devices.c.server_id == server_id, _user_clause(user_id, user_uuid))
        .order_by(legacy_devices.c.id)
    )
    return result.all()


async def delete_legacy_ids(conn: AsyncConnection, ids: Iterable[int]) -> None:
    wanted = list(ids)
    if wanted:
        await conn.execute(delete(legacy_devices).where(legacy_devices.c.id.in_(wanted)))


async def attach_legacy_realm(conn: AsyncConnection, ids: Iterable[int], realm_id: int) -> None:
    """Give the registrations `ids` that have no realm yet the realm `realm_id`."""
    wanted = list(ids)
    if wanted:
        await conn.execute(
            update(legacy_devices)
            .where(legacy_devices.c.id.in_(wanted), legacy_devices.c.realm_id.is_(None))
            .values(realm_id=realm_id)
        )


async def delete_legacy_token(
    conn: AsyncConnection,
    *,
    kind: int,
    token: str,
    apns: bool,
    server_id: int | None = None,
    ios_app_id: str | None = None,
    before: datetime | None = None,
) -> int:
    """Delete registrations of a token (every server unless `server_id`; every app unless
    `ios_app_id`; only those registered before `before` if given)."""
    clauses = [
        legacy_devices.c.kind == kind,
        legacy_devices.c.token_key == token_key(token, apns),
        _registered_before(legacy_devices, before),
    ]
    if server_id is not None:
        clauses.append(legacy_devices.c.server_id == server_id)
    if ios_app_id is not None:
        clauses.append(legacy_devices.c.ios_app_id == ios_app_id)
    result = await conn.execute(delete(legacy_devices).where(*clauses))
    return int(result.rowcount or 0)


async def rehash_tokens(conn: AsyncConnection, token_hash: Callable[[str], str]) -> int:
    """Remake every registration's `token_hash` with `token_hash` (the current
    `receipts.hmac_key`); the number of rows whose stored hash changed."""
    changed = 0
    for table in (e2ee_devices, legacy_devices):
        last = 0
        while True:
            rows = (
                await conn.execute(
                    select(table.c.id, table.c.token, table.c.token_hash)
                    .where(table.c.id > last)
                    .order_by(table.c.id)
                    .limit(IN_CHUNK)
                )
            ).all()
            if not rows:
                break
            last = rows[-1].id
            stale = [
                {"row_id": row.id, "new_hash": new}
                for row in rows
                if (new := token_hash(row.token)) != row.token_hash
            ]
            if stale:
                await conn.execute(
                    update(table)
                    .where(table.c.id == bindparam("row_id"))
                    .values(token_hash=bindparam("new_hash")),
                    stale,
                )
                changed += len(stale)
    return changed


async def forget_e2ee_device(conn: AsyncConnection, realm_id: int, token_id: int) -> int:
    """Delete one E2EE registration outright, expired or not (an erasure request)."""
    return await _delete(
        conn,
        e2ee_devices,
        and_(e2ee_devices.c.realm_id == realm_id, e2ee_devices.c.token_id == token_id),
    )


async def forget_token_hash(conn: AsyncConnection, token_hash: str) -> tuple[int, int]:
    """Delete every registration, E2EE (expired too) and legacy, whose stored keyed hash
    is `token_hash`: (E2EE rows, legacy rows) deleted."""
    e2ee = await _delete(conn, e2ee_devices, e2ee_devices.c.token_hash == token_hash)
    legacy = await _delete(conn, legacy_devices, legacy_devices.c.token_hash == token_hash)
    return e2ee, legacy


@dataclass(frozen=True)
class ServerErasure:
    """What `forget_server` deleted besides the server's own row."""

    realms: int
    e2ee: int
    legacy: int


async def forget_server(conn: AsyncConnection, server_id: int) -> ServerErasure:
    """Delete a server outright (an erasure request): its row (key hash, hostname, contact
    address, versions, analytics ids), its realms, their E2EE registrations, its legacy
    ones, and the legacy ones of a predecessor registration tied to its realms (taken
    over from a deactivated server). Explicit deletes, child rows first: SQLite does not
    enforce the foreign keys, and PostgreSQL's SET NULL would untie a predecessor's rows
    from the realms before they are found."""
    # Lock the row first (PostgreSQL; SQLite serialises writers anyway) so that a
    # concurrent upload waits and then finds the server gone, instead of adding a realm.
    await conn.execute(select(servers.c.id).where(servers.c.id == server_id).with_for_update())
    its_realms = select(realms.c.id).where(realms.c.server_id == server_id)
    e2ee = await _delete(conn, e2ee_devices, e2ee_devices.c.realm_id.in_(its_realms))
    legacy = await _delete(
        conn,
        legacy_devices,
        or_(legacy_devices.c.server_id == server_id, legacy_devices.c.realm_id.in_(its_realms)),
    )
    realm_count = await _delete(conn, realms, realms.c.server_id == server_id)
    await _delete(conn, servers, servers.c.id == server_id)
    return ServerErasure(realm_count, e2ee, legacy)


async def legacy_by_token_hash(conn: AsyncConnection, token_hash: str) -> Sequence[DbRow]:
    result = await conn.execute(
        select(legacy_devices.c.token, legacy_devices.c.kind, legacy_devices.c.ios_app_id).where(
            legacy_devices.c.token_hash == token_hash
        )
    )
    return result.all()


# --- garbage collection ----------------------------------------------------------------


@dataclass(frozen=True)
class GcCounts:
    e2ee_expired: int = 0
    e2ee_of_gone_realms: int = 0
    legacy_of_gone_realms: int = 0
    e2ee_of_deactivated_servers: int = 0
    legacy_of_deactivated_servers: int = 0

    @property
    def total(self) -> int:
        return (
            self.e2ee_expired
            + self.e2ee_of_gone_realms
            + self.legacy_of_gone_realms
            + self.e2ee_of_deactivated_servers
            + self.legacy_of_deactivated_servers
        )


async def _delete(conn: AsyncConnection, table: Any, where: Any) -> int:
    deleted = await conn.execute(delete(table).where(where))
    return int(deleted.rowcount or 0)


async def collect_garbage(conn: AsyncConnection, cutoff: datetime) -> GcCounts:
    """Delete registrations past retention; idempotent and safe under traffic.

    For a dry run, call it inside a transaction and roll back: the counts are then
    exactly what a real run would delete.
    """
    gone_realms = select(realms.c.id).where(
        or_(
            realms.c.locally_deleted_at < cutoff,
            and_(realms.c.deactivated.is_(True), realms.c.deactivated_at < cutoff),
        )
    )
    dead_servers = select(servers.c.id).where(servers.c.deactivated_at < cutoff)
    realms_of_dead = select(realms.c.id).where(realms.c.server_id.in_(dead_servers))
    e2ee_expired = await _delete(
        conn,
        e2ee_devices,
        and_(e2ee_devices.c.expired_at.is_not(None), e2ee_devices.c.expired_at < cutoff),
    )
    e2ee_gone = await _delete(conn, e2ee_devices, e2ee_devices.c.realm_id.in_(gone_realms))
    legacy_gone = await _delete(conn, legacy_devices, legacy_devices.c.realm_id.in_(gone_realms))
    e2ee_dead = await _delete(conn, e2ee_devices, e2ee_devices.c.realm_id.in_(realms_of_dead))
    legacy_dead = await _delete(conn, legacy_devices, legacy_devices.c.server_id.in_(dead_servers))
    # A deactivated server's row stays (its calls keep failing as deactivated), but its
    # administrator's address is personal data nothing needs any more. Not counted: the
    # counts are of registrations.
    await conn.execute(
        update(servers)
        .where(servers.c.deactivated_at < cutoff, servers.c.contact_email != "")
        .values(contact_email="")
    )
    return GcCounts(e2ee_expired, e2ee_gone, legacy_gone, e2ee_dead, legacy_dead)

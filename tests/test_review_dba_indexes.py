"""DBA review: the zulip plugin's statements on large tables use an index, on PostgreSQL
(EXPLAIN (FORMAT JSON) of the exact SQL SQLAlchemy sends, captured while the repository
and the gc run) and on SQLite (EXPLAIN QUERY PLAN); the unique constraints behind the
idempotent registrations exist on both; the revision that adds indexes goes up and down.

Tables are filled as a large bouncer's are (a few thousand servers, tens of thousands of
realms, 200k registrations of each kind), then ANALYZEd. Sequential scans are made the
planner's last resort, so one shows only where no index fits; a whole index read
without an index condition (what the planner falls back to then) counts as a scan too.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from alembic import command
from sqlalchemy import event, func, inspect, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.core.store import Store, alembic_config, sqlite_migration_lock
from plugins.zulip import gc, repo
from plugins.zulip.plugin import pushgw_migrations
from plugins.zulip.tables import e2ee_devices, legacy_devices, realms, servers

ZULIP = pushgw_migrations()
TABLES = (
    "zulip_servers",
    "zulip_realms",
    "zulip_e2ee_devices",
    "zulip_legacy_devices",
    "pushgw_invalid_tokens",
)
SERVERS, REALMS_PER_SERVER, DEVICES = 5_000, 10, 200_000


async def _populate(conn: AsyncConnection) -> None:
    """Realistic shapes: half the legacy rows belong to one big server; a few servers were
    deactivated, a few realms deleted or deactivated, long ago; 2% of E2EE rows expired."""
    statements = [
        "INSERT INTO zulip_servers (uuid, key_hash, hostname, contact_email, created_at,"
        " deactivated_at) SELECT gen_random_uuid()::text, md5(g::text),"
        " 'chat' || g || '.example.org', 'admin@example.org', now(),"
        " CASE WHEN g % 200 = 0 THEN now() - interval '100 days' END"
        " FROM generate_series(1, :servers) g",
        "INSERT INTO zulip_realms (server_id, uuid, created_at, locally_deleted_at,"
        " deactivated, deactivated_at) SELECT s.id, gen_random_uuid()::text, now(),"
        " CASE WHEN r = 10 AND s.id % 97 = 0 THEN now() - interval '100 days' END,"
        " r = 9 AND s.id % 89 = 0,"
        " CASE WHEN r = 9 AND s.id % 89 = 0 THEN now() - interval '100 days' END"
        " FROM zulip_servers s, generate_series(1, :per_server) r",
        "INSERT INTO zulip_e2ee_devices (realm_id, token_id, token, token_kind, token_hash,"
        " token_key, created_at, expired_at, registered_at)"
        " SELECT g % :realms + 1, g, md5(g::text),"
        " CASE WHEN g % 2 = 0 THEN 'fcm' ELSE 'apns' END, md5('h' || g) || md5('H' || g),"
        " md5('k' || g) || md5('K' || g), now(),"
        " CASE WHEN g % 50 = 0 THEN now() - interval '100 days' END, now()"
        " FROM generate_series(1, :devices) g",
        "INSERT INTO zulip_legacy_devices (server_id, realm_id, user_id, user_uuid, kind,"
        " token, token_key, token_hash, created_at, registered_at)"
        " SELECT CASE WHEN g % 2 = 0 THEN 1 ELSE g % :servers + 1 END,"
        " CASE WHEN g % 3 > 0 THEN g % :realms + 1 END, g,"
        " CASE WHEN g % 2 = 0 THEN md5('u' || g) END, 1 + g % 2, md5(g::text),"
        " md5('lk' || g) || md5('LK' || g), md5('lh' || g) || md5('LH' || g), now(), now()"
        " FROM generate_series(1, :devices) g",
    ]
    params = {
        "servers": SERVERS,
        "per_server": REALMS_PER_SERVER,
        "realms": SERVERS * REALMS_PER_SERVER,
        "devices": DEVICES,
    }
    for statement in statements:
        await conn.execute(
            text(statement), {k: v for k, v in params.items() if f":{k}" in statement}
        )


async def _paths(conn: AsyncConnection) -> None:
    """Server registration's lookups, the registrations' upserts and lookups by user and
    by token, the token-invalid hook's lookups by hash, expiry, and the gc's sweeps."""
    server = (await conn.execute(select(servers).where(servers.c.id == 5))).one()
    realm = (await conn.execute(select(realms).where(realms.c.server_id == server.id))).first()
    assert realm is not None
    # `remotes/server/register` of a new server, `pushgw zulip add-server`
    await repo.get_server(conn, server.uuid)
    await repo.hostname_in_use(conn, "chat77.example.org", "6cde5f7a-0000-4978-9716-49f69ebfc9fe")
    # `remotes/server/analytics`
    await repo.realms_of_other_servers(conn, server.id, [realm.uuid])
    await repo.upsert_realms(conn, server.id, [], complete=True)
    await repo.record_analytics_ids(conn, server, {"last_realm_count_id": 5}, {})
    await repo.get_realm(conn, realm.uuid)
    await repo.register_e2ee(
        conn,
        realm_id=realm.id,
        token_id=3,
        token="t",
        token_kind="fcm",
        ios_app_id=None,
        token_hash="x" * 64,
    )
    await repo.active_e2ee_devices(conn, realm.id, [1, 2, 3])
    for server_id in (1, server.id):  # the big server and a small one
        for user_id, user_uuid in ((55, None), (56, "u"), (None, "u")):
            await repo.legacy_register(
                conn,
                server_id=server_id,
                user_id=user_id,
                user_uuid=user_uuid,
                realm_id=None,
                kind=2,
                token="t",
                token_hash="x" * 64,
                ios_app_id=None,
                apns=False,
            )
            await repo.legacy_user_devices(
                conn, server_id=server_id, user_id=user_id, user_uuid=user_uuid
            )
            await repo.legacy_unregister(
                conn,
                server_id=server_id,
                user_id=user_id,
                user_uuid=user_uuid,
                kind=2,
                token="t",
                apns=False,
            )
            await repo.legacy_unregister_all(
                conn, server_id=server_id, user_id=user_id, user_uuid=user_uuid
            )
    await repo.attach_legacy_realm(conn, [1, 2], realm.id)
    # the token-invalid hook (`pushgw tokens retire`: by hash; a provider's answer: by token)
    await repo.e2ee_by_token_hash(conn, "ab" * 32)
    await repo.legacy_by_token_hash(conn, "ab" * 32)
    await repo.expire_e2ee_by_token(conn, "tok", True, "org.example.zulip", repo.now_utc())
    await repo.delete_legacy_token(conn, kind=1, token="tok", apns=True, before=repo.now_utc())
    await repo.delete_legacy_token(conn, kind=2, token="t", apns=False, server_id=server.id)
    await repo.expire_e2ee_by_id(conn, 9)
    await repo.collect_garbage(conn, repo.now_utc() - timedelta(days=30))
    # a realm's registrations counted (`pushgw zulip servers`), and the foreign keys' own
    # lookups when a realm goes (CASCADE / SET NULL)
    for table in (e2ee_devices, legacy_devices):
        await conn.execute(
            select(func.count()).select_from(table).where(table.c.realm_id == realm.id)
        )
    await conn.execute(text("DELETE FROM zulip_realms WHERE id = :id"), {"id": realm.id})


def _capture(store: Store, into: list[tuple[str, Any]]) -> Any:
    def capture(_c: Any, _cur: Any, statement: str, params: Any, _ctx: Any, many: bool) -> None:
        if statement.lstrip().split(None, 1)[0].upper() in ("SELECT", "UPDATE", "DELETE"):
            into.append((statement, params[0] if many and params else params))

    event.listen(store.engine.sync_engine, "before_cursor_execute", capture)
    return capture


async def _statements(store: Store) -> list[tuple[str, Any]]:
    """Every SELECT / UPDATE / DELETE `_paths` sends (rolled back)."""
    captured: list[tuple[str, Any]] = []
    capture = _capture(store, captured)
    try:
        async with store.engine.connect() as conn:
            transaction = await conn.begin()
            await _paths(conn)
            await transaction.rollback()
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", capture)
    assert any("zulip_servers.hostname" in s for s, _ in captured)
    assert any("zulip_realms.locally_deleted_at" in s for s, _ in captured)
    return captured


def _full_reads(node: dict[str, Any]) -> Iterator[str]:
    """The large tables a plan reads whole: a Seq Scan, or an index read without a condition."""
    table = node.get("Relation Name")
    if table in TABLES:
        kind = node["Node Type"]
        if kind == "Seq Scan" or (
            kind in ("Index Scan", "Index Only Scan") and "Index Cond" not in node
        ):
            yield f"{kind} on {table}"
    for child in node.get("Plans", []):
        yield from _full_reads(child)


async def test_lookups_and_sweeps_use_indexes_on_postgresql(postgres_url: str) -> None:
    """`hostname_in_use` (every new server's registration) read all of zulip_servers, and
    the gc found gone realms and deactivated servers by reading all of zulip_realms and
    zulip_servers: none of `hostname`, `locally_deleted_at`, `deactivated_at` had an index."""
    s = Store(postgres_url)
    try:
        await s.upgrade([ZULIP])
        async with s.engine.begin() as conn:
            await _populate(conn)
        async with s.engine.connect() as conn:
            await conn.execute(text("COMMIT"))  # ANALYZE outside the implicit transaction
            await conn.execute(text("ANALYZE"))
        statements = await _statements(s)
        found = []
        async with s.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            assert raw is not None
            await raw.execute("SET enable_seqscan = off")
            for statement, params in statements:
                rows = await raw.fetch("EXPLAIN (FORMAT JSON) " + statement, *params)
                value = rows[0][0]  # SQLAlchemy's asyncpg connections decode json
                plan = (json.loads(value) if isinstance(value, str) else value)[0]["Plan"]
                found += [f"{' '.join(statement.split())[:160]}: {r}" for r in _full_reads(plan)]
        assert found == [], "\n".join(found)
    finally:
        await s.close()


async def test_lookups_and_sweeps_use_indexes_on_sqlite(tmp_path: Path) -> None:
    """The same statements on SQLite: no `SCAN` of a zulip table."""
    s = Store(f"sqlite+aiosqlite:///{tmp_path / 'plan.db'}")
    try:
        await s.upgrade([ZULIP])
        async with s.engine.begin() as conn:
            await conn.execute(
                servers.insert().values(
                    id=5,
                    uuid="6cde5f7a-1f7e-4978-9716-49f69ebfc9fe",
                    key_hash="0" * 64,
                    hostname="chat5.example.org",
                    contact_email="admin@example.org",
                    created_at=repo.now_utc(),
                )
            )
            await conn.execute(
                realms.insert().values(
                    server_id=5,
                    uuid="0b8e9a3c-0000-4000-8000-000000000001",
                    created_at=repo.now_utc(),
                )
            )
        statements = await _statements(s)
        found = []
        async with s.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            assert raw is not None
            for statement, params in statements:
                cursor = await raw.execute("EXPLAIN QUERY PLAN " + statement, params)
                details = [str(row[-1]) for row in await cursor.fetchall()]
                found += [
                    f"{' '.join(statement.split())[:160]}: {d}"
                    for d in details
                    if any(d.startswith(f"SCAN {table}") for table in TABLES)
                ]
        assert found == [], "\n".join(found)
    finally:
        await s.close()


async def test_gc_still_collects_through_the_new_indexes(store: Store) -> None:
    """What the sweeps find is unchanged: gone realms' and dead servers' registrations go,
    a live realm's stay (both backends)."""
    await store.upgrade([ZULIP])
    now = repo.now_utc()
    old = now - timedelta(days=100)
    async with store.engine.begin() as conn:
        ids = []
        for n, deactivated_at in enumerate((None, old), 1):
            await repo.create_server(
                conn,
                f"00000000-0000-4000-8000-00000000000{n}",
                "k" * 64,
                f"chat{n}.example.org",
                "admin@example.org",
            )
            server = await repo.get_server(conn, f"00000000-0000-4000-8000-00000000000{n}")
            assert server is not None
            await repo.update_server(conn, server.id, deactivated_at=deactivated_at)
            ids.append(server.id)
        infos = [
            repo.RealmInfo(f"10000000-0000-4000-8000-00000000000{n}", "h", "n", None, n == 2, False)
            for n in (1, 2, 3)
        ]
        by_uuid = await repo.upsert_realms(conn, ids[0], infos, complete=True)
        await conn.execute(
            realms.update().where(realms.c.uuid == infos[1].uuid).values(deactivated_at=old)
        )
        await conn.execute(
            realms.update().where(realms.c.uuid == infos[2].uuid).values(locally_deleted_at=old)
        )
        dead_realm = (
            await repo.upsert_realms(
                conn,
                ids[1],
                [
                    repo.RealmInfo(
                        "20000000-0000-4000-8000-000000000001", "h", "n", None, False, False
                    )
                ],
                complete=False,
            )
        )["20000000-0000-4000-8000-000000000001"]
        for token_id, realm_id in enumerate(
            [by_uuid[i.uuid].id for i in infos] + [dead_realm.id], 1
        ):
            await repo.register_e2ee(
                conn,
                realm_id=realm_id,
                token_id=token_id,
                token=f"tok{token_id}",
                token_kind="fcm",
                ios_app_id=None,
                token_hash=f"{token_id:064x}",
            )
        for user_id, server_id in ((1, ids[0]), (2, ids[1])):
            await repo.legacy_register(
                conn,
                server_id=server_id,
                user_id=user_id,
                user_uuid=None,
                realm_id=None,
                kind=2,
                token=f"legacy{user_id}",
                token_hash=f"{user_id + 100:064x}",
                ios_app_id=None,
                apns=False,
            )
    counts = await gc.collect(store.engine, timedelta(days=30).total_seconds())
    assert counts == repo.GcCounts(
        e2ee_expired=0,
        e2ee_of_gone_realms=2,
        legacy_of_gone_realms=0,
        e2ee_of_deactivated_servers=1,
        legacy_of_deactivated_servers=1,
    )
    async with store.engine.connect() as conn:
        live = await repo.active_e2ee_devices(conn, by_uuid[infos[0].uuid].id, [1, 2, 3])
        assert list(live) == [1]
        assert await repo.legacy_by_token_hash(conn, f"{101:064x}")


def _alembic(url: str, action: str, target: str) -> None:
    cfg = alembic_config(url, [ZULIP])
    with sqlite_migration_lock(url):
        getattr(command, action)(cfg, target)


def _indexes_and_uniques(conn: Any) -> tuple[set[tuple[str, tuple[str, ...]]], set[Any]]:
    insp = inspect(conn)
    indexes = {
        (table, tuple(ix["column_names"])) for table in TABLES for ix in insp.get_indexes(table)
    }
    uniques: set[Any] = set()
    for table in TABLES:
        uniques |= {(table, tuple(u["column_names"])) for u in insp.get_unique_constraints(table)}
        # SQLite reflects a column's UNIQUE as an unnamed constraint or a unique index
        uniques |= {
            (table, tuple(ix["column_names"])) for ix in insp.get_indexes(table) if ix["unique"]
        }
    pk = insp.get_pk_constraint("pushgw_invalid_tokens")["constrained_columns"]
    uniques.add(("pushgw_invalid_tokens", tuple(pk)))
    return indexes, uniques


NEW_INDEXES = {
    ("zulip_servers", ("hostname",)),
    ("zulip_servers", ("deactivated_at",)),
    ("zulip_realms", ("locally_deleted_at",)),
    ("zulip_realms", ("deactivated_at",)),
}


async def test_index_revision_up_and_down_and_idempotency_constraints(store: Store) -> None:
    """The indexes come with the revision after zulip_0003 and go with its downgrade; the
    unique constraints that settle concurrent registrations exist on both backends."""

    await asyncio.to_thread(_alembic, store.url, "upgrade", "zulip@zulip_0003")
    async with store.engine.connect() as conn:
        indexes, _ = await conn.run_sync(_indexes_and_uniques)
    assert not NEW_INDEXES & indexes
    await store.engine.dispose()
    await store.upgrade([ZULIP])
    async with store.engine.connect() as conn:
        indexes, uniques = await conn.run_sync(_indexes_and_uniques)
    assert indexes >= NEW_INDEXES
    assert {
        ("zulip_servers", ("uuid",)),
        ("zulip_realms", ("uuid",)),
        ("zulip_e2ee_devices", ("realm_id", "token_id")),
        ("zulip_legacy_devices", ("server_id", "user_id", "kind", "token_key")),
        ("zulip_legacy_devices", ("server_id", "user_uuid", "kind", "token_key")),
        ("pushgw_invalid_tokens", ("plugin", "app_id", "token_hash")),
    } <= uniques
    await store.engine.dispose()
    await asyncio.to_thread(_alembic, store.url, "downgrade", "zulip@zulip_0003")
    async with store.engine.connect() as conn:
        indexes, _ = await conn.run_sync(_indexes_and_uniques)
    assert not NEW_INDEXES & indexes

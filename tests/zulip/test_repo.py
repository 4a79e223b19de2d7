"""Migrations and repository functions on SQLite and PostgreSQL (`store_url`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from sqlalchemy import func, inspect, select, update
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.api import Store
from plugins.zulip import repo
from plugins.zulip.gc import collect
from plugins.zulip.plugin import pushgw_migrations
from plugins.zulip.tables import e2ee_devices, legacy_devices, metadata, realms, servers
from tests.zulip.conftest import random_key

SERVER = "6cde5f7a-1f7e-4978-9716-49f69ebfc9fe"
OTHER = "0b7d9d1a-8e0a-4a57-8b8f-5f3c7f0f1a11"
REALM = "8a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"


@pytest.fixture
async def engine(store_url: str) -> AsyncIterator[AsyncEngine]:
    store = Store(store_url)
    await store.upgrade([pushgw_migrations()])
    try:
        yield store.engine
    finally:
        await store.close()


async def test_migration_matches_tables(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        names = await conn.run_sync(lambda c: set(inspect(c).get_table_names()))
        for table in metadata.sorted_tables:
            assert table.name in names
            columns = await conn.run_sync(
                lambda c, t=table: {x["name"] for x in inspect(c).get_columns(t.name)}
            )
            assert columns == {c.name for c in table.columns}, table.name


async def _server(engine: AsyncEngine, uuid: str = SERVER, hostname: str = "a.example.org") -> int:
    async with engine.begin() as conn:
        assert await repo.create_server(conn, uuid, random_key(), hostname, "x@example.org")
        assert not await repo.create_server(conn, uuid, random_key(), hostname, "x@example.org")
        row = await repo.get_server(conn, uuid)
    assert row is not None
    return int(row.id)


async def test_servers_and_realms(engine: AsyncEngine) -> None:
    sid = await _server(engine)
    other = await _server(engine, OTHER, "b.example.org")
    info = repo.RealmInfo(REALM, "h", "n", 0, False, False)
    async with engine.begin() as conn:
        assert await repo.hostname_in_use(conn, "a.example.org", OTHER)
        assert not await repo.hostname_in_use(conn, "a.example.org", SERVER)
        rows = await repo.upsert_realms(conn, sid, [info], complete=True)
        assert rows[REALM].server_id == sid
        assert await repo.realms_of_other_servers(conn, other, [REALM]) == [REALM]
        rows = await repo.upsert_realms(conn, sid, [], complete=True)
        assert rows[REALM].locally_deleted_at is not None
        rows = await repo.upsert_realms(conn, sid, [info], complete=False)
        assert rows[REALM].locally_deleted_at is None
        server = await repo.get_server(conn, SERVER)
        await repo.record_analytics_ids(conn, server, {"last_realm_count_id": 7}, {"version": "1"})
        server = await repo.get_server(conn, SERVER)
        await repo.record_analytics_ids(conn, server, {"last_realm_count_id": 3}, {})
        server = await repo.get_server(conn, SERVER)
    assert server.last_realm_count_id == 7 and server.version == "1"


async def test_e2ee_idempotent_and_expiry(engine: AsyncEngine) -> None:
    sid = await _server(engine)
    async with engine.begin() as conn:
        rows = await repo.upsert_realms(
            conn, sid, [repo.RealmInfo(REALM, "h", "n", 0, False, False)], complete=False
        )
        realm_id = rows[REALM].id
        args = dict(
            realm_id=realm_id,
            token_id=-359574906294109112,
            token="c0ffee",
            token_kind="apns",
            ios_app_id="a.b",
            token_hash="h" * 64,
        )
        assert await repo.register_e2ee(conn, **args)
        assert not await repo.register_e2ee(conn, **args)
        assert await repo.expire_e2ee_by_token(conn, "C0FFEE", True) == 1
        assert await repo.active_e2ee_devices(conn, realm_id, [-359574906294109112]) == {}
        assert not await repo.register_e2ee(conn, **args)  # reactivates
        active = await repo.active_e2ee_devices(conn, realm_id, [-359574906294109112, 1])
        assert list(active) == [-359574906294109112]
        count = (await conn.execute(select(func.count()).select_from(e2ee_devices))).scalar_one()
    assert count == 1


async def test_legacy_register_unregister(engine: AsyncEngine) -> None:
    sid = await _server(engine)
    base = dict(
        server_id=sid, realm_id=None, kind=1, token_hash="h" * 64, ios_app_id="a", apns=True
    )
    async with engine.begin() as conn:
        assert await repo.legacy_register(conn, user_id=5, user_uuid=None, token="ABCD", **base)
        assert not await repo.legacy_register(conn, user_id=5, user_uuid=None, token="abcd", **base)
        # both ids: the user_id row is replaced by a user_uuid row
        assert await repo.legacy_register(conn, user_id=5, user_uuid="u", token="abcd", **base)
        rows = await repo.legacy_user_devices(conn, server_id=sid, user_id=5, user_uuid="u")
        assert [(r.user_id, r.user_uuid) for r in rows] == [(None, "u")]
        assert (
            await repo.legacy_unregister(
                conn, server_id=sid, user_id=5, user_uuid="u", kind=1, token="ABCD", apns=True
            )
            == 1
        )
        assert (
            await repo.legacy_unregister(
                conn, server_id=sid, user_id=5, user_uuid="u", kind=1, token="ABCD", apns=True
            )
            == 0
        )
        await repo.legacy_register(conn, user_id=6, user_uuid=None, token="ff", **base)
        assert await repo.delete_legacy_token(conn, kind=1, token="FF", apns=True) == 1


async def test_gc(engine: AsyncEngine) -> None:
    sid = await _server(engine)
    old = repo.now_utc() - timedelta(days=40)
    async with engine.begin() as conn:
        rows = await repo.upsert_realms(
            conn, sid, [repo.RealmInfo(REALM, "h", "n", 0, False, False)], complete=False
        )
        realm_id = rows[REALM].id
        for i, expired in enumerate([None, old, repo.now_utc()]):
            await repo.register_e2ee(
                conn,
                realm_id=realm_id,
                token_id=i,
                token=f"t{i}",
                token_kind="fcm",
                ios_app_id=None,
                token_hash="h" * 64,
            )
            await conn.execute(
                update(e2ee_devices).where(e2ee_devices.c.token_id == i).values(expired_at=expired)
            )
    dry = await collect(engine, 30 * 86400, dry_run=True)
    assert dry.e2ee_expired == 1 and dry.total == 1
    async with engine.connect() as conn:
        assert (
            await conn.execute(select(func.count()).select_from(e2ee_devices))
        ).scalar_one() == 3
    assert (await collect(engine, 30 * 86400)).total == 1
    assert (await collect(engine, 30 * 86400)).total == 0
    # a realm deleted (locally) long ago takes its rows with it; so does a dead server
    async with engine.begin() as conn:
        await repo.legacy_register(
            conn,
            server_id=sid,
            realm_id=realm_id,
            user_id=1,
            user_uuid=None,
            kind=2,
            token="x",
            token_hash="h" * 64,
            ios_app_id=None,
            apns=False,
        )
        await conn.execute(update(realms).values(locally_deleted_at=old))
    counts = await collect(engine, 30 * 86400)
    assert (counts.e2ee_of_gone_realms, counts.legacy_of_gone_realms) == (2, 1)
    async with engine.begin() as conn:
        await repo.legacy_register(
            conn,
            server_id=sid,
            realm_id=None,
            user_id=1,
            user_uuid=None,
            kind=2,
            token="y",
            token_hash="h" * 64,
            ios_app_id=None,
            apns=False,
        )
        await conn.execute(update(servers).values(deactivated_at=old))
    assert (await collect(engine, 30 * 86400)).legacy_of_deactivated_servers == 1
    async with engine.connect() as conn:
        assert (
            await conn.execute(select(func.count()).select_from(legacy_devices))
        ).scalar_one() == 0

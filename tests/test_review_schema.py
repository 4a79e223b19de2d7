"""Schema review (operator upgrading, DBA): migrations against models, downgrade and
upgrade cycles, rows kept across revisions, indexes of the hot paths, types on SQLite
and PostgreSQL alike, and what `pushgw db upgrade` says."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import MetaData, inspect, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.core.store import Store, alembic_config, sqlite_migration_lock
from gateway.core.store import metadata as core_metadata
from plugins.zulip import repo
from plugins.zulip.plugin import pushgw_migrations
from plugins.zulip.tables import e2ee_devices, legacy_devices
from plugins.zulip.tables import metadata as zulip_metadata

ZULIP = pushgw_migrations()
ZULIP_HEAD = "zulip_0004"
CORE_HEAD = "core_0002"  # a head of its own: the zulip branch depends on core_0001
PUSHGW = [sys.executable, "-m", "gateway.cli"]


def _alembic(url: str, action: str, target: str) -> None:
    cfg = alembic_config(url, [ZULIP])
    with sqlite_migration_lock(url):
        getattr(command, action)(cfg, target)


async def alembic(url: str, action: str, target: str) -> None:
    await asyncio.to_thread(_alembic, url, action, target)


def _drift(conn: Any) -> list[Any]:
    both = MetaData()
    for table in [*core_metadata.tables.values(), *zulip_metadata.tables.values()]:
        table.to_metadata(both)
    context = MigrationContext.configure(conn, opts={"compare_type": True})
    return [
        d
        for d in compare_metadata(context, both)
        # SQLite reflects DEFAULT '' as ('') and Alembic does not unquote it
        if not (
            conn.dialect.name == "sqlite"
            and isinstance(d, list)
            and d[0][0] == "modify_default"
            and str(d[0][5].arg) in ("('')", "''")
            and d[0][6].arg == ""
        )
    ]


async def drift(s: Store) -> list[Any]:
    async with s.engine.connect() as conn:
        return await conn.run_sync(_drift)


async def tables(s: Store) -> set[str]:
    async with s.engine.connect() as conn:
        return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))


async def heads(s: Store) -> set[str]:
    async with s.engine.connect() as conn:
        return set(await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_heads()))


# --- drift and cycles ------------------------------------------------------------------


async def test_migrated_database_equals_the_models(store: Store) -> None:
    await store.upgrade([ZULIP])
    assert await drift(store) == []
    assert await heads(store) == {CORE_HEAD, ZULIP_HEAD}


async def test_upgrade_downgrade_base_upgrade_again(store: Store) -> None:
    await store.upgrade([ZULIP])
    await alembic(store.url, "downgrade", "base")
    assert await tables(store) <= {"alembic_version"}
    assert await heads(store) == set()
    await store.upgrade([ZULIP])
    assert await drift(store) == []
    # each revision of the zulip branch down and up again, one step at a time
    await alembic(store.url, "downgrade", "zulip@zulip_0001")
    assert await heads(store) == {CORE_HEAD, "zulip_0001"}
    await alembic(store.url, "downgrade", "zulip@base")
    assert not any(t.startswith("zulip_") for t in await tables(store))
    assert "pushgw_invalid_tokens" in await tables(store)
    await store.upgrade([ZULIP])
    assert await drift(store) == []


async def _rows_of_0001(conn: AsyncConnection, now: datetime) -> dict[str, int]:
    """One row in every table, written as a pushgw that stopped at zulip_0001 wrote it."""
    await conn.execute(
        text(
            "INSERT INTO pushgw_invalid_tokens VALUES "
            "('zulip', 'app', :h, 'apns', 'BadDeviceToken', :now)"
        ),
        {"h": "a" * 64, "now": now},
    )
    assert await repo.create_server(conn, "6cde5f7a-1f7e-4978-9716-49f69ebfc9fe", "k", "h", "e")
    server = await repo.get_server(conn, "6cde5f7a-1f7e-4978-9716-49f69ebfc9fe")
    assert server is not None
    info = repo.RealmInfo("8a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d", "h", "ñame ✓", 2, False, False)
    realm = (await repo.upsert_realms(conn, server.id, [info], complete=True))[info.uuid]
    # The device tables' columns of zulip_0001 only (`registered_at` came with zulip_0003).
    await conn.execute(
        e2ee_devices.insert().values(
            realm_id=realm.id,
            token_id=-(2**63),
            token="AB" * 32,
            token_kind="apns",
            ios_app_id="org.example",
            token_hash="b" * 64,
            token_key=repo.token_key("AB" * 32, True),
            created_at=now,
        )
    )
    await conn.execute(
        legacy_devices.insert().values(
            server_id=server.id,
            realm_id=realm.id,
            user_id=2**63 - 1,
            kind=1,
            token="cd" * 32,
            token_key=repo.token_key("cd" * 32, True),
            token_hash="c" * 64,
            created_at=now,
        )
    )
    return {"server": server.id, "realm": realm.id}


LATER_COLUMNS = {"registered_at"}  # added after zulip_0001 (zulip_0003)


async def _snapshot(s: Store) -> dict[str, list[tuple[Any, ...]]]:
    """Every row, in the columns zulip_0001 had."""
    async with s.engine.connect() as conn:
        snapshot = {
            "pushgw_invalid_tokens": [
                tuple(r)
                for r in (await conn.execute(text("SELECT * FROM pushgw_invalid_tokens"))).all()
            ]
        }
        for table in zulip_metadata.sorted_tables:
            columns = ", ".join(c.name for c in table.columns if c.name not in LATER_COLUMNS)
            query = text(f"SELECT {columns} FROM {table.name}")
            snapshot[table.name] = [tuple(r) for r in (await conn.execute(query)).all()]
        return snapshot


async def test_rows_of_each_earlier_revision_survive_the_upgrade(store: Store) -> None:
    await alembic(store.url, "upgrade", "zulip@zulip_0001")
    async with store.engine.begin() as conn:
        await _rows_of_0001(conn, datetime.now(UTC))
    before = await _snapshot(store)
    assert all(len(rows) == 1 for rows in before.values()), before
    await store.upgrade([ZULIP])
    assert await heads(store) == {CORE_HEAD, ZULIP_HEAD}
    assert await _snapshot(store) == before
    await alembic(store.url, "downgrade", "zulip@zulip_0001")
    assert await _snapshot(store) == before
    await store.upgrade([ZULIP])
    assert await _snapshot(store) == before
    assert await drift(store) == []


# --- indexes of the hot paths ----------------------------------------------------------


async def test_gc_columns_are_indexed(store: Store) -> None:
    """`collect_garbage` selects `expired_at < cutoff` and `realm_id IN (...)`; the
    legacy `realm_id` is a foreign key too (ON DELETE SET NULL). Before zulip_0002,
    neither had an index: PostgreSQL read both whole tables on every collection."""
    await store.upgrade([ZULIP])

    def indexed(conn: Any) -> set[tuple[str, tuple[str, ...]]]:
        insp = inspect(conn)
        out = set()
        for table in ("zulip_e2ee_devices", "zulip_legacy_devices"):
            for ix in insp.get_indexes(table):
                out.add((table, tuple(ix["column_names"])))
        return out

    async with store.engine.connect() as conn:
        found = await conn.run_sync(indexed)
    assert ("zulip_e2ee_devices", ("expired_at",)) in found
    assert ("zulip_legacy_devices", ("realm_id",)) in found


# The device tables' hot paths use indexes: tests/test_review_dba_indexes.py, on all the
# zulip tables at a large bouncer's size.


# --- types on both dialects ------------------------------------------------------------


async def test_values_round_trip_alike(store: Store) -> None:
    """Timestamps (SQLite gives them back naive: the same UTC instant), booleans, int64
    bounds, strings at their column limits and non-ASCII text."""
    await store.upgrade([ZULIP])
    now = datetime(2024, 3, 31, 1, 30, 0, 123456, tzinfo=UTC)
    async with store.engine.begin() as conn:
        ids = await _rows_of_0001(conn, now)
        await repo.update_server(
            conn,
            ids["server"],
            hostname="h" * 255,
            contact_email="e" * 255,
            version="v" * 128,
            merge_base="m" * 128,
            deactivated_at=now,
            push_disabled=True,
        )
        server = await repo.get_server(conn, "6cde5f7a-1f7e-4978-9716-49f69ebfc9fe")
        assert server is not None
        await repo.record_analytics_ids(conn, server, {"last_realmauditlog_id": 2**63 - 1}, {})
        server = await repo.get_server(conn, "6cde5f7a-1f7e-4978-9716-49f69ebfc9fe")
        realm = await repo.get_realm(conn, "8a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d")
        e2ee = (await conn.execute(select(e2ee_devices))).one()
        legacy = (await conn.execute(select(legacy_devices))).one()
        stamp = (await conn.execute(text("SELECT invalidated_at FROM pushgw_invalid_tokens"))).one()
    assert server is not None and realm is not None

    def instant(value: Any) -> datetime:
        if isinstance(value, str):  # a raw SQLite column through text()
            value = datetime.fromisoformat(value)
        return value if value.tzinfo else value.replace(tzinfo=UTC)

    assert instant(server.deactivated_at) == now
    assert instant(stamp[0]) == now
    assert server.push_disabled is True and realm.deactivated is False
    assert realm.is_system_bot_realm is False and realm.name == "ñame ✓"
    assert server.last_realmauditlog_id == 2**63 - 1 and server.last_realm_count_id == 0
    assert (len(server.hostname), len(server.version), len(server.merge_base)) == (255, 128, 128)
    assert e2ee.token_id == -(2**63) and legacy.user_id == 2**63 - 1


async def test_gc_cutoff_compares_alike(store: Store) -> None:
    """A registration expired a microsecond before the cutoff goes; one at it stays."""
    await store.upgrade([ZULIP])
    cutoff = datetime(2024, 1, 1, tzinfo=UTC)
    async with store.engine.begin() as conn:
        ids = await _rows_of_0001(conn, cutoff)
        for token_id, expired in ((1, cutoff - timedelta(microseconds=1)), (2, cutoff)):
            await repo.register_e2ee(
                conn,
                realm_id=ids["realm"],
                token_id=token_id,
                token=f"tok{token_id}",
                token_kind="fcm",
                ios_app_id=None,
                token_hash="d" * 64,
            )
            await conn.execute(
                e2ee_devices.update()
                .where(e2ee_devices.c.token_id == token_id)
                .values(expired_at=expired)
            )
        counts = await repo.collect_garbage(conn, cutoff)
        left = (await conn.execute(select(e2ee_devices.c.token_id))).scalars().all()
    assert counts.e2ee_expired == 1
    assert sorted(left) == [-(2**63), 2]


# --- the command -----------------------------------------------------------------------


def pushgw(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PUSHGW, "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )


async def test_db_upgrade_from_an_earlier_revision_and_refusals(
    store: Store, tmp_path: Path
) -> None:
    await alembic(store.url, "upgrade", "zulip@zulip_0001")
    async with store.engine.begin() as conn:
        await _rows_of_0001(conn, datetime.now(UTC))
    before = await _snapshot(store)
    await store.engine.dispose()  # the subprocess migrates; no pooled connection left

    def config(name: str, **store_options: Any) -> Path:
        path = tmp_path / name
        options = {"url": store.url, **store_options}
        path.write_text(yaml.safe_dump({"store": options, "plugins": {"enabled": ["zulip"]}}))
        return path

    checked = config("checked.yaml", auto_upgrade=False)
    result = await asyncio.to_thread(pushgw, checked, "zulip", "servers")
    assert result.returncode == 1, result
    assert result.stderr.endswith(
        "not migrated (core_0002, zulip_0002, zulip_0003, zulip_0004 pending) and "
        "store.auto_upgrade is false: run `pushgw db upgrade`\n"
    ), result.stderr

    result = await asyncio.to_thread(pushgw, config("up.yaml"), "db", "upgrade")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"database at head ({store.dialect}): {store.url}\n"  # no password
    assert await heads(store) == {CORE_HEAD, ZULIP_HEAD}
    assert await _snapshot(store) == before

    # a database migrated by a later pushgw than this one: refused, the revision named
    async with store.engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE alembic_version SET version_num = 'zulip_0999' "
                "WHERE version_num = 'zulip_0004'"
            )
        )
    await store.engine.dispose()
    result = await asyncio.to_thread(pushgw, config("up.yaml"), "db", "upgrade")
    assert result.returncode == 1 and result.stdout == ""
    assert "zulip_0999" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1

"""DBA review: the hourly dead-token sweep (`sweep_invalid_tokens`: `DELETE FROM
pushgw_invalid_tokens WHERE invalidated_at < cutoff`, run by every node) reads the
table through `ix_pushgw_invalid_tokens_invalidated_at` (migration core_0002), on
PostgreSQL (EXPLAIN of the exact statement SQLAlchemy sends, on a table shaped as a
large gateway's: 30 days of records, the sweep's cutoff taking the oldest few) and on
SQLite (EXPLAIN QUERY PLAN). Before core_0002 both read the whole table every hour.

The revision goes up from a core_0001 database keeping its rows, and down again.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from typing import Any

from alembic import command
from sqlalchemy import event, func, inspect, select, text

from gateway.core.store import Store, alembic_config, invalid_tokens, sqlite_migration_lock
from gateway.core.tokens import sweep_invalid_tokens

INDEX = "ix_pushgw_invalid_tokens_invalidated_at"
# (plugin, age in days) of the records of a database of the previous release
RECORDS = [("zulip", 1), ("zulip", 45), ("matrix", 2), ("matrix", 60)]
RETENTION = timedelta(days=30).total_seconds()  # store.invalid_tokens_retention's default


async def swept(store: Store) -> tuple[int, str, Any]:
    """Run the real sweep; how many it deleted, and the DELETE statement and parameters
    it sent (as the driver got them)."""
    sent: list[tuple[str, Any]] = []

    def capture(_c: Any, _cur: Any, statement: str, params: Any, _ctx: Any, _many: bool) -> None:
        if statement.lstrip().upper().startswith("DELETE"):
            sent.append((statement, params))

    event.listen(store.engine.sync_engine, "before_cursor_execute", capture)
    try:
        deleted = await sweep_invalid_tokens(store, RETENTION)
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", capture)
    assert len(sent) == 1, sent
    assert "pushgw_invalid_tokens.invalidated_at <" in sent[0][0]
    return deleted, *sent[0]


def _scans(node: dict[str, Any]) -> list[tuple[str, str | None, str | None]]:
    """(node type, relation, index) of every node of a PostgreSQL JSON plan."""
    found = [(node["Node Type"], node.get("Relation Name"), node.get("Index Name"))]
    for child in node.get("Plans", []):
        found += _scans(child)
    return found


async def test_the_sweep_uses_the_index_on_postgresql(postgres_url: str) -> None:
    s = Store(postgres_url)
    try:
        await s.upgrade()
        async with s.engine.begin() as conn:
            # 200,000 records of the last 28 days, and 500 older than the retention
            await conn.execute(
                text(
                    "INSERT INTO pushgw_invalid_tokens (plugin, app_id, token_hash, provider,"
                    " reason, invalidated_at) SELECT 'zulip', 'org.example.app',"
                    " md5(g::text) || md5('h' || g), 'fcm', 'UNREGISTERED',"
                    " now() - g * interval '12 seconds' FROM generate_series(1, 200000) g"
                )
            )
            await conn.execute(
                text(
                    "INSERT INTO pushgw_invalid_tokens (plugin, app_id, token_hash, provider,"
                    " reason, invalidated_at) SELECT 'zulip', 'org.example.app',"
                    " md5('old' || g) || md5('OLD' || g), 'apns', 'BadDeviceToken',"
                    " now() - interval '31 days' - g * interval '10 seconds'"
                    " FROM generate_series(1, 500) g"
                )
            )
        async with s.engine.connect() as conn:
            await conn.execute(text("COMMIT"))  # ANALYZE outside the implicit transaction
            await conn.execute(text("ANALYZE pushgw_invalid_tokens"))

        deleted, statement, params = await swept(s)
        assert deleted == 500
        async with s.engine.connect() as conn:
            left = (await conn.execute(select(func.count()).select_from(invalid_tokens))).one()
        assert left == (200_000,)

        async with s.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            assert raw is not None
            # the planner's own choice (sequential scans allowed)
            rows = await raw.fetch("EXPLAIN (FORMAT JSON) " + statement, *params)
            value = rows[0][0]
            plan = (json.loads(value) if isinstance(value, str) else value)[0]["Plan"]
        scans = _scans(plan)
        assert plan["Node Type"] == "ModifyTable", plan
        assert ("Seq Scan", "pushgw_invalid_tokens", None) not in scans, scans
        assert any(
            kind in ("Index Scan", "Index Only Scan", "Bitmap Index Scan") and index == INDEX
            for kind, _table, index in scans
        ), scans
    finally:
        await s.close()


async def test_the_sweep_uses_the_index_on_sqlite(tmp_path: Any) -> None:
    s = Store(f"sqlite+aiosqlite:///{tmp_path / 'sweep.db'}")
    try:
        await s.upgrade()
        now = datetime.now(UTC)
        rows = [
            {
                "plugin": "zulip",
                "app_id": "org.example.app",
                "token_hash": f"{n:064x}",
                "provider": "fcm",
                "reason": "UNREGISTERED",
                "invalidated_at": now - timedelta(days=40 if n % 10 == 0 else 1, seconds=n),
            }
            for n in range(1, 1001)
        ]
        async with s.engine.begin() as conn:
            await conn.execute(invalid_tokens.insert(), rows)

        deleted, statement, params = await swept(s)
        assert deleted == 100  # every tenth row was older than the retention
        async with s.engine.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            assert raw is not None
            cursor = await raw.execute("EXPLAIN QUERY PLAN " + statement, params)
            details = [str(row[-1]) for row in await cursor.fetchall()]
        assert any(f"USING INDEX {INDEX} (invalidated_at<?)" in d for d in details), details
        assert not any(d.startswith("SCAN pushgw_invalid_tokens") for d in details), details
    finally:
        await s.close()


# --- the migration ---------------------------------------------------------------------


def _upgrade_core_to(url: str, revision: str) -> None:
    with sqlite_migration_lock(url):
        command.upgrade(alembic_config(url), revision)


async def _state(s: Store) -> tuple[list[str], list[tuple[Any, ...]], list[str]]:
    """The table's index names, its rows (in key order) and the database's revisions."""
    async with s.engine.connect() as conn:
        indexes = await conn.run_sync(
            lambda c: sorted(i["name"] or "" for i in inspect(c).get_indexes(invalid_tokens.name))
        )
        rows = [
            tuple(r)
            for r in await conn.execute(
                select(invalid_tokens).order_by(*invalid_tokens.primary_key.columns)
            )
        ]
        revisions = (await conn.execute(text("SELECT version_num FROM alembic_version"))).all()
    return indexes, rows, sorted(r[0] for r in revisions)


async def test_core_0002_adds_the_index_keeping_the_rows_and_goes_down_again(
    store: Store,
) -> None:
    """A database of the previous release (core_0001, dead-token records in it) gains the
    index on upgrade, rows unchanged; `db downgrade core_0001` takes it away again."""
    await asyncio.to_thread(_upgrade_core_to, store.url, "core_0001")
    now = datetime.now(UTC)
    async with store.engine.begin() as conn:
        await conn.execute(
            invalid_tokens.insert(),
            [
                {
                    "plugin": plugin,
                    "app_id": "org.example.app",
                    "token_hash": f"{n:064x}",
                    "provider": "apns",
                    "reason": "Unregistered",
                    "invalidated_at": now - timedelta(days=days),
                }
                for n, (plugin, days) in enumerate(RECORDS)
            ],
        )
    indexes, before, revisions = await _state(store)
    assert INDEX not in indexes and revisions == ["core_0001"]
    assert len(before) == len(RECORDS)

    await store.upgrade()
    indexes, rows, revisions = await _state(store)
    assert INDEX in indexes and revisions == ["core_0002"]
    assert rows == before
    async with store.engine.connect() as conn:
        found = await conn.run_sync(lambda c: inspect(c).get_indexes(invalid_tokens.name))
    assert [i["column_names"] for i in found if i["name"] == INDEX] == [["invalidated_at"]]

    assert await store.downgrade(["core_0001"], []) == ["core_0001"]
    indexes, rows, revisions = await _state(store)
    assert INDEX not in indexes and revisions == ["core_0001"]
    assert rows == before

    # up again, and the sweep still takes exactly the records past the retention
    await store.upgrade()
    recent = {f"{n:064x}" for n, (_plugin, days) in enumerate(RECORDS) if days < 30}
    assert await sweep_invalid_tokens(store, RETENTION) == len(RECORDS) - len(recent)
    _indexes, rows, _revisions = await _state(store)
    assert rows == [r for r in before if r[2] in recent]

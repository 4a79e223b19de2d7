"""Rollback review (an operator rolling back a release, or running old and new nodes side
by side on one database): every revision's downgrade undoes its upgrade on SQLite and
PostgreSQL, an older node refuses a newer database in one line that says what to do,
`pushgw db downgrade` takes the database back to an older release's revisions, and the
receipt readers ignore fields a newer writer adds (docs/receipts.md, Compatibility)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from alembic import command
from sqlalchemy import inspect, text

from gateway.cli import main as pushgw_main
from gateway.core.push import Outcome, Receipt
from gateway.core.receipts import receipt_record
from gateway.core.receipts_parquet import SCHEMA
from gateway.core.store import Store, alembic_config, sqlite_migration_lock
from plugins.zulip import repo
from plugins.zulip.plugin import pushgw_migrations
from tests.spark.conftest import spark  # noqa: F401 (the session's SparkSession)

ZULIP = pushgw_migrations()
REVISIONS = ["zulip_0001", "zulip_0002", "zulip_0003", "zulip_0004"]
PUSHGW = [sys.executable, "-m", "gateway.cli"]
SERVER_UUID = "6cde5f7a-1f7e-4978-9716-49f69ebfc9fe"

# A revision of a release after this one: a column added to zulip_servers.
NEWER_REVISION = '''"""a newer release's revision"""
import sqlalchemy as sa
from alembic import op

revision = "zulip_0005"
down_revision = "zulip_0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("zulip_servers", sa.Column("newer", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("zulip_servers") as batch:
        batch.drop_column("newer")
'''


def _alembic(url: str, action: str, target: str, dirs: list[str]) -> None:
    with sqlite_migration_lock(url):
        getattr(command, action)(alembic_config(url, dirs), target)


async def alembic(url: str, action: str, target: str, dirs: list[str] | None = None) -> None:
    await asyncio.to_thread(_alembic, url, action, target, dirs or [ZULIP])


def _schema(conn: Any) -> dict[str, Any]:
    """Everything an inspector sees of every table, order of constraints aside."""
    insp = inspect(conn)
    out: dict[str, Any] = {}
    for table in insp.get_table_names():
        out[table] = {
            "columns": [
                (c["name"], str(c["type"]), c["nullable"], str(c.get("default")))
                for c in insp.get_columns(table)
            ],
            "pk": insp.get_pk_constraint(table),
            "fks": sorted(map(repr, insp.get_foreign_keys(table))),
            "indexes": sorted(map(repr, insp.get_indexes(table))),
            "uniques": sorted(map(repr, insp.get_unique_constraints(table))),
        }
    return out


async def schema(s: Store) -> dict[str, Any]:
    async with s.engine.connect() as conn:
        found = await conn.run_sync(_schema)
    await s.engine.dispose()
    return found


async def server_rows(s: Store) -> list[tuple[Any, ...]]:
    async with s.engine.connect() as conn:
        rows = (await conn.execute(text("SELECT uuid, hostname FROM zulip_servers"))).all()
    await s.engine.dispose()
    return [tuple(r) for r in rows]


@pytest.mark.parametrize("revision", REVISIONS[:-1])
async def test_each_downgrade_gives_back_the_schema_and_rows_before_the_upgrade(
    store: Store, revision: str
) -> None:
    await alembic(store.url, "upgrade", f"zulip@{revision}")
    async with store.engine.begin() as conn:
        assert await repo.create_server(conn, SERVER_UUID, "k", "push.example", "e")
    before, rows = await schema(store), await server_rows(store)
    await store.upgrade([ZULIP])
    assert await schema(store) != before
    await alembic(store.url, "downgrade", f"zulip@{revision}")
    await alembic(store.url, "downgrade", "core@core_0001")  # the core's head came too
    assert await schema(store) == before
    assert await server_rows(store) == rows == [(SERVER_UUID, "push.example")]
    await store.upgrade([ZULIP])  # and up again
    assert await server_rows(store) == rows


# --- an older node, a newer database ---------------------------------------------------


def _config(tmp_path: Path, url: str, **store_options: Any) -> Path:
    path = tmp_path / f"gw-{len(store_options)}.yaml"
    options = {"url": url, **store_options}
    path.write_text(yaml.safe_dump({"store": options, "plugins": {"enabled": ["zulip"]}}))
    return path


def pushgw(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PUSHGW, "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )


async def _migrated_by_a_newer_release(s: Store, tmp_path: Path) -> list[str]:
    newer = tmp_path / "newer"
    newer.mkdir()
    (newer / "zulip_0005.py").write_text(NEWER_REVISION)
    await s.upgrade([ZULIP])
    async with s.engine.begin() as conn:
        assert await repo.create_server(conn, SERVER_UUID, "k", "push.example", "e")
    await s.engine.dispose()
    await alembic(s.url, "upgrade", "heads", [ZULIP, str(newer)])
    return [ZULIP, str(newer)]


@pytest.mark.parametrize("auto_upgrade", [True, False])
async def test_an_older_node_refuses_a_newer_database_saying_what_to_do(
    store: Store, tmp_path: Path, auto_upgrade: bool
) -> None:
    await _migrated_by_a_newer_release(store, tmp_path)
    before = await schema(store)
    config = _config(tmp_path, store.url, auto_upgrade=auto_upgrade)
    for args in (["serve", "--port", "0"], ["db", "upgrade"], ["zulip", "servers"]):
        result = await asyncio.to_thread(pushgw, config, *args)
        assert result.returncode == 1, (args, result)
        assert result.stderr == (
            f"pushgw: error: database {store.url}: at revision zulip_0005, which this pushgw "
            "does not know: a newer pushgw migrated it (roll it back with that one: "
            "`pushgw db downgrade core_0002 zulip_0004`, docs/cli.md), or the plugin of "
            "that revision is no longer installed (docs/plugins.md)\n"
        ), args
    assert await schema(store) == before  # nothing touched
    assert await server_rows(store) == [(SERVER_UUID, "push.example")]


async def test_db_downgrade_rolls_back_to_an_older_releases_revisions(
    store: Store, tmp_path: Path
) -> None:
    await alembic(store.url, "upgrade", "zulip@zulip_0003")
    at_0003 = await schema(store)
    await store.upgrade([ZULIP])
    async with store.engine.begin() as conn:
        assert await repo.create_server(conn, SERVER_UUID, "k", "push.example", "e")
    await store.engine.dispose()
    config = _config(tmp_path, store.url)
    # the older release's revisions, as its refusal names them: core_0002 is undone,
    # core_0001 is below the zulip branch's revisions (they depend on it) and stays
    result = await asyncio.to_thread(pushgw, config, "db", "downgrade", "core_0001", "zulip_0003")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"database at zulip_0003 ({store.dialect}): {store.url}\n"
    assert await schema(store) == at_0003
    assert await server_rows(store) == [(SERVER_UUID, "push.example")]
    # again: nothing above them any more, nothing done
    result = await asyncio.to_thread(pushgw, config, "db", "downgrade", "core_0001", "zulip_0003")
    assert result.returncode == 0 and await schema(store) == at_0003
    # targets that are no release's revisions (they would drop tables) are refused
    for target in ("base", "zulip@base", "-1", "zulip_9999"):
        result = await asyncio.to_thread(pushgw, config, "db", "downgrade", target)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result
        assert len(result.stderr.splitlines()) == 1
        assert f"{target!r} is not a revision of this pushgw" in result.stderr
    assert await schema(store) == at_0003
    result = await asyncio.to_thread(pushgw, config, "db", "upgrade")
    assert result.returncode == 0, result.stderr
    assert await server_rows(store) == [(SERVER_UUID, "push.example")]


async def test_db_downgrade_by_an_older_pushgw_refuses_what_it_does_not_know(
    store: Store, tmp_path: Path
) -> None:
    await _migrated_by_a_newer_release(store, tmp_path)
    before = await schema(store)
    config = _config(tmp_path, store.url)
    result = await asyncio.to_thread(pushgw, config, "db", "downgrade", "zulip_0003")
    assert result.returncode == 1, result
    assert "at revision zulip_0005, which this pushgw does not know" in result.stderr
    assert await schema(store) == before


# --- receipts of a newer writer ---------------------------------------------------------


def _newer_records() -> list[dict[str, Any]]:
    """Receipts as this version writes them, plus a field a later version might add."""
    receipts = [
        Receipt(f"p{i}", "zulip", "ios", None, Outcome.OK, 200, None, 1, 0.01, 1.7e9 + i)
        for i in range(3)
    ]
    return [{**receipt_record(r), "region": "eu-west"} for r in receipts]


def _parquet(path: Path, records: list[dict[str, Any]]) -> None:
    """As this version's writer converts them, with the columns `records` carry."""
    schema = SCHEMA
    if "region" in records[0]:
        schema = schema.append(pa.field("region", pa.string()))
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path, compression="snappy")


def test_cat_ignores_a_newer_parquet_column_and_prints_a_newer_line_as_it_is(
    tmp_path: Path, capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    records = _newer_records()
    _parquet(tmp_path / "receipts-a.parquet", records)
    lines = [json.dumps(r) for r in records]
    (tmp_path / "receipts-b.jsonl").write_text("".join(f"{line}\n" for line in lines))
    capfdbinary.readouterr()
    assert pushgw_main(["receipts", "cat", str(tmp_path)]) == 0
    out = capfdbinary.readouterr().out.decode().splitlines()
    parquet_rows = [json.loads(line) for line in out[:3]]
    known = [{k: v for k, v in r.items() if k != "region"} for r in records]
    assert parquet_rows == known
    assert out[3:] == lines


def test_spark_reads_a_newer_writers_files_ignoring_the_new_field(
    spark: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    from spark_plugins.reader import COLUMNS, read_receipts

    records = _newer_records()
    _parquet(tmp_path / "receipts-a.parquet", records)
    old = [{k: v for k, v in r.items() if k != "region"} for r in records]
    _parquet(tmp_path / "receipts-b.parquet", old)
    (tmp_path / "receipts-c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    receipts = read_receipts(spark, str(tmp_path))
    assert tuple(receipts.df.columns) == COLUMNS
    assert receipts.df.count() == 9
    stats = receipts.stats()
    assert (stats.records, stats.bad, stats.bad_files) == (9, 0, [])

"""Backup, restore and moving hosts (docs/backup.md): `pushgw db backup` while the
gateway writes, restoring an older or a newer backup, pg_dump / pg_restore into a fresh
PostgreSQL database, and the SQLite URL the production example shows.

Real SQLite files, a real gateway (GatewayHarness with the Zulip plugin and the provider
simulators), real PostgreSQL with the real pg_dump / pg_restore (skipped with the reason
when either is missing).
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy import text
from sqlalchemy.engine import make_url

from gateway.testing import ApnsSimulator, FcmSimulator
from gateway.testing.databases import temporary_postgres_database
from gateway.testing.harness import GatewayHarness
from tests.zulip.conftest import Env, ZulipServer, apns_token, zulip_config

ROOT = Path(__file__).parents[1]
PUSHGW = [sys.executable, "-m", "gateway.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*PUSHGW, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )


def store_config(tmp_path: Path, url: str, name: str = "store.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"store": {"url": url}}))
    return path


def legacy_devices(db: Path) -> set[str]:
    with sqlite3.connect(db) as conn:
        return {row[0] for row in conn.execute("SELECT token FROM zulip_legacy_devices")}


async def register_devices(server: ZulipServer, count: int) -> list[str]:
    tokens = []
    for user in range(count):
        token = apns_token()
        status, body = await server.legacy_register(token, 1, user_id=user)
        assert status == 200, body
        tokens.append(token)
    return tokens


@pytest.fixture
async def sims() -> Any:
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        yield apns, fcm


# -- pushgw db backup ---------------------------------------------------------------------


async def test_db_backup_while_the_gateway_writes_is_one_consistent_file(
    tmp_path: Path, sims: tuple[ApnsSimulator, FcmSimulator]
) -> None:
    """Before: no way to back the SQLite database up while `pushgw serve` runs but the
    sqlite3 tool (often not installed) or a `cp` that misses what is still in the -wal."""
    apns, fcm = sims
    live = tmp_path / "live"
    live.mkdir()
    config = zulip_config(apns, fcm, live)
    db = Path(make_url(config["store"]["url"]).database or "")
    dest = tmp_path / "backup.db"
    async with GatewayHarness(config) as harness:
        env = Env(harness, apns, fcm)
        server, _realm = await env.ready_server()
        before = await register_devices(server, 20)
        stop = asyncio.Event()

        async def keep_writing() -> list[str]:
            written: list[str] = []
            while not stop.is_set():
                written += await register_devices(server, 1)
            return written

        writer = asyncio.create_task(keep_writing())
        try:
            result = await asyncio.to_thread(
                run,
                "db",
                "backup",
                "-c",
                str(store_config(tmp_path, str(config["store"]["url"]))),
                str(dest),
            )
        finally:
            stop.set()
            during = await writer
        assert result.returncode == 0, result.stderr
        assert (
            result.stdout
            == f"backed up {config['store']['url']} (at core_0002, zulip_0004) to {dest}\n"
        )
        assert (db.parent / f"{db.name}-wal").exists()  # the live database is in WAL mode

    # one file, complete by itself: no -wal of its own, nothing left beside it
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["backup.db", "store.yaml"]
    with sqlite3.connect(dest) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    copied = legacy_devices(dest)
    assert set(before) <= copied  # everything committed before the backup started
    assert copied <= set(before) | set(during)  # and nothing that was never written

    # restored on another host: the server and its registrations work as before
    restored = tmp_path / "restored"
    restored.mkdir()
    shutil.copy(dest, restored / "pushgw.db")
    config2 = zulip_config(apns, fcm, restored)
    async with GatewayHarness(config2) as harness2:
        server.client = harness2.client
        status, body = await server.legacy_register(apns_token(), 1, user_id=99)
        assert status == 200, body  # not UNAUTHORIZED: the server came back
    assert copied < legacy_devices(restored / "pushgw.db")


def test_db_backup_refuses_an_existing_file_a_missing_database_and_postgresql(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "nothing" / "pushgw.db"
    config = store_config(tmp_path, f"sqlite+aiosqlite:///{missing}")
    result = run("-c", str(config), "db", "backup", str(tmp_path / "b.db"))
    assert result.returncode == 1
    assert result.stderr == (
        f"pushgw: error: database sqlite+aiosqlite:///{missing}: "
        "no such database file: nothing to back up\n"
    )
    assert not missing.exists() and not (tmp_path / "b.db").exists()  # nothing created

    db = tmp_path / "pushgw.db"
    config = store_config(tmp_path, f"sqlite+aiosqlite:///{db}")
    assert run("-c", str(config), "db", "upgrade").returncode == 0
    taken = tmp_path / "taken.db"
    taken.write_text("an older backup")
    result = run("-c", str(config), "db", "backup", str(taken))
    assert (result.returncode, result.stderr) == (
        2,
        f"pushgw: error: {taken}: already exists: give the name of a new file\n",
    )
    assert taken.read_text() == "an older backup"

    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE t (x)")
    config = store_config(tmp_path, f"sqlite+aiosqlite:///{other}", "other.yaml")
    result = run("-c", str(config), "db", "backup", str(tmp_path / "o.db"))
    assert result.returncode == 1
    assert result.stderr.endswith("not a pushgw database (no alembic_version table)\n")
    assert not (tmp_path / "o.db").exists()

    pg = "postgresql+asyncpg://pushgw:s3cret-backup-pw@127.0.0.1:1/pushgw"
    config = store_config(tmp_path, pg, "pg.yaml")
    result = run("-c", str(config), "db", "backup", str(tmp_path / "p.db"))
    assert result.returncode == 2
    assert "back PostgreSQL up with pg_dump" in result.stderr
    assert "s3cret-backup-pw" not in result.stderr + result.stdout


# -- restoring an older or a newer backup --------------------------------------------------


def test_a_restored_older_backup_upgrades_and_a_newer_one_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "pushgw.db"
    url = f"sqlite+aiosqlite:///{db}"
    config = tmp_path / "pushgw.yaml"
    config.write_text(
        yaml.safe_dump(
            {"store": {"url": url}, "plugins": {"enabled": ["zulip"], "zulip": {"apps": {}}}}
        )
    )
    assert run("-c", str(config), "db", "upgrade").returncode == 0
    # a backup made by an older release: at zulip_0002
    down = run("-c", str(config), "db", "downgrade", "core_0001", "zulip_0002")
    assert down.returncode == 0, down.stderr
    old = tmp_path / "old.db"
    assert run("-c", str(config), "db", "backup", str(old)).stdout.startswith(
        f"backed up {url} (at zulip_0002) to"
    )
    db.unlink()
    shutil.copy(old, db)
    up = run("-c", str(config), "db", "upgrade")
    assert (up.returncode, up.stdout) == (0, f"database at head (sqlite): {url}\n"), up.stderr
    with sqlite3.connect(db) as conn:
        assert sorted(conn.execute("SELECT version_num FROM alembic_version")) == [
            ("core_0002",),
            ("zulip_0004",),
        ]

    # a backup made by a newer release
    with sqlite3.connect(db) as conn:
        conn.execute(
            "UPDATE alembic_version SET version_num = 'zulip_0099' WHERE version_num = 'zulip_0004'"
        )
    refused = run("-c", str(config), "db", "upgrade")
    assert refused.returncode == 1
    assert "at revision zulip_0099, which this pushgw does not know" in refused.stderr
    assert "Traceback" not in refused.stderr


# -- PostgreSQL: pg_dump, pg_restore into a fresh database ---------------------------------


def libpq_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def test_pg_dump_and_pg_restore_into_a_fresh_database_give_a_working_gateway(
    tmp_path: Path, sims: tuple[ApnsSimulator, FcmSimulator], postgres_url: str
) -> None:
    if not (shutil.which("pg_dump") and shutil.which("pg_restore")):
        pytest.skip("pg_dump / pg_restore are not installed")
    apns, fcm = sims
    dump = tmp_path / "pushgw.dump"
    config = zulip_config(apns, fcm, tmp_path)
    config["store"] = {"url": postgres_url}
    async with GatewayHarness(config) as harness:
        server, _realm = await Env(harness, apns, fcm).ready_server()
        tokens = await register_devices(server, 3)
    dumped = await asyncio.to_thread(
        subprocess.run,
        ["pg_dump", "-Fc", "-f", str(dump), "-d", libpq_url(postgres_url)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert dumped.returncode == 0, dumped.stderr

    async with temporary_postgres_database() as target:
        restored = await asyncio.to_thread(
            subprocess.run,
            ["pg_restore", "--exit-on-error", "--no-owner", "-d", libpq_url(target), str(dump)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert restored.returncode == 0, restored.stderr
        up = await asyncio.to_thread(
            run, "-c", str(store_config(tmp_path, target)), "db", "upgrade"
        )
        assert up.returncode == 0, up.stderr
        assert up.stdout.startswith("database at head (postgresql)")

        config["store"] = {"url": target}
        async with GatewayHarness(config) as harness:
            server.client = harness.client
            status, body = await server.legacy_register(apns_token(), 1, user_id=7)
            assert status == 200, body  # the server's key came back with the dump
            async with harness.context("zulip").store.engine.connect() as conn:
                rows = await conn.execute(text("SELECT token FROM zulip_legacy_devices"))
                kept = {row[0] for row in rows}
    assert set(tokens) < kept and len(kept) == 4


# -- the documentation ---------------------------------------------------------------------


def test_the_production_example_shows_an_absolute_sqlite_path() -> None:
    """Three slashes made `var/lib/pushgw/pushgw.db` relative to the working directory:
    moved to a host whose service starts elsewhere, the gateway made a new, empty one."""
    text = (ROOT / "config" / "production.example.yaml").read_text()
    urls = [word for word in text.split() if word.startswith("sqlite+aiosqlite:")]
    shown = [u for u in urls if "/lib/" in u]
    assert shown, urls
    for url in shown:
        assert Path(make_url(url).database or "").is_absolute(), url


def test_the_backup_runbook_names_every_secret_to_keep() -> None:
    runbook = (ROOT / "docs" / "backup.md").read_text()
    for key in (
        "receipts.hmac_key_file",
        "plugins.zulip.bouncer_keys_file",
        "plugins.marmot.server_secret_key_file",
        "store.url",
        "receipts.directory",
        "-wal",
        "db backup /backup/",
        "pg_dump",
        "pg_restore",
        "pushgw zulip rehash-tokens",
    ):
        assert key in runbook, key
    assert "(docs/backup.md)" in (ROOT / "README.md").read_text()

"""Atomicity of multi-statement database work, on SQLite (the default) and PostgreSQL.

Each test injects a failure between two statements of one operation (an exception
raised by the engine just before a chosen statement runs) and checks that nothing of
the operation is left: the state is the one before it, as on PostgreSQL.

Why SQLite needs looking at: Python's sqlite3 driver (and aiosqlite over it) emits its
implicit BEGIN only before INSERT / UPDATE / DELETE. A SAVEPOINT run before any of them
starts a transaction of its own, and releasing it commits: whatever the enclosing
transaction did later could roll back, but not that. DDL never gets a BEGIN at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import event, func, inspect, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.core.store import Store
from gateway.testing import ApnsSimulator, FcmSimulator
from gateway.testing.harness import GatewayHarness
from plugins.zulip.bouncer import forget_token
from plugins.zulip.tables import e2ee_devices, legacy_devices, realms
from tests.zulip.conftest import Env, ZulipServer, apns_token, realm_dict, zulip_config


class InjectedFailure(Exception):
    """Raised in place of the statement a test chose (the database never sees it)."""


@contextlib.contextmanager
def fail_before(engine: AsyncEngine, pattern: str) -> Iterator[list[str]]:
    """Raise `InjectedFailure` instead of running the first statement matching `pattern`
    (a regular expression, case-insensitive); yields the statements seen until then."""
    seen: list[str] = []
    armed = [True]
    wanted = re.compile(pattern, re.IGNORECASE)

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen.append(statement)
        if armed[0] and wanted.search(statement):
            armed[0] = False
            raise InjectedFailure(statement.split()[0])

    event.listen(engine.sync_engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(engine.sync_engine, "before_cursor_execute", before)
    assert not armed[0], f"no statement matched {pattern!r}: {seen}"


@pytest_asyncio.fixture
async def zenv(tmp_path: Path, store_url: str) -> AsyncIterator[Env]:
    """The gateway with the zulip plugin, on SQLite and on PostgreSQL."""
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        config = zulip_config(apns, fcm, tmp_path)
        config["store"] = {"url": store_url}
        async with GatewayHarness(config) as harness:
            yield Env(harness, apns, fcm)


async def _count(engine: AsyncEngine, table: Any, *where: Any) -> int:
    async with engine.connect() as conn:
        return int(
            (await conn.execute(select(func.count()).select_from(table).where(*where))).scalar_one()
        )


# --- zulip: E2EE registration replaces the token's legacy registrations ------------------


async def test_e2ee_register_is_all_or_nothing(zenv: Env) -> None:
    """The E2EE registration of a token ends the server's legacy registrations of it
    (spec §5.1). A failure in between (here: before the DELETE) answers 500 and must
    leave neither half: on SQLite the new E2EE row had been committed by the release of
    its savepoint, so the device got both legacy and E2EE notifications."""
    server, realm = await zenv.ready_server()
    token = apns_token()
    status, body = await server.legacy_register(token, 1, user_id=7)
    assert status == 200, body
    with fail_before(zenv.engine, r"^\s*DELETE FROM zulip_legacy_devices"):
        status, body = await server.e2ee_register(realm, token)
    assert status == 500, body
    assert await _count(zenv.engine, e2ee_devices) == 0
    assert await _count(zenv.engine, legacy_devices) == 1
    # and the retry does both
    status, body = await server.e2ee_register(realm, token)
    assert status == 200, body
    assert await _count(zenv.engine, e2ee_devices) == 1
    assert await _count(zenv.engine, legacy_devices) == 0


# --- zulip: server/analytics realm upserts -----------------------------------------------


async def _upload_realms_only(server: ZulipServer, realm_uuids: list[str]) -> tuple[int, Any]:
    """An upload with nothing but `realms` (no counts, no version metadata): nothing is
    written to the server's row, so the realms' INSERT is the transaction's first write."""
    return await server.form(
        "server/analytics",
        {"realms": json.dumps([realm_dict(u) for u in realm_uuids])},
    )


async def test_analytics_upload_is_all_or_nothing(zenv: Env) -> None:
    """An upload that adds realm B and no longer lists realm A inserts B, then marks A
    deleted. A failure before the marking must leave B out too (the upload is refused
    as a whole and the server sends it again), not a half-applied list of realms."""
    server, realm_a = await zenv.ready_server()
    realm_b = str(uuid.uuid4())
    with fail_before(zenv.engine, r"^\s*UPDATE zulip_realms SET locally_deleted_at"):
        status, body = await _upload_realms_only(server, [realm_b])
    assert status == 500, body
    assert await _count(zenv.engine, realms, realms.c.uuid == realm_b) == 0
    assert await _count(zenv.engine, realms, realms.c.locally_deleted_at.is_not(None)) == 0
    status, body = await _upload_realms_only(server, [realm_b])
    assert status == 200, body
    assert await _count(zenv.engine, realms, realms.c.uuid == realm_b) == 1
    assert await _count(zenv.engine, realms, realms.c.locally_deleted_at.is_not(None)) == 1
    assert realm_a != realm_b


# --- zulip: legacy paths (one transaction already; kept so) -------------------------------


async def test_legacy_register_replacing_user_id_row_is_all_or_nothing(zenv: Env) -> None:
    """With user_id and user_uuid, the user_id registration of the token is replaced by
    the user_uuid one (zulip/zulip#24969): DELETE, then INSERT."""
    server, _ = await zenv.ready_server()
    token = apns_token()
    status, body = await server.legacy_register(token, 1, user_id=7)
    assert status == 200, body
    user_uuid = str(uuid.uuid4())
    with fail_before(zenv.engine, r"^\s*INSERT INTO zulip_legacy_devices"):
        status, body = await server.legacy_register(token, 1, user_id=7, user_uuid=user_uuid)
    assert status == 500, body
    assert await _count(zenv.engine, legacy_devices, legacy_devices.c.user_id == 7) == 1
    assert await _count(zenv.engine, legacy_devices, legacy_devices.c.user_uuid == user_uuid) == 0


async def test_legacy_notify_cleanup_is_all_or_nothing(zenv: Env) -> None:
    """A legacy notify deletes a user's duplicate user_id registrations, then gives the
    rest the realm named: both or neither."""
    server, realm = await zenv.ready_server()
    token = apns_token()
    user_uuid = str(uuid.uuid4())
    # a user_id row and a user_uuid row of one token (registered before and after 8.0),
    # both without a realm
    for ids in ({"user_id": 7}, {"user_uuid": user_uuid}):
        status, body = await server.legacy_register(token, 1, **ids)
        assert status == 200, body
    with fail_before(zenv.engine, r"^\s*UPDATE zulip_legacy_devices SET realm_id"):
        status, body = await server.json(
            "push/notify",
            {
                "user_id": 7,
                "user_uuid": user_uuid,
                "realm_uuid": realm,
                "apns_payload": {"alert": "hi"},
                "gcm_payload": {},
                "gcm_options": {},
            },
        )
    assert status == 500, body
    assert await _count(zenv.engine, legacy_devices) == 2


# --- migrations ---------------------------------------------------------------------------


FAILING_REVISION = '''"""atomictest: two tables, then a failure

Revision ID: atomictest_0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "atomictest_0001"
down_revision = None
branch_labels = ("atomictest",)
depends_on = "core_0001"


def upgrade() -> None:
    op.create_table("atomictest_a", sa.Column("id", sa.Integer, primary_key=True))
    op.add_column("pushgw_invalid_tokens", sa.Column("atomictest", sa.Integer, nullable=True))
    if FAIL:
        raise RuntimeError("injected")
    op.create_table("atomictest_b", sa.Column("id", sa.Integer, primary_key=True))


def downgrade() -> None:
    pass
'''


def _revision(directory: Path, fail: bool) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "atomictest_0001.py").write_text(f"FAIL = {fail}\n" + FAILING_REVISION)
    for cached in directory.glob("__pycache__/*"):
        cached.unlink()


async def test_failed_migration_leaves_no_half_applied_schema(
    store_url: str, tmp_path: Path
) -> None:
    """A revision that fails half way (a crash, a full disk, a bug) leaves the database
    as before it: on SQLite its first DDL had been committed statement by statement,
    the version row not, and every later start failed (`table atomictest_a already
    exists`) until someone repaired the schema by hand."""
    versions = tmp_path / "atomictest"
    _revision(versions, fail=True)
    store = Store(store_url)
    try:
        await store.upgrade()  # the core's branch
        with pytest.raises(RuntimeError, match="injected"):
            await store.upgrade([str(versions)])

        def schema(conn: Any) -> tuple[set[str], set[str]]:
            inspector = inspect(conn)
            columns = {c["name"] for c in inspector.get_columns("pushgw_invalid_tokens")}
            return set(inspector.get_table_names()), columns

        async with store.engine.connect() as conn:
            names, columns = await conn.run_sync(schema)
        assert "atomictest_a" not in names
        assert "atomictest" not in columns
        _revision(versions, fail=False)
        await store.upgrade([str(versions)])  # the fixed revision then applies
        async with store.engine.connect() as conn:
            names, columns = await conn.run_sync(schema)
            heads = set(
                (await conn.execute(text("SELECT version_num FROM alembic_version"))).scalars()
            )
        assert {"atomictest_a", "atomictest_b"} <= names
        assert "atomictest" in columns
        assert "atomictest_0001" in heads
    finally:
        await store.close()


# --- SQLite: concurrent writers -----------------------------------------------------------


async def _write_traffic(env: Env, rounds: int) -> list[tuple[int, Any]]:
    """Registrations and uploads of several servers at once: each a transaction that
    reads, then writes (some through a savepoint)."""
    servers = [await env.ready_server() for _ in range(3)]
    calls = []
    for i in range(rounds):
        server, realm = servers[i % len(servers)]
        calls.append(server.e2ee_register(realm, apns_token()))
        calls.append(server.legacy_register(apns_token(), 1, user_id=i))
        calls.append(server.analytics([realm_dict(realm), realm_dict(str(uuid.uuid4()))]))
    return list(await asyncio.gather(*calls))


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
async def test_sqlite_concurrent_writers_of_one_process(zenv: Env) -> None:
    """The pool's connections write at once: each waits for the write lock (busy
    timeout, WAL) instead of failing with `database is locked` (a 500)."""
    answers = await _write_traffic(zenv, 20)
    assert [status for status, _ in answers] == [200] * len(answers), answers


WRITER = """
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], timeout=5.0, isolation_level=None)
db.execute("PRAGMA journal_mode=WAL")
print("ready", flush=True)
writes = 0
while sys.stdin.readline().strip() == "more":
    db.execute("BEGIN IMMEDIATE")
    db.execute("UPDATE zulip_servers SET last_request_at = CURRENT_TIMESTAMP")
    db.execute("UPDATE zulip_realms SET last_request_at = CURRENT_TIMESTAMP")
    db.execute("COMMIT")
    writes += 1
    print(writes, flush=True)
"""


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
async def test_sqlite_writers_of_two_processes(zenv: Env, store_url: str) -> None:
    """Another process writing the same SQLite file (a second `pushgw serve`, a CLI
    command) while the gateway registers devices: both sides' writes all succeed."""
    path = store_url.split("///", 1)[1]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        WRITER,
        path,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert (await proc.stdout.readline()).strip() == b"ready"

        async def other_process(rounds: int) -> int:
            assert proc.stdin is not None and proc.stdout is not None
            done = 0
            for _ in range(rounds):
                proc.stdin.write(b"more\n")
                await proc.stdin.drain()
                done = int(await proc.stdout.readline())
            return done

        answers, writes = await asyncio.gather(_write_traffic(zenv, 15), other_process(60))
        assert [status for status, _ in answers] == [200] * len(answers), answers
        assert writes == 60
    finally:
        if proc.stdin is not None:
            proc.stdin.write(b"stop\n")
            proc.stdin.close()
        assert await proc.wait() == 0


# --- zulip: a dead token's registrations --------------------------------------------------


async def test_forget_token_is_all_or_nothing(zenv: Env) -> None:
    """A token-invalid answer expires the token's E2EE registrations and deletes its
    legacy ones in one transaction: a failure before the DELETE undoes the expiry too
    (the next push's answer does both)."""
    server, realm = await zenv.ready_server()
    token = apns_token()
    for status, body in (
        await server.e2ee_register(realm, token),
        await server.legacy_register(token, 1, user_id=7),
    ):
        assert status == 200, body
    with (
        fail_before(zenv.engine, r"^\s*DELETE FROM zulip_legacy_devices"),
        pytest.raises(InjectedFailure),
    ):
        await forget_token(zenv.engine, token, apns=True)
    assert await _count(zenv.engine, e2ee_devices, e2ee_devices.c.expired_at.is_(None)) == 1
    assert await _count(zenv.engine, legacy_devices) == 1

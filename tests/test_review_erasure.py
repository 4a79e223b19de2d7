"""Erasure review (a data-protection officer's seat): a device or a user asks to be
forgotten. The row going is not enough: its bytes must leave the database files, and
there must be a way to erase one device's registrations now, not after the retention.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import insert, select
from sqlalchemy.engine import make_url

from gateway.cli import main
from gateway.core.store import Store, _sqlite_pragmas, invalid_tokens
from gateway.core.tokens import sweep_invalid_tokens
from plugins.zulip import repo
from plugins.zulip.crypto import token_id_of
from plugins.zulip.tables import e2ee_devices, legacy_devices
from tests.zulip import conftest as zulip_fixtures
from tests.zulip.conftest import Env, apns_token, fcm_token

env = zulip_fixtures.env
sims = zulip_fixtures.sims


def _files(store_url: str) -> list[Path]:
    database = Path(str(make_url(store_url).database))
    return [p for p in (database, Path(f"{database}-wal")) if p.exists()]


def _on_disk(store_url: str, *values: str) -> list[str]:
    """The values whose bytes are in the database's files (any case: APNs tokens)."""
    data = b"".join(p.read_bytes() for p in _files(store_url)).lower()
    return [v for v in values if v.lower().encode() in data]


def test_sqlite_connections_zero_deleted_rows_whatever_the_build_default() -> None:
    """Debian's SQLite zeroes deleted content by default; python.org's, macOS's and most
    others leave it in free pages, where a device token in clear outlives its row."""
    conn = sqlite3.connect(":memory:")
    conn.execute("PRAGMA secure_delete=0")  # a build whose default is off
    conn.execute("PRAGMA journal_size_limit=-1")
    _sqlite_pragmas(conn, None)
    assert conn.execute("PRAGMA secure_delete").fetchone() == (1,)
    assert conn.execute("PRAGMA journal_size_limit").fetchone() == (0,)
    conn.close()


async def test_an_unregistered_token_leaves_the_database_files_by_the_next_sweep(
    env: Env,
) -> None:
    """`push/unregister` deletes the row; the token's bytes stayed in the `-wal` file (the
    frame of its insert) and, until a checkpoint, in the database file."""
    server = env.server()
    await server.register()
    token = apns_token()
    assert (await server.legacy_register(token, 1, user_id=7))[0] == 200
    store: Store = env.context.store
    async with store.engine.connect() as conn:  # the row reaches the database file too
        await conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
    assert _on_disk(store.url, token) == [token]
    data = {"token": token, "token_kind": "1", "user_id": "7"}
    assert (await server.form("push/unregister", data))[0] == 200
    await sweep_invalid_tokens(store, 30 * 86400.0)  # the core's hourly sweep
    # The gateway writes on (another device registers): the WAL starts over.
    assert (await server.legacy_register(fcm_token(), 2, user_id=8))[0] == 200
    assert _on_disk(store.url, token) == []


async def test_forget_erases_one_e2ee_device_at_once(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    """An expired or live E2EE row is otherwise kept until gc, 30 days after it expired;
    `pushgw zulip forget --realm R --token-id I` (what the Zulip server knows of the
    device) deletes it and its bytes now, and nothing of the realm's other devices."""
    server, realm = await env.ready_server()
    mine, other = apns_token(), fcm_token()
    assert (await server.e2ee_register(realm, mine))[0] == 200
    assert (await server.e2ee_register(realm, other, "fcm", ios_app_id=None))[0] == 200
    store: Store = env.context.store
    cfg = _write_config(env, store.url)
    async with env.engine.connect() as conn:
        token_id = (
            await conn.execute(select(e2ee_devices.c.token_id).where(e2ee_devices.c.token == mine))
        ).scalar_one()
    args = ["-c", str(cfg), "zulip", "forget", "--realm", realm, "--token-id"]
    # The Zulip server keeps push_token_id as an int64; the protocol carries base64.
    assert await _main([*args, str(token_id)]) == 0
    assert capsys.readouterr().out == "deleted 1 E2EE and 0 legacy registrations\n"
    assert await _main([*args, token_id_of(mine)]) == 0  # again: nothing left
    assert capsys.readouterr().out == "deleted 0 E2EE and 0 legacy registrations\n"
    async with env.engine.connect() as conn:
        left = (await conn.execute(select(e2ee_devices.c.token))).scalars().all()
    assert left == [other]
    hashes = [env.context.token_hash(mine), repo.token_key(mine, True)]
    assert await _main(["-c", str(cfg), "zulip", "forget", "--realm", realm]) == 2
    assert "--realm and --token-id go together" in capsys.readouterr().err
    assert (await server.legacy_register(fcm_token(), 2, user_id=9))[0] == 200
    assert _on_disk(store.url, mine, *hashes) == []


async def test_forget_by_token_hash_and_by_user(
    env: Env, capsys: pytest.CaptureFixture[str]
) -> None:
    server, realm = await env.ready_server()
    token, legacy = fcm_token(), apns_token()
    assert (await server.e2ee_register(realm, token, "fcm", ios_app_id=None))[0] == 200
    assert (await server.legacy_register(legacy, 1, user_id=5))[0] == 200
    cfg = _write_config(env, env.context.store.url)
    base = ["-c", str(cfg), "zulip", "forget"]
    assert await _main([*base, "--token-hash", token]) == 2  # not a hash: not echoed
    assert token not in capsys.readouterr().err
    assert await _main([*base, "--token-hash", env.context.token_hash(token)]) == 0
    assert capsys.readouterr().out == "deleted 1 E2EE and 0 legacy registrations\n"
    assert await _main([*base, "--server", server.uuid, "--user-id", "5"]) == 0
    assert capsys.readouterr().out == "deleted 0 E2EE and 1 legacy registrations\n"
    async with env.engine.connect() as conn:
        assert (await conn.execute(select(e2ee_devices))).all() == []
        assert (await conn.execute(select(legacy_devices))).all() == []


def _write_config(env: Env, store_url: str) -> Path:
    import yaml

    directory = Path(str(make_url(store_url).database)).parent
    path = directory / "forget.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "store": {"url": store_url},
                "receipts": {
                    "directory": str(directory / "receipts"),
                    **{
                        k: v
                        for k, v in env.harness.config.get("receipts", {}).items()
                        if k.startswith("hmac_key")
                    },
                },
                "plugins": {
                    "enabled": ["zulip"],
                    "zulip": {"bouncer_keys_file": str(directory / "forget-keys.json")},
                },
            }
        )
    )
    (directory / "forget-keys.json").write_text("{}")
    return path


async def _main(argv: list[str]) -> int:
    """The CLI runs its own event loop: in a thread, beside the test's."""
    import asyncio

    return await asyncio.to_thread(main, argv)


async def test_store_checkpoint_empties_the_wal_file(tmp_path: Path) -> None:
    store = Store(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}")
    try:
        await store.upgrade()
        async with store.engine.begin() as conn:
            await conn.execute(
                insert(invalid_tokens).values(
                    plugin="p", app_id="a", token_hash="f" * 64, invalidated_at=repo.now_utc()
                )
            )
        assert await store.checkpoint() is True
        assert Path(f"{tmp_path / 'x.db'}-wal").stat().st_size == 0
    finally:
        await store.close()

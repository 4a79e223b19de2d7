"""Security review of the zulip plugin's registration and analytics routes (moved here
from tests/test_review_security.py, with the fixes they asked for).

- `server/analytics`: the realm list was unbounded; past 32,767 realms the PostgreSQL
  query took too many parameters (a 500), and each realm was written by its own
  statements (10,000 realms held the write lock for seconds). Now an upload lists at
  most `analytics_max_realms` (1000) realms, else a 400 in Zulip's envelope, and the
  realm statements are bounded in number and in parameters per statement.
- `registration: allowlist` by hostname: the hostname is the registrant's claim, so
  anyone could register under it and lock the real server out. Now the allowlist holds
  server UUIDs only; a hostname entry is a config error that says what to write.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, func, select

from gateway.api import Store
from gateway.app import load_gateway
from gateway.config import ConfigError
from plugins.zulip import repo
from plugins.zulip.plugin import pushgw_migrations
from plugins.zulip.tables import realms, servers
from tests.zulip.conftest import Env, random_key

REAL_SERVER = "6cde5f7a-1f7e-4978-9716-49f69ebfc9fe"
OTHER = "0b7d9d1a-8e0a-4a57-8b8f-5f3c7f0f1a11"


async def _realm_count(env: Env) -> int:
    async with env.engine.connect() as conn:
        return int((await conn.execute(select(func.count()).select_from(realms))).scalar_one())


# --- server/analytics: realms per upload ---------------------------------------------------


async def test_analytics_with_too_many_realms_is_a_400_in_zulips_envelope(db_env: Env) -> None:
    # 33,000 realms: past asyncpg's 32,767 parameters per statement, once a 500.
    server = db_env.server()
    await server.register()
    status, body = await server.analytics([{"uuid": str(uuid.uuid4())} for _ in range(33_000)])
    assert (status, body) == (
        400,
        {
            "result": "error",
            "msg": "realms has 33000 entries: this push notification service accepts "
            "at most 1000 realms per server",
            "code": "BAD_REQUEST",
        },
    )
    assert await _realm_count(db_env) == 0


async def test_analytics_accepts_realms_up_to_the_limit(db_env: Env) -> None:
    server = db_env.server()
    await server.register()
    listed = [{"uuid": str(uuid.uuid4()), "name": f"realm {i}"} for i in range(1000)]
    status, body = await server.analytics(listed)
    assert status == 200, body
    assert len(body["realms"]) == 1000
    assert await _realm_count(db_env) == 1000
    status, body = await server.analytics([*listed, {"uuid": str(uuid.uuid4())}])
    assert status == 400 and body["code"] == "BAD_REQUEST", body
    assert "at most 1000 realms" in body["msg"]
    assert await _realm_count(db_env) == 1000


@pytest.mark.zulip_config(analytics_max_realms=40_000)
async def test_a_raised_realm_limit_past_the_parameter_limit_works(db_env: Env) -> None:
    # The duplicate check and the writes stay under the databases' parameter limits
    # whatever the limit an operator configures.
    first, second = db_env.server(), db_env.server()
    await first.register()
    await second.register()
    listed = [{"uuid": str(uuid.uuid4())} for _ in range(33_000)]
    status, body = await first.analytics(listed)
    assert status == 200, body
    assert len(body["realms"]) == 33_000
    status, body = await second.analytics(listed[-1:])
    assert (status, body["msg"]) == (400, "Duplicate registration detected."), body
    status, body = await first.analytics(listed[:10])  # the others are locally deleted
    assert status == 200, body
    async with db_env.engine.connect() as conn:
        deleted = (
            await conn.execute(
                select(func.count())
                .select_from(realms)
                .where(realms.c.locally_deleted_at.is_not(None))
            )
        ).scalar_one()
    assert deleted == 33_000 - 10


@pytest.mark.zulip_config(analytics_max_realms=2)
async def test_the_realm_limit_is_configurable(env: Env) -> None:
    server = env.server()
    await server.register()
    status, body = await server.analytics([{"uuid": str(uuid.uuid4())} for _ in range(3)])
    assert (status, body["code"]) == (400, "BAD_REQUEST"), body
    assert "at most 2 realms" in body["msg"]
    status, body = await server.analytics([{"uuid": str(uuid.uuid4())} for _ in range(2)])
    assert status == 200, body


async def test_realm_uploads_take_a_bounded_number_of_statements(store_url: str) -> None:
    # One statement (or more) per realm held the write lock for seconds at 10,000 realms.
    store = Store(store_url)
    await store.upgrade([pushgw_migrations()])
    statements: list[str] = []

    def count(*args: Any) -> None:
        statements.append(args[2])

    event.listen(store.engine.sync_engine, "before_cursor_execute", count)
    try:
        async with store.engine.begin() as conn:
            assert await repo.create_server(
                conn, REAL_SERVER, random_key(), "a.example.org", "x@example.org"
            )
            server = await repo.get_server(conn, REAL_SERVER)
        assert server is not None
        infos = [
            repo.RealmInfo(str(uuid.uuid4()), "h", f"n{i}", 0, False, False) for i in range(1200)
        ]

        async def upload(batch: list[repo.RealmInfo]) -> list[str]:
            statements.clear()
            async with store.engine.begin() as conn:
                assert not await repo.realms_of_other_servers(
                    conn, server.id, (i.uuid for i in batch)
                )
                rows = await repo.upsert_realms(conn, server.id, batch, complete=True)
            assert all(rows[i.uuid].locally_deleted_at is None for i in batch)
            return [s.split(None, 1)[0].upper() for s in statements]

        assert len(await upload(infos)) < 20
        # The same list again (every analytics run): nothing to write.
        again = await upload(infos)
        assert "UPDATE" not in again and "INSERT" not in again, again
        changed = [repo.RealmInfo(i.uuid, "h2", i.name, 1, True, False) for i in infos]
        assert len(await upload(changed)) < 20
        assert len(await upload(changed[:100])) < 20  # 1,100 marked locally deleted
        async with store.engine.connect() as conn:
            rows = (await conn.execute(select(realms).order_by(realms.c.name))).all()
        assert len(rows) == 1200
        assert all(r.host == "h2" and r.deactivated_at is not None for r in rows)
        assert sum(r.locally_deleted_at is not None for r in rows) == 1100
    finally:
        event.remove(store.engine.sync_engine, "before_cursor_execute", count)
        await store.close()


async def test_a_batch_meeting_another_servers_realm_stores_the_others(store_url: str) -> None:
    # The new realms are inserted together; when one of them turns out to be another
    # server's (claimed after the caller's duplicate check), they are inserted one at a
    # time and that one is left out of the result, which the caller turns into a 400.
    store = Store(store_url)
    await store.upgrade([pushgw_migrations()])
    try:
        async with store.engine.begin() as conn:
            ids = []
            for server_uuid, hostname in ((REAL_SERVER, "a.example.org"), (OTHER, "b.example.org")):
                assert await repo.create_server(
                    conn, server_uuid, random_key(), hostname, "x@example.org"
                )
                server = await repo.get_server(conn, server_uuid)
                assert server is not None
                ids.append(server.id)
        infos = [repo.RealmInfo(str(uuid.uuid4()), "h", "n", 0, i == 0, False) for i in range(5)]
        async with store.engine.begin() as conn:
            await repo.upsert_realms(conn, ids[1], infos[2:3], complete=False)
        async with store.engine.begin() as conn:
            rows = await repo.upsert_realms(conn, ids[0], infos, complete=True)
        assert sorted(rows) == sorted(i.uuid for i in infos if i is not infos[2])
        assert rows[infos[0].uuid].deactivated_at is not None
    finally:
        await store.close()


# --- registration: allowlist ---------------------------------------------------------------


def _load(tmp_path: Path, allowlist: list[str]) -> Any:
    return load_gateway(
        data={
            "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'db.sqlite'}"},
            "plugins": {
                "enabled": ["zulip"],
                "zulip": {"registration": "allowlist", "allowlist": allowlist},
            },
        }
    )


def test_a_hostname_allowlist_entry_is_a_config_error_saying_what_to_write(
    tmp_path: Path,
) -> None:
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, [REAL_SERVER, "chat.example.org"])
    message = str(caught.value)
    assert "plugins.zulip.allowlist" in message
    assert "'chat.example.org' is not a server UUID" in message
    assert "zulip_org_id" in message


def test_an_allowlist_entry_must_be_a_zulip_server_uuid(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a Zulip server UUID"):
        _load(tmp_path, [str(uuid.uuid1())])


@pytest.mark.zulip_config(registration="allowlist", allowlist=[REAL_SERVER.upper()])
async def test_an_impostor_cannot_take_an_allowlisted_servers_hostname(env: Env) -> None:
    impostor = env.server("chat.example.org")
    status, body = await impostor.try_register()
    assert (status, body["code"], body["msg"]) == (
        400,
        "BAD_REQUEST",
        "Registration is not open on this push notification service",
    )
    real = env.server("chat.example.org")
    real.uuid = REAL_SERVER  # listed in upper case: entries are compared canonically
    status, body = await real.try_register()
    assert (status, body) == (200, {"result": "success", "msg": "", "created": True})
    async with env.engine.connect() as conn:
        assert (await conn.execute(select(servers.c.uuid))).scalars().all() == [REAL_SERVER]

"""Review seat: a Zulip organisation leaves the bouncer and asks, under GDPR art. 17, that
everything about its server and its users be deleted. `pushgw zulip forget` erased one
device, one user or one token; a server's row, its realms and its analytics ids had no
command (deactivate + `gc --older-than 0` left the row and the realms for good, and
erased every other server's expired rows along the way).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
import yaml
from sqlalchemy import inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from gateway.cli import main
from plugins.zulip import repo
from plugins.zulip.tables import metadata
from tests.zulip import conftest as zulip_fixtures
from tests.zulip.conftest import Env, ZulipServer, apns_token, fcm_token, realm_dict

db_env = zulip_fixtures.db_env
env = zulip_fixtures.env
sims = zulip_fixtures.sims


async def _plugin_tables(engine: AsyncEngine) -> list[str]:
    """Every table of the plugin as the database has it (not as `tables.py` says), so
    that a table a later migration adds is checked without touching this test."""
    async with engine.connect() as conn:
        names = await conn.run_sync(lambda sync: inspect(sync).get_table_names())
    return sorted(n for n in names if n.startswith("zulip_"))


async def _dump(engine: AsyncEngine) -> dict[str, list[str]]:
    """Each plugin table's rows, as sorted JSON text (comparable, and greppable)."""
    dumped: dict[str, list[str]] = {}
    async with engine.connect() as conn:
        for table in await _plugin_tables(engine):
            rows = (await conn.execute(text(f'SELECT * FROM "{table}"'))).mappings().all()
            dumped[table] = sorted(json.dumps(dict(r), default=str, sort_keys=True) for r in rows)
    return dumped


def _config(tmp_path: Path, env: Env, store_url: str) -> Path:
    path = tmp_path / "erase.yaml"
    receipts = env.harness.config.get("receipts", {})
    path.write_text(
        yaml.safe_dump(
            {
                "store": {"url": store_url},
                "receipts": {
                    "directory": str(tmp_path / "erase-receipts"),
                    **{k: v for k, v in receipts.items() if k.startswith("hmac_key")},
                },
                "plugins": {"enabled": ["zulip"], "zulip": {}},
            }
        )
    )
    return path


async def _forget(config: Path, *args: str) -> int:
    """The CLI runs its own event loop: in a thread, beside the test's."""
    return await asyncio.to_thread(main, ["-c", str(config), "zulip", "forget", *args])


async def _populate(server: ZulipServer) -> list[str]:
    """Through the real endpoints: two realms and analytics ids, legacy registrations by
    user id and by UUID, E2EE ones in both realms. Returns what identifies the server."""
    await server.register()
    realms = [str(uuid.uuid4()), str(uuid.uuid4())]
    status, body = await server.analytics(
        [realm_dict(realms[0], host=server.hostname), realm_dict(realms[1], id=3)],
        realm_counts=[{"id": 41, "property": "active_users:is_bot:day", "value": 3}],
        installation_counts=[{"id": 42, "property": "active_users:is_bot:day", "value": 4}],
        realmauditlog_rows=[{"id": 43, "event_type": 101}],
    )
    assert status == 200, body
    tokens = [apns_token(), fcm_token(), apns_token(), fcm_token()]
    assert (await server.legacy_register(tokens[0], 1, user_id=7, realm_uuid=realms[0]))[0] == 200
    user_uuid = str(uuid.uuid4())
    assert (await server.legacy_register(tokens[1], 2, user_uuid=user_uuid))[0] == 200
    assert (await server.e2ee_register(realms[0], tokens[2]))[0] == 200
    assert (await server.e2ee_register(realms[1], tokens[3], "fcm", ios_app_id=None))[0] == 200
    return [server.uuid, server.hostname, user_uuid, *realms, *tokens]


async def test_forget_server_all_leaves_nothing_of_it_in_any_plugin_table(
    db_env: Env, store_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On SQLite and PostgreSQL: every row of the plugin's tables is back to what it was
    before the leaving server registered; the other server's rows are untouched."""
    staying = db_env.server()
    await _populate(staying)
    before = await _dump(db_env.engine)
    assert set(before) >= {t.name for t in metadata.sorted_tables}
    leaving = db_env.server()
    identifiers = await _populate(leaving)
    identifiers += [db_env.context.token_hash(t) for t in identifiers[5:]]
    config = _config(tmp_path, db_env, store_url)

    assert await _forget(config, "--server", leaving.uuid, "--all") == 0
    assert capsys.readouterr().out == (
        "deleted 2 E2EE and 2 legacy registrations\n"
        f"deleted server {leaving.uuid} and its 2 realms\n"
    )
    after = await _dump(db_env.engine)
    assert after == before
    held = " ".join(row for rows in after.values() for row in rows).lower()
    assert [i for i in identifiers if i.lower() in held] == []
    if store_url.startswith("sqlite"):  # the bytes left the files too (secure_delete)
        database = Path(str(make_url(store_url).database))
        files = [database, Path(f"{database}-wal")]
        data = b"".join(p.read_bytes() for p in files if p.exists()).lower()
        assert [i for i in identifiers[5:] if i.lower().encode() in data] == []

    # Its calls now fail as an unknown server's; registering again starts from nothing.
    status, body = await leaving.form("server/analytics", {"realms": "[]"})
    assert status == 401 and "is not registered" in body["msg"], body
    assert (await leaving.register())["created"] is True
    async with db_env.engine.connect() as conn:
        server = await repo.get_server(conn, leaving.uuid)
        assert server is not None and server.last_realm_count_id == 0


async def test_forget_server_all_also_erases_a_deactivated_server(
    env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`server/deactivate` keeps the rows, as Zulip's own bouncer does (gc erases the
    registrations after the retention); an erasure request is served at once anyway."""
    leaving = env.server()
    await _populate(leaving)
    assert (await leaving.form("server/deactivate"))[0] == 200
    config = _config(tmp_path, env, env.context.store.url)
    assert await _forget(config, "--server", leaving.uuid, "--all") == 0
    assert "and its 2 realms" in capsys.readouterr().out
    assert all(rows == [] for rows in (await _dump(env.engine)).values())


async def test_forget_server_needs_all_spelled_out_and_a_known_server(
    env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--server U` alone is refused (status 2): a dropped `--user-id N` must not erase an
    organisation. An unknown server is status 1, as for the other forms."""
    server = env.server()
    await _populate(server)
    before = await _dump(env.engine)
    config = _config(tmp_path, env, env.context.store.url)
    assert await _forget(config, "--server", server.uuid) == 2
    assert "--server goes with --user-id, --user-uuid or --all" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # argparse's own refusal
        await _forget(config, "--all")
    assert refused.value.code == 2
    capsys.readouterr()
    assert await _forget(config, "--server", str(uuid.uuid4()), "--all") == 1
    assert capsys.readouterr().err == "pushgw zulip: no such server\n"
    assert await _dump(env.engine) == before

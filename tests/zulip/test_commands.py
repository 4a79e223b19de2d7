"""`pushgw zulip ...` through the real CLI entry point."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select, update

from gateway.api import Store
from gateway.cli import main
from plugins.zulip import repo
from plugins.zulip.crypto import load_bouncer_keys
from plugins.zulip.plugin import pushgw_migrations
from plugins.zulip.tables import e2ee_devices, realms, servers
from tests.zulip.conftest import Env, random_key


@pytest.fixture
def config(tmp_path: Path) -> Path:
    data = {
        "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'pushgw.db'}"},
        "receipts": {"directory": str(tmp_path / "receipts")},
        "plugins": {
            "enabled": ["zulip"],
            "zulip": {"bouncer_keys_file": str(tmp_path / "keys.json")},
        },
    }
    (tmp_path / "keys.json").write_text("{}")
    path = tmp_path / "pushgw.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _db(config: Path) -> str:
    return str(yaml.safe_load(config.read_text())["store"]["url"])


def _query(config: Path, stmt: object) -> list:
    async def run() -> list:
        store = Store(_db(config))
        await store.upgrade([pushgw_migrations()])
        try:
            async with store.engine.begin() as conn:
                result = await conn.execute(stmt)  # type: ignore[arg-type]
                return list(result.all()) if result.returns_rows else []
        finally:
            await store.close()

    return asyncio.run(run())


def test_keys_generate_list_remove(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys_file = config.parent / "keys.json"
    assert main(["-c", str(config), "zulip", "keys", "generate"]) == 0
    public = capsys.readouterr().out.strip()
    assert main(["-c", str(config), "zulip", "keys", "add"]) == 0
    second = capsys.readouterr().out.strip()
    stored = json.loads(keys_file.read_text())
    assert set(stored) == {public, second}
    assert keys_file.stat().st_mode & 0o777 == 0o600
    assert set(load_bouncer_keys(stored)) == {public, second}
    assert main(["-c", str(config), "zulip", "keys", "list"]) == 0
    out = capsys.readouterr().out
    assert set(out.split()) == {public, second}
    assert all(private not in out for private in stored.values())
    assert main(["-c", str(config), "zulip", "keys", "remove", public]) == 0
    assert set(json.loads(keys_file.read_text())) == {second}
    assert main(["-c", str(config), "zulip", "keys", "remove", public]) == 1


def test_keys_generate_without_a_key_file_is_a_config_mistake(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As on config/local.yaml: keys inline, no bouncer_keys_file; --file is the way."""
    config = tmp_path / "pushgw.yaml"
    data = {
        "store": {"url": f"sqlite+aiosqlite:///{tmp_path / 'pushgw.db'}"},
        "plugins": {"enabled": ["zulip"], "zulip": {"bouncer_keys": {}}},
    }
    config.write_text(yaml.safe_dump(data))
    for command in (["generate"], ["add"], ["remove", "somekey"]):
        assert main(["-c", str(config), "zulip", "keys", *command]) == 2
        err = capsys.readouterr().err
        assert err.startswith("pushgw zulip: no key file: set plugins.zulip.bouncer_keys_file")
        assert "--file" in err and err.count("\n") == 1
    keys_file = tmp_path / "var" / "keys.json"
    assert main(["-c", str(config), "zulip", "keys", "generate", "--file", str(keys_file)]) == 0
    public = capsys.readouterr().out.strip()
    assert set(json.loads(keys_file.read_text())) == {public}


def test_add_server_disable_and_servers(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    org_id, key = str(uuid.uuid4()), random_key()
    args = [
        "-c",
        str(config),
        "zulip",
        "add-server",
        "--uuid",
        org_id,
        "--key",
        key,
        "--hostname",
        "zulip.example.org",
        "--email",
        "admin@example.org",
    ]
    assert main(args) == 0
    assert main(args) == 1  # already registered: nothing to fix in the arguments
    short_key = [*args]
    short_key[short_key.index("--key") + 1] = "short"
    assert main(short_key) == 2  # a usage error
    assert (
        main(
            [
                "-c",
                str(config),
                "zulip",
                "add-server",
                "--hostname",
                "other.example.org",
                "--email",
                "a@example.org",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "zulip_org_key = " in out
    rows = _query(config, select(servers))
    assert {r.hostname for r in rows} == {"zulip.example.org", "other.example.org"}
    assert all(key not in str(tuple(r)) for r in rows)  # stored hashed
    assert main(["-c", str(config), "zulip", "disable", "--server", org_id, "--reason", "x"]) == 0
    assert _query(config, select(servers.c.push_disabled).where(servers.c.uuid == org_id)) == [
        (True,)
    ]
    assert main(["-c", str(config), "zulip", "enable", "--server", org_id]) == 0
    assert main(["-c", str(config), "zulip", "disable", "--realm", str(uuid.uuid4())]) == 1
    assert main(["-c", str(config), "zulip", "servers"]) == 0
    assert "zulip.example.org" in capsys.readouterr().out


async def test_deactivate_frees_an_impostors_hostname(
    db_env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under `registration: open` anyone may claim a hostname; `disable` keeps the claim,
    `deactivate` ends it as the server's own `server/deactivate` would."""
    impostor = db_env.server("chat.example.org")
    assert (await impostor.try_register())[1]["created"] is True
    real = db_env.server("chat.example.org")
    status, body = await real.try_register()
    assert (status, body["code"]) == (400, "HOSTNAME_ALREADY_IN_USE_BOUNCER_ERROR")

    config = tmp_path / "cli.yaml"  # the running gateway's own configuration and store
    config.write_text(yaml.safe_dump(db_env.harness.config))

    def cli(*args: str) -> int:  # the CLI runs its own event loop: off this one
        return main(["-c", str(config), "zulip", *args])

    assert await asyncio.to_thread(cli, "deactivate", "--server", impostor.uuid) == 0
    assert capsys.readouterr().out == f"deactivated {impostor.uuid} (chat.example.org)\n"

    assert await real.try_register() == (200, {"result": "success", "msg": "", "created": True})
    status, body = await impostor.get("server/analytics/status")
    assert (status, body["code"]) == (401, "UNAUTHORIZED")
    assert body["msg"] == (
        "The mobile push notification service registration for your server has been deactivated"
    )
    status, body = await impostor.try_register()
    assert (status, body["code"]) == (401, "REALM_DEACTIVATED")

    # Again: nothing changes (gc counts from the first date); an unknown UUID: one line.
    when = select(servers.c.deactivated_at).where(servers.c.uuid == impostor.uuid)
    async with db_env.engine.connect() as conn:
        first = (await conn.execute(when)).scalar_one()
    assert first is not None
    assert await asyncio.to_thread(cli, "deactivate", "--server", impostor.uuid) == 0
    async with db_env.engine.connect() as conn:
        assert (await conn.execute(when)).scalar_one() == first
    capsys.readouterr()
    assert await asyncio.to_thread(cli, "deactivate", "--server", str(uuid.uuid4())) == 1
    assert capsys.readouterr().err == "pushgw zulip: no such server\n"


def test_disable_reason_too_long(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`disabled_reason` is VARCHAR(255): a longer reason is refused, nothing changes."""
    org_id = str(uuid.uuid4())
    base = ["-c", str(config), "zulip"]
    add = ["add-server", "--uuid", org_id, "--hostname", "z.example.org", "--email", "a@b.org"]
    assert main([*base, *add]) == 0
    capsys.readouterr()
    assert main([*base, "disable", "--server", org_id, "--reason", "x" * 256]) == 2
    assert "--reason is too long (limit: 255 characters)" in capsys.readouterr().err
    assert _query(config, select(servers.c.push_disabled).where(servers.c.uuid == org_id)) == [
        (False,)
    ]
    assert main([*base, "disable", "--server", org_id, "--reason", "x" * 255]) == 0


def test_gc(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    org_id = str(uuid.uuid4())
    assert (
        main(
            [
                "-c",
                str(config),
                "zulip",
                "add-server",
                "--uuid",
                org_id,
                "--key",
                random_key(),
                "--hostname",
                "zulip.example.org",
                "--email",
                "admin@example.org",
            ]
        )
        == 0
    )
    old = repo.now_utc() - timedelta(days=40)
    recent = repo.now_utc() - timedelta(days=2)
    [(server_id,)] = _query(config, select(servers.c.id))
    _query(
        config,
        realms.insert().values(
            server_id=server_id,
            uuid=str(uuid.uuid4()),
            host="h",
            name="n",
            deactivated=False,
            is_system_bot_realm=False,
            push_disabled=False,
            created_at=old,
        ),
    )
    [(realm_id,)] = _query(config, select(realms.c.id))
    for i, expired in enumerate((old, recent, None)):
        _query(
            config,
            e2ee_devices.insert().values(
                realm_id=realm_id,
                token_id=i,
                token=f"t{i}",
                token_kind="fcm",
                token_hash="h" * 64,
                token_key="k" * 64,
                created_at=old,
                expired_at=expired,
            ),
        )
    capsys.readouterr()
    assert main(["-c", str(config), "zulip", "gc", "--dry-run"]) == 0
    assert "would delete 1 expired E2EE registrations" in capsys.readouterr().out
    assert len(_query(config, select(e2ee_devices))) == 3
    assert main(["-c", str(config), "zulip", "gc", "--older-than", "1d"]) == 0
    assert "deleted 2 expired" in capsys.readouterr().out
    assert main(["-c", str(config), "zulip", "gc"]) == 0
    assert "deleted 0 expired" in capsys.readouterr().out
    _query(config, update(servers).values(deactivated_at=old))
    assert main(["-c", str(config), "zulip", "gc"]) == 0
    assert (
        "deleted 1 E2EE and 0 legacy registrations of deactivated servers"
        in capsys.readouterr().out
    )
    assert main(["-c", str(config), "zulip", "gc", "--older-than", "soon"]) == 2


async def test_set_key_gives_a_server_that_lost_its_key_a_new_one(
    db_env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reinstalled Zulip server without its zulip-secrets.conf: the operator gives it a
    new key; it keeps its UUID and realms, and the old key stops working."""
    server, realm = await db_env.ready_server()
    config = tmp_path / "cli.yaml"  # the running gateway's own configuration and store
    config.write_text(yaml.safe_dump(db_env.harness.config))

    def cli(*args: str) -> int:  # the CLI runs its own event loop: off this one
        return main(["-c", str(config), "zulip", *args])

    assert await asyncio.to_thread(cli, "set-key", "--server", server.uuid) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [
        f"replaced the key of {server.uuid} ({server.hostname})",
        "Put these into the Zulip server's /etc/zulip/zulip-secrets.conf:",
    ]
    assert lines[2] == f"zulip_org_id = {server.uuid}"
    new_key = lines[3].removeprefix("zulip_org_key = ")
    assert len(new_key) == 64 and new_key != server.key

    status, body = await server.get("server/analytics/status")
    assert (status, body["code"]) == (401, "UNAUTHORIZED")
    server.key = new_key
    status, body = await server.get("server/analytics/status")
    assert status == 200, body
    async with db_env.engine.connect() as conn:
        kept = (await conn.execute(select(realms.c.uuid))).scalars().all()
    assert realm in kept

    # A key of the operator's own choosing is not printed back.
    chosen = random_key()
    assert await asyncio.to_thread(cli, "set-key", "--server", server.uuid, "--key", chosen) == 0
    assert capsys.readouterr().out == f"replaced the key of {server.uuid} ({server.hostname})\n"
    server.key = chosen
    assert (await server.get("server/analytics/status"))[0] == 200


async def test_set_key_refuses_what_it_cannot_do(
    db_env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = db_env.server()
    await server.register()
    config = tmp_path / "cli.yaml"
    config.write_text(yaml.safe_dump(db_env.harness.config))

    def cli(*args: str) -> int:
        return main(["-c", str(config), "zulip", *args])

    capsys.readouterr()
    assert await asyncio.to_thread(cli, "set-key", "--server", server.uuid, "--key", "short") == 2
    assert capsys.readouterr().err == "pushgw zulip: --key must be 64 characters\n"
    assert await asyncio.to_thread(cli, "set-key", "--server", str(uuid.uuid4())) == 1
    assert capsys.readouterr().err == "pushgw zulip: no such server\n"
    assert await asyncio.to_thread(cli, "deactivate", "--server", server.uuid) == 0
    capsys.readouterr()
    assert await asyncio.to_thread(cli, "set-key", "--server", server.uuid) == 1
    assert capsys.readouterr().err == (
        "pushgw zulip: the server is deactivated; it registers again under a new zulip_org_id\n"
    )
    # Nothing changed: the old key still authenticates (as far as a deactivated server can).
    status, body = await server.get("server/analytics/status")
    assert (status, body["code"]) == (401, "UNAUTHORIZED")
    assert "deactivated" in body["msg"]

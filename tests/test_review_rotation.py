"""Rotating secrets on a live gateway: the receipts HMAC key (`receipts.hmac_key`).

Token hashes made under one key mean nothing under another. A dead-token file whose
hashes find no registration used to be reported as "retired" all the same, and Zulip
registrations made before a rotation kept their old-key hash for ever, so no dead-token
file of the new key's receipts could retire them.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from pathlib import Path

import pytest
import yaml
from sqlalchemy import select

from gateway.cli import main
from plugins.zulip.tables import e2ee_devices, legacy_devices
from tests.zulip.conftest import Env, apns_token, env, fcm_token, sims

__all__ = ["env", "sims"]  # the zulip fixtures, used here outside tests/zulip

NEW_KEY = "rotated-receipts-key-2"


def keyed(key: str, token: str) -> str:
    return hmac.new(key.encode(), token.encode(), hashlib.sha256).hexdigest()


def rotated_config(env: Env, tmp_path: Path, key: str) -> Path:
    """The running gateway's configuration and store, with another receipts key."""
    data = json.loads(json.dumps(env.harness.config, default=str))
    data["receipts"]["hmac_key"] = key
    path = tmp_path / "rotated.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def dead_file(tmp_path: Path, lines: list[tuple[str, str]]) -> Path:
    path = tmp_path / "dead-tokens.jsonl"
    path.write_text(
        "".join(
            json.dumps({"plugin": "zulip", "app_id": app, "token_hash": h, "reason": "x"}) + "\n"
            for app, h in lines
        )
    )
    return path


async def registered(env: Env) -> tuple[str, str]:
    """One E2EE APNs registration and one legacy FCM registration, under the old key."""
    server, realm = await env.ready_server()
    apns, fcm = apns_token(), fcm_token()
    status, body = await server.e2ee_register(realm, apns)
    assert status == 200, body
    status, body = await server.form(
        "push/register", {"token": fcm, "token_kind": "2", "user_id": "1"}
    )
    assert status == 200, body
    return apns, fcm


async def test_rehash_after_hmac_key_rotation_lets_new_receipts_retire_old_registrations(
    env: Env,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    register_secret: object,
) -> None:
    apns, fcm = await registered(env)
    for secret in (apns, fcm, NEW_KEY):
        register_secret(secret)  # type: ignore[operator]
    config = rotated_config(env, tmp_path, NEW_KEY)

    def cli(*args: str) -> int:  # the CLI runs its own event loop: off this one
        return main(["-c", str(config), *args])

    # Rotation step: the stored hashes are remade under the current key.
    assert await asyncio.to_thread(cli, "zulip", "rehash-tokens") == 0
    out = capsys.readouterr().out
    assert "2 registrations" in out
    for secret in (apns, fcm, NEW_KEY):
        assert secret not in out

    # A dead-token file of receipts written after the rotation now finds them.
    dead = dead_file(tmp_path, [("ios", keyed(NEW_KEY, apns)), ("android", keyed(NEW_KEY, fcm))])
    assert await asyncio.to_thread(cli, "tokens", "retire", str(dead)) == 0
    out, err = capsys.readouterr()
    assert "no registration" not in out + err
    async with env.engine.connect() as conn:
        expired = (await conn.execute(select(e2ee_devices.c.expired_at))).scalar_one()
        assert expired is not None
        assert (await conn.execute(select(legacy_devices))).all() == []


async def test_retire_says_when_hashes_match_no_registration(
    env: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hashes of another key (no rehash yet) find nothing: said, not reported as retired."""
    apns, fcm = await registered(env)
    config = rotated_config(env, tmp_path, NEW_KEY)
    dead = dead_file(tmp_path, [("ios", keyed(NEW_KEY, apns)), ("android", keyed(NEW_KEY, fcm))])
    status = await asyncio.to_thread(main, ["-c", str(config), "tokens", "retire", str(dead)])
    out, err = capsys.readouterr()
    assert status == 0  # a token already forgotten live matches nothing too: not an error
    assert "2 matched no registration" in out
    assert "receipts.hmac_key" in err
    assert apns not in out + err and fcm not in out + err
    async with env.engine.connect() as conn:  # nothing was touched
        assert (await conn.execute(select(e2ee_devices.c.expired_at))).scalar_one() is None
        assert len((await conn.execute(select(legacy_devices))).all()) == 1

    # The same file under the old key's hashes finds them (no warning).
    old = env.context.token_hash
    dead = dead_file(tmp_path, [("ios", old(apns)), ("android", old(fcm))])
    config = rotated_config(env, tmp_path, "test-receipts-key")
    status = await asyncio.to_thread(main, ["-c", str(config), "tokens", "retire", str(dead)])
    out, err = capsys.readouterr()
    assert status == 0
    assert "no registration" not in out + err
    assert "retired 2 tokens" in out

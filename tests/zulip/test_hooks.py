"""The token-invalid hook (retire path, by hash) and the periodic GC service."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from gateway.api import InvalidToken
from plugins.zulip import repo
from plugins.zulip.plugin import pushgw_token_invalid
from plugins.zulip.tables import e2ee_devices, legacy_devices
from tests.zulip.conftest import IOS_APP_ID, Env, apns_token, fcm_token


async def test_retire_by_hash(env: Env) -> None:
    server, realm = await env.ready_server()
    apns, fcm = apns_token(), fcm_token()
    await server.e2ee_register(realm, apns)
    await server.form("push/register", {"token": fcm, "token_kind": "2", "user_id": "1"})
    await server.form(
        "push/register",
        {"token": apns.lower(), "token_kind": "1", "user_id": "2", "ios_app_id": IOS_APP_ID},
    )
    for token in (apns, fcm):
        await pushgw_token_invalid(
            env.context,
            InvalidToken(
                plugin="zulip",
                app_id="x",
                token_hash=env.context.token_hash(token),
                token=None,
                provider=None,
                reason="retired",
            ),
        )
    async with env.engine.connect() as conn:
        assert (await conn.execute(select(e2ee_devices.c.expired_at))).one()[0] is not None
        assert (await conn.execute(select(legacy_devices))).all() == []


@pytest.mark.zulip_config(gc_interval=0.2, gc_older_than=3600)
async def test_periodic_gc(env: Env) -> None:
    server, realm = await env.ready_server()
    await server.e2ee_register(realm, apns_token())
    async with env.engine.begin() as conn:
        await conn.execute(
            update(e2ee_devices).values(expired_at=repo.now_utc() - timedelta(hours=2))
        )
    for _ in range(50):
        await asyncio.sleep(0.1)
        async with env.engine.connect() as conn:
            if (await conn.execute(select(e2ee_devices))).first() is None:
                return
    raise AssertionError("the periodic GC did not run")

"""Review of the legacy (plaintext) bouncer API's behaviour (specs/zulip.md §4, §6, §8).

Each test here first failed against the code it fixes, or pins a behaviour of the legacy
flows that test_legacy.py does not cover (several servers sharing a phone's token).
"""

from __future__ import annotations

import uuid
from datetime import timedelta

from sqlalchemy import select

from gateway.testing import FcmResponse
from plugins.zulip import repo
from plugins.zulip.tables import legacy_devices
from tests.zulip.conftest import Env, apns_token, fcm_token


async def _tokens(env: Env) -> list[str]:
    async with env.engine.connect() as conn:
        rows = (await conn.execute(select(legacy_devices.c.token))).all()
    return sorted(r.token for r in rows)


async def test_unregister_with_another_servers_realm_is_refused(env: Env) -> None:
    # §4: legacy routes that send realm_uuid look the realm up (unknown tolerated), and a
    # realm of another server is 403 REMOTE_REALM_SERVER_MISMATCH_ERROR, as Zulip's
    # unregister and unregister/all answer before deleting anything. pushgw ignored it.
    server, _ = await env.ready_server()
    _, other_realm = await env.ready_server()
    user_uuid = str(uuid.uuid4())
    token = fcm_token()
    assert (await server.legacy_register(token, 2, user_uuid=user_uuid))[0] == 200
    for endpoint, data in (
        ("push/unregister", {"token": token, "token_kind": "2"}),
        ("push/unregister/all", {}),
    ):
        status, body = await server.form(
            endpoint, {**data, "user_uuid": user_uuid, "realm_uuid": other_realm}
        )
        assert (status, body["code"]) == (403, "REMOTE_REALM_SERVER_MISMATCH_ERROR"), endpoint
    assert await _tokens(env) == [token]  # nothing deleted
    # An unknown realm is tolerated, as on push/register.
    data = {"token": token, "token_kind": "2", "user_uuid": user_uuid}
    status, _ = await server.form("push/unregister", {**data, "realm_uuid": str(uuid.uuid4())})
    assert status == 200
    assert await _tokens(env) == []


async def test_notify_attaches_the_realm_so_gc_collects_its_registrations(db_env: Env) -> None:
    env = db_env
    # A registration made without realm_uuid (a server before 8.0, or a realm not yet
    # uploaded) had no realm for ever: `gc` never collected it once its realm was deleted
    # (§8). Zulip's bouncer attaches the realm named by a later notify; so does pushgw now.
    server, realm = await env.ready_server()
    user_uuid = str(uuid.uuid4())
    token = fcm_token()
    assert (await server.legacy_register(token, 2, user_id=5, user_uuid=user_uuid))[0] == 200
    status, resp = await server.json(
        "push/notify",
        {
            "user_id": 5,
            "user_uuid": user_uuid,
            "realm_uuid": realm,
            "gcm_payload": {"event": "message"},
            "gcm_options": {"priority": "high"},
            "android_devices": [token],
        },
    )
    assert status == 200 and resp["total_android_devices"] == 1, resp
    # The server then deletes the realm: its upload no longer lists it.
    status, _ = await server.analytics([])
    assert status == 200
    async with env.engine.begin() as conn:
        counts = await repo.collect_garbage(conn, repo.now_utc() + timedelta(days=1))
    assert counts.legacy_of_gone_realms == 1
    assert await _tokens(env) == []


async def test_notify_does_not_attach_another_servers_realm(env: Env) -> None:
    # The attach above only ever uses a realm of the calling server (another's is a 403
    # before anything is read or written).
    server, _ = await env.ready_server()
    _, other_realm = await env.ready_server()
    user_uuid = str(uuid.uuid4())
    token = fcm_token()
    await server.legacy_register(token, 2, user_uuid=user_uuid)
    status, resp = await server.json(
        "push/notify", {"user_uuid": user_uuid, "realm_uuid": other_realm}
    )
    assert (status, resp["code"]) == (403, "REMOTE_REALM_SERVER_MISMATCH_ERROR")
    async with env.engine.connect() as conn:
        assert (await conn.execute(select(legacy_devices.c.realm_id))).scalar_one() is None


async def test_token_invalid_on_one_server_is_reported_to_the_other(env: Env) -> None:
    # One phone logged in to two Zulip servers has one token registered by both. A
    # provider's UNREGISTERED seen through server A deletes it for every server (§6
    # Outcomes), and server B's next notify, without any provider call, reports it in
    # deleted_devices; neither server can unregister the other's registration.
    server_a, _ = await env.ready_server()
    server_b, _ = await env.ready_server()
    shared, apple = fcm_token(), apns_token()
    await server_a.legacy_register(shared, 2, user_id=1)
    await server_b.legacy_register(shared, 2, user_id=1)
    await server_b.legacy_register(apple, 1, user_id=1)
    status, body = await server_a.form(
        "push/unregister", {"token": apple, "token_kind": "1", "user_id": "1"}
    )
    assert (status, body["msg"]) == (400, "Token does not exist")
    assert await _tokens(env) == sorted([shared, shared, apple])

    env.fcm.script(shared, FcmResponse.unregistered())
    notify = {"user_id": 1, "gcm_payload": {"event": "message"}, "android_devices": [shared]}
    status, resp = await server_a.json("push/notify", notify)
    assert status == 200, resp
    assert resp["deleted_devices"] == {"android_devices": [shared], "apple_devices": []}
    assert await _tokens(env) == [apple]
    sent = len(env.fcm.requests)
    status, resp = await server_b.json(
        "push/notify",
        {**notify, "apns_payload": {"alert": "x"}, "apple_devices": [apple.lower()]},
    )
    assert status == 200, resp
    assert (resp["total_android_devices"], resp["total_apple_devices"]) == (0, 1)
    assert resp["deleted_devices"] == {"android_devices": [shared], "apple_devices": []}
    assert len(env.fcm.requests) == sent

"""Black-box: the legacy (plaintext) API (specs/zulip.md §6)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from sqlalchemy import select

from gateway.testing import ApnsResponse, FcmResponse
from plugins.zulip.tables import legacy_devices
from tests.zulip.conftest import IOS_APP_ID, Env, apns_token, fcm_token


async def _rows(env: Env) -> list[Any]:
    async with env.engine.connect() as conn:
        return list((await conn.execute(select(legacy_devices))).all())


@pytest.mark.parametrize(
    ("data", "msg", "code"),
    [
        (
            {"token_kind": "1", "user_id": "1"},
            "Missing 'token' argument",
            "REQUEST_VARIABLE_MISSING",
        ),
        (
            {"token": "ab", "user_id": "1"},
            "Missing 'token_kind' argument",
            "REQUEST_VARIABLE_MISSING",
        ),
        ({"token": "ab", "token_kind": "3", "user_id": "1"}, "Invalid token type", "BAD_REQUEST"),
        (
            {"token": "", "token_kind": "2", "user_id": "1"},
            "Empty or invalid length token",
            "BAD_REQUEST",
        ),
        (
            {"token": "x" * 4097, "token_kind": "2", "user_id": "1"},
            "Empty or invalid length token",
            "BAD_REQUEST",
        ),
        (
            {"token": "xyz", "token_kind": "1", "user_id": "1", "ios_app_id": "a"},
            "Invalid APNS token",
            "BAD_REQUEST",
        ),
        ({"token": "abcd", "token_kind": "1", "user_id": "1"}, "Missing ios_app_id", "BAD_REQUEST"),
        ({"token": "abcd", "token_kind": "2"}, "Missing user_id or user_uuid", "BAD_REQUEST"),
    ],
)
async def test_register_errors(env: Env, data: dict, msg: str, code: str) -> None:
    server = env.server()
    await server.register()
    status, body = await server.form("push/register", data)
    assert (status, body["msg"], body["code"]) == (400, msg, code)
    assert await _rows(env) == []


async def test_register_unregister_cycle(db_env: Env) -> None:
    env = db_env
    server = env.server()
    await server.register()
    token = apns_token()
    assert (await server.legacy_register(token, 1, user_id=7))[0] == 200
    assert (await server.legacy_register(token.lower(), 1, user_id=7))[0] == 200  # case-insensitive
    assert len(await _rows(env)) == 1
    user_uuid = str(uuid.uuid4())
    assert (await server.legacy_register(token, 1, user_id=7, user_uuid=user_uuid))[0] == 200
    assert [(r.user_id, r.user_uuid) for r in await _rows(env)] == [(None, user_uuid)]
    data = {"token": token.lower(), "token_kind": "1", "user_id": "7", "user_uuid": user_uuid}
    assert (await server.form("push/unregister", data))[0] == 200
    status, body = await server.form("push/unregister", data)
    assert (status, body["msg"]) == (400, "Token does not exist")
    for t in (fcm_token(), fcm_token()):
        await server.legacy_register(t, 2, user_id=9)
    status, body = await server.form("push/unregister/all", {"user_id": "9"})
    assert status == 200 and await _rows(env) == []
    assert (await server.form("push/unregister/all", {"user_id": "9"}))[0] == 200
    status, body = await server.form("push/unregister/all", {})
    assert (status, body["msg"]) == (400, "Missing user_id or user_uuid")


async def test_register_with_other_servers_realm(env: Env) -> None:
    server, _ = await env.ready_server()
    _, other_realm = await env.ready_server()
    status, body = await server.legacy_register(
        fcm_token(), 2, user_uuid=str(uuid.uuid4()), realm_uuid=other_realm
    )
    assert (status, body["code"]) == (403, "REMOTE_REALM_SERVER_MISMATCH_ERROR")
    status, _ = await server.legacy_register(
        fcm_token(), 2, user_uuid=str(uuid.uuid4()), realm_uuid=str(uuid.uuid4())
    )
    assert status == 200  # unknown realms are tolerated


async def test_notify(env: Env) -> None:
    server, realm = await env.ready_server()
    user_uuid = str(uuid.uuid4())
    apns, fcm = apns_token(), fcm_token()
    await server.legacy_register(apns, 1, user_id=5)
    await server.legacy_register(apns, 1, user_uuid=user_uuid)  # same token under both ids
    await server.legacy_register(fcm, 2, user_uuid=user_uuid)
    ids = ",".join(str(i) for i in range(1, 250))
    gone = fcm_token()
    body = {
        "user_id": 5,
        "user_uuid": user_uuid,
        "realm_uuid": realm,
        "apns_payload": {
            "alert": {"title": "t"},
            "badge": 0,
            "custom": {"zulip": {"event": "remove", "zulip_message_ids": ids}},
        },
        "gcm_payload": {
            "event": "remove",
            "zulip_message_ids": ids,
            "server": "x",
            "id": 3,
            "flag": True,
        },
        "gcm_options": {},
        "android_devices": [fcm, gone, "b-" + gone],
        "apple_devices": [apns.lower()],
    }
    status, resp = await server.json("push/notify", body)
    assert status == 200, resp
    assert resp == {
        "result": "success",
        "msg": "",
        "total_android_devices": 1,
        "total_apple_devices": 1,
        "deleted_devices": {"android_devices": sorted([gone, "b-" + gone]), "apple_devices": []},
        "realm": {"can_push": True, "expected_end_timestamp": None},
    }
    [a] = env.apns.requests_for(apns)
    kept = ",".join(str(i) for i in range(50, 250))
    assert a.json == {
        "zulip": {"event": "remove", "zulip_message_ids": kept},
        "aps": {"alert": {"title": "t"}, "badge": 0},
    }
    assert a.headers["apns-topic"] == IOS_APP_ID
    assert abs(int(a.headers["apns-expiration"]) - (time.time() + 86400)) < 60
    assert "apns-priority" not in a.headers and "apns-push-type" not in a.headers
    [f] = env.fcm.requests_for(fcm)
    assert f.message["data"] == {
        "event": "remove",
        "zulip_message_ids": kept,
        "server": "x",
        "id": "3",
        "flag": "True",
    }
    assert f.message["android"] == {"priority": "normal"}
    assert len(await _rows(env)) == 2  # the user_id duplicate was dropped


async def test_notify_invalid_tokens_deleted(env: Env) -> None:
    server, _ = await env.ready_server()
    apns, fcm, ok = apns_token(), fcm_token(), fcm_token()
    await server.legacy_register(apns, 1, user_id=1)
    await server.legacy_register(fcm, 2, user_id=1)
    await server.legacy_register(ok, 2, user_id=1)
    env.apns.script(apns, ApnsResponse.error("BadDeviceToken"))
    env.fcm.script(fcm, FcmResponse.unregistered())
    status, resp = await server.json(
        "push/notify",
        {
            "user_id": 1,
            "gcm_payload": {"event": "message"},
            "apns_payload": {"alert": "x"},
            "android_devices": [fcm, ok],
            "apple_devices": [apns],
        },
    )
    assert status == 200
    assert (resp["total_android_devices"], resp["total_apple_devices"]) == (2, 1)
    assert resp["deleted_devices"] == {"android_devices": [fcm], "apple_devices": [apns]}
    assert resp["realm"] is None
    assert [r.token for r in await _rows(env)] == [ok]
    assert env.fcm.requests_for(ok)[0].message["android"]["priority"] == "high"


@pytest.mark.parametrize(
    ("options", "msg"),
    [
        ({"priority": "x"}, "Invalid GCM option to bouncer: priority 'x'"),
        ({"foo": 1}, 'Invalid GCM options to bouncer: {"foo":1}'),
    ],
)
async def test_notify_gcm_options(env: Env, options: dict, msg: str) -> None:
    server, _ = await env.ready_server()
    await server.legacy_register(fcm_token(), 2, user_id=1)
    status, resp = await server.json(
        "push/notify", {"user_id": 1, "gcm_payload": {"event": "message"}, "gcm_options": options}
    )
    assert (status, resp["msg"]) == (400, msg)
    assert env.fcm.requests == []


async def test_test_notification(env: Env) -> None:
    server, _realm = await env.ready_server()
    apns, fcm = apns_token(), fcm_token()
    await server.legacy_register(apns, 1, user_id=1)
    await server.legacy_register(fcm, 2, user_id=1)
    base = {"realm_name": "Example", "realm_uri": "https://chat.example.org", "user_id": 1}
    status, resp = await server.json(
        "push/test_notification",
        {
            "token": fcm_token(),
            "token_kind": 2,
            "user_id": 1,
            "user_uuid": None,
            "base_payload": base,
        },
    )
    assert (status, resp["code"], resp["msg"]) == (
        400,
        "INVALID_REMOTE_PUSH_DEVICE_TOKEN",
        "Device not recognized by the push bouncer",
    )
    status, resp = await server.json(
        "push/test_notification",
        {
            "token": apns.lower(),
            "token_kind": 1,
            "user_id": 1,
            "user_uuid": None,
            "base_payload": base,
        },
    )
    assert status == 200, resp
    [a] = env.apns.requests_for(apns)
    assert a.json["aps"] == {
        "alert": {
            "title": "Test notification",
            "body": "This is a test notification from Example (https://chat.example.org).",
        },
        "sound": "default",
    }
    assert a.json["zulip"]["event"] == "test"
    status, _ = await server.json(
        "push/test_notification",
        {"token": fcm, "token_kind": 2, "user_id": 1, "user_uuid": None, "base_payload": base},
    )
    [f] = env.fcm.requests_for(fcm)
    assert f.message["android"]["priority"] == "high"
    assert abs(int(f.message["data"]["time"]) - time.time()) < 60
    status, resp = await server.json(
        "push/test_notification",
        {"token": fcm, "token_kind": 2, "user_id": 1, "base_payload": base, "extra": 1},
    )
    assert status == 400


async def test_notify_disallowed(env: Env) -> None:
    from plugins.zulip import repo

    server, realm = await env.ready_server()
    user_uuid = str(uuid.uuid4())
    async with env.engine.begin() as conn:
        await repo.set_server_disabled(conn, server.uuid, True, "unpaid")
    status, resp = await server.json("push/notify", {"user_uuid": user_uuid, "realm_uuid": realm})
    assert (status, resp["code"]) == (400, "PUSH_NOTIFICATIONS_DISALLOWED")


@pytest.mark.zulip_config(legacy_api=False)
async def test_legacy_api_off(env: Env) -> None:
    server, realm = await env.ready_server()
    status, resp = await server.legacy_register(fcm_token(), 2, user_id=1)
    assert (status, resp["msg"]) == (
        400,
        "This push notification service only relays end-to-end encrypted notifications",
    )
    status, resp = await server.json(
        "push/notify",
        {
            "user_id": 1,
            "gcm_payload": {"event": "message"},
            "android_devices": ["b", "a"],
            "apple_devices": ["ff"],
        },
    )
    assert status == 200
    assert resp["deleted_devices"] == {"android_devices": ["a", "b"], "apple_devices": ["ff"]}
    assert (resp["total_android_devices"], resp["total_apple_devices"]) == (0, 0)
    assert env.fcm.requests == [] and env.apns.requests == []
    assert (await server.e2ee_register(realm, apns_token()))[0] == 200

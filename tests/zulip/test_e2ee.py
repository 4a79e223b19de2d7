"""Black-box: E2EE register and notify (specs/zulip.md §5), providers simulated."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

import pytest
from sqlalchemy import select

from gateway.testing import ApnsResponse, FcmResponse
from gateway.testing.harness import GatewayHarness
from plugins.zulip import repo
from plugins.zulip.crypto import (
    decrypt_content,
    encrypt_content,
    generate_push_key,
    seal_registration,
    token_id_of,
)
from plugins.zulip.tables import e2ee_devices, legacy_devices
from tests.zulip.conftest import (
    IOS_APP_ID,
    VECTOR,
    VECTOR_KEY,
    Env,
    apns_token,
    fcm_token,
    registration_plaintext,
    zulip_config,
)

INVALID = "Invalid encrypted_push_registration"


async def _devices(env: Env) -> list[Any]:
    async with env.engine.connect() as conn:
        return list((await conn.execute(select(e2ee_devices).order_by(e2ee_devices.c.id))).all())


def _apns_request(token: str, push_key: bytes, content: dict[str, Any], **over: Any) -> dict:
    aps = {"mutable-content": 1, "alert": {"title": "New notification"}, "sound": "default"}
    req = {
        "token_id": token_id_of(token),
        "http_headers": {"apns_priority": 10, "apns_push_type": "alert"},
        "payload": {
            "push_key_id": 10,
            "encrypted_data": encrypt_content(push_key, content),
            "aps": aps,
        },
    }
    req.update(over)
    return req


def _fcm_request(
    token: str, push_key: bytes, content: dict[str, Any], priority: str = "high"
) -> dict:
    return {
        "token_id": token_id_of(token),
        "fcm_priority": priority,
        "payload": {"push_key_id": 20, "encrypted_data": encrypt_content(push_key, content)},
    }


async def test_register_apns_and_fcm_idempotent(db_env: Env, register_secret: Any) -> None:
    env = db_env
    server, realm = await env.ready_server()
    apns, fcm = apns_token(), fcm_token()
    register_secret(apns)
    register_secret(fcm)
    for _ in range(2):
        assert await server.e2ee_register(realm, apns) == (200, {"result": "success", "msg": ""})
        assert (await server.e2ee_register(realm, fcm, "fcm", ios_app_id=None))[0] == 200
    rows = await _devices(env)
    assert [(r.token_kind, r.ios_app_id) for r in rows] == [("apns", IOS_APP_ID), ("fcm", None)]
    # the int64 form of the vector token
    assert (await server.e2ee_register(realm, "c0ffee"))[0] == 200
    assert (await _devices(env))[-1].token_id == -359574906294109112


async def test_register_errors_change_nothing(env: Env) -> None:
    server, realm = await env.ready_server()
    _other, other_realm = await env.ready_server()
    token = apns_token()
    two_days_ago = int(time.time()) - 2 * 86400
    cases: list[tuple[dict[str, Any], int, str, str]] = [
        (
            {"realm_uuid": str(uuid.uuid4())},
            403,
            "MISSING_REMOTE_REALM",
            "Organization not registered",
        ),
        (
            {"realm_uuid": other_realm},
            403,
            "REMOTE_REALM_SERVER_MISMATCH_ERROR",
            "Your organization is registered to a different Zulip server. Please contact Zulip "
            "support for assistance in resolving this issue.",
        ),
        ({"timestamp": two_days_ago}, 400, "REQUEST_EXPIRED", "Request expired"),
        ({"token_id": "192057"}, 400, "BAD_REQUEST", INVALID),
        ({"token_id": token_id_of("other")}, 400, "BAD_REQUEST", INVALID),
        ({"ios_app_id": "* -- +"}, 400, "BAD_REQUEST", INVALID),
        ({"ios_app_id": None}, 400, "BAD_REQUEST", INVALID),
        (
            {"plaintext": registration_plaintext(token, "xyz", IOS_APP_ID)},
            400,
            "BAD_REQUEST",
            INVALID,
        ),
        (
            {"plaintext": registration_plaintext("f" * 64, "fcm", "a.b")},
            400,
            "BAD_REQUEST",
            INVALID,
        ),
        ({"plaintext": registration_plaintext("", "fcm", None)}, 400, "BAD_REQUEST", INVALID),
        (
            {"plaintext": registration_plaintext("zz" * 32, "apns", IOS_APP_ID)},
            400,
            "BAD_REQUEST",
            INVALID,
        ),
        ({"plaintext": b"not json"}, 400, "BAD_REQUEST", INVALID),
    ]
    for over, status, code, msg in cases:
        realm_uuid = over.pop("realm_uuid", realm)
        got, body = await server.e2ee_register(realm_uuid, token, **over)
        assert (got, body["code"], body["msg"]) == (status, code, msg), over
    # not a sealed box / not base64 / key problems
    base = {
        "realm_uuid": realm,
        "token_id": token_id_of(token),
        "bouncer_public_key": VECTOR_KEY["public_key"],
    }
    for garbage in (
        "not-base64!!",
        "AAAA",
        seal_registration(VECTOR["official-app-bouncer-key"]["public_key"], b"{}"),
    ):
        got, body = await server.form(
            "push/e2ee/register", {**base, "encrypted_push_registration": garbage}
        )
        assert (got, body["msg"]) == (400, INVALID)
    for key in ("invalid public key", VECTOR["official-app-bouncer-key"]["public_key"]):
        got, body = await server.e2ee_register(realm, token, public_key=VECTOR_KEY["public_key"])
        assert got == 200
        got, body = await server.form(
            "push/e2ee/register",
            {**base, "bouncer_public_key": key, "encrypted_push_registration": "AAAA"},
        )
        assert (got, body["code"], body["msg"]) == (
            400,
            "INVALID_BOUNCER_PUBLIC_KEY",
            "Invalid bouncer_public_key",
        )
    got, body = await server.form("push/e2ee/register", {"realm_uuid": realm})
    assert body["code"] == "REQUEST_VARIABLE_MISSING"
    assert len(await _devices(env)) == 1  # only the one good registration above


async def test_vector_registration_is_expired(env: Env) -> None:
    server, realm = await env.ready_server()
    vec = VECTOR["sealed-registration"]
    status, body = await server.form(
        "push/e2ee/register",
        {
            "realm_uuid": realm,
            "token_id": vec["token_id"],
            "encrypted_push_registration": vec["encrypted_push_registration"],
            "bouncer_public_key": vec["to_public_key"],
        },
    )
    assert (status, body["code"]) == (400, "REQUEST_EXPIRED")


async def test_register_removes_legacy_token_case_insensitively(env: Env) -> None:
    server, realm = await env.ready_server()
    token = apns_token()
    status, _ = await server.form(
        "push/register",
        {
            "user_uuid": str(uuid.uuid4()),
            "token": token.lower(),
            "token_kind": "1",
            "ios_app_id": IOS_APP_ID,
        },
    )
    assert status == 200
    assert (await server.e2ee_register(realm, token.upper()))[0] == 200
    async with env.engine.connect() as conn:
        assert (await conn.execute(select(legacy_devices))).first() is None


async def test_notify_both_platforms(db_env: Env) -> None:
    env = db_env
    server, realm = await env.ready_server()
    apns, fcm = apns_token(), fcm_token()
    await server.e2ee_register(realm, apns)
    await server.e2ee_register(realm, fcm, "fcm", ios_app_id=None)
    push_key = generate_push_key()
    content = {"type": "test", "realm_name": "Example", "user_id": 10, "time": 1754577820}
    apns_req = _apns_request(apns, push_key, content)
    status, body = await server.json(
        "push/e2ee/notify",
        {"realm_uuid": realm, "push_requests": [apns_req, _fcm_request(fcm, push_key, content)]},
    )
    assert status == 200, body
    assert body == {
        "result": "success",
        "msg": "",
        "apple_successfully_sent_count": 1,
        "android_successfully_sent_count": 1,
        "delete_token_ids": [],
        "realm_push_status": {"can_push": True, "expected_end_timestamp": None},
    }
    [a] = env.apns.requests_for(apns)
    assert a.headers["apns-topic"] == IOS_APP_ID
    assert a.headers["apns-priority"] == "10" and a.headers["apns-push-type"] == "alert"
    assert "apns-expiration" not in a.headers and "apns-collapse-id" not in a.headers
    assert a.json == apns_req["payload"] and isinstance(a.json["push_key_id"], int)
    assert json.loads(decrypt_content(push_key, a.json["encrypted_data"])) == content
    [f] = env.fcm.requests_for(fcm)
    assert f.message["data"]["push_key_id"] == "20"
    assert f.message["android"] == {"priority": "high"}
    assert "notification" not in f.message
    assert json.loads(decrypt_content(push_key, f.message["data"]["encrypted_data"])) == content


async def test_notify_remove_style_and_default_aps(env: Env) -> None:
    server, realm = await env.ready_server()
    apns, fcm = apns_token(), fcm_token()
    await server.e2ee_register(realm, apns)
    await server.e2ee_register(realm, fcm, "fcm", ios_app_id=None)
    key = generate_push_key()
    req = _apns_request(
        apns,
        key,
        {"type": "remove"},
        http_headers={"apns_priority": 5, "apns_push_type": "background"},
    )
    del req["payload"]["aps"]
    status, body = await server.json(
        "push/e2ee/notify",
        {
            "realm_uuid": realm,
            "push_requests": [req, _fcm_request(fcm, key, {"type": "remove"}, "normal")],
        },
    )
    assert status == 200 and body["apple_successfully_sent_count"] == 1
    [a] = env.apns.requests_for(apns)
    assert (a.headers["apns-priority"], a.headers["apns-push-type"]) == ("5", "background")
    assert a.json["aps"] == {"mutable-content": 1, "alert": {"title": "New notification"}}
    assert env.fcm.requests_for(fcm)[0].message["android"]["priority"] == "normal"


@pytest.mark.parametrize(
    "apns_reason", ["Unregistered", "BadDeviceToken", "DeviceTokenNotForTopic", "ExpiredToken"]
)
async def test_notify_invalid_tokens(env: Env, apns_reason: str) -> None:
    server, realm = await env.ready_server()
    apns, fcm, fcm_bad = apns_token(), fcm_token(), fcm_token()
    for token, kind in ((apns, "apns"), (fcm, "fcm"), (fcm_bad, "fcm")):
        await server.e2ee_register(
            realm, token, kind, ios_app_id=IOS_APP_ID if kind == "apns" else None
        )
    env.apns.script(apns, ApnsResponse.error(apns_reason))
    env.fcm.script(fcm, FcmResponse.unregistered())
    env.fcm.script(fcm_bad, FcmResponse.internal())
    key = generate_push_key()
    reqs = [
        _apns_request(apns, key, {}),
        _fcm_request(fcm, key, {}),
        _fcm_request(fcm_bad, key, {}),
        {**_fcm_request(fcm, key, {}), "token_id": "AAAAAAAAAAI="},
    ]
    status, body = await server.json(
        "push/e2ee/notify", {"realm_uuid": realm, "push_requests": reqs}
    )
    assert status == 200, body
    assert sorted(body["delete_token_ids"]) == sorted(
        [token_id_of(apns), token_id_of(fcm), "AAAAAAAAAAI="]
    )
    assert body["apple_successfully_sent_count"] == body["android_successfully_sent_count"] == 0
    rows = {r.token: r for r in await _devices(env)}
    assert rows[apns].expired_at is not None and rows[fcm].expired_at is not None
    assert rows[fcm_bad].expired_at is None
    sent = len(env.apns.requests) + len(env.fcm.requests)
    env.fcm.clear_scripts()
    status, body = await server.json(
        "push/e2ee/notify", {"realm_uuid": realm, "push_requests": reqs[:2]}
    )
    assert sorted(body["delete_token_ids"]) == sorted([token_id_of(apns), token_id_of(fcm)])
    assert len(env.apns.requests) + len(env.fcm.requests) == sent  # no provider call
    # registering again brings the token back (pushgw divergence)
    assert (await server.e2ee_register(realm, apns))[0] == 200
    assert (await _devices(env))[0].expired_at is None


async def test_notify_realm_errors(env: Env) -> None:
    server, realm = await env.ready_server()
    status, body = await server.json(
        "push/e2ee/notify", {"realm_uuid": str(uuid.uuid4()), "push_requests": []}
    )
    assert (status, body["code"]) == (403, "MISSING_REMOTE_REALM")
    async with env.engine.begin() as conn:
        await repo.set_realm_disabled(conn, realm, True, "suspended")
    status, body = await server.json("push/e2ee/notify", {"realm_uuid": realm, "push_requests": []})
    assert (status, body["code"]) == (400, "PUSH_NOTIFICATIONS_DISALLOWED")
    assert body["msg"] == (
        "Your plan doesn't allow sending push notifications. "
        "Reason provided by the server: suspended"
    )
    status, body = await server.analytics([{"uuid": realm, "host": "h", "deactivated": False}])
    assert body["realms"][realm]["can_push"] is False


async def test_notify_bad_bodies(env: Env) -> None:
    server, realm = await env.ready_server()
    resp = await env.client.post(
        "/api/v1/remotes/push/e2ee/notify",
        data=b"{not json",
        headers={**server.auth, "Content-Type": "application/json"},
    )
    assert resp.status == 400 and (await resp.json())["code"] == "BAD_REQUEST"
    status, body = await server.json(
        "push/e2ee/notify",
        {
            "realm_uuid": realm,
            "push_requests": [
                {
                    "token_id": "192057",
                    "fcm_priority": "high",
                    "payload": {"push_key_id": 1, "encrypted_data": ""},
                }
            ],
        },
    )
    assert (status, body["msg"]) == (400, "`token_id` is not Base64 encoded")


async def test_notify_kind_mismatch_is_skipped(env: Env) -> None:
    server, realm = await env.ready_server()
    fcm = fcm_token()
    await server.e2ee_register(realm, fcm, "fcm", ios_app_id=None)
    req = _apns_request(fcm, generate_push_key(), {})
    status, body = await server.json(
        "push/e2ee/notify", {"realm_uuid": realm, "push_requests": [req]}
    )
    assert status == 200
    assert (body["apple_successfully_sent_count"], body["delete_token_ids"]) == (0, [])
    assert env.fcm.requests == [] and env.apns.requests == []


@pytest.mark.zulip_config(notify_deadline=1.0)
async def test_slow_provider_answers_within_deadline(env: Env) -> None:
    server, realm = await env.ready_server()
    token = apns_token()
    await server.e2ee_register(realm, token)
    env.apns.script(token, ApnsResponse.ok(delay=1.5))
    status, body = await server.json(
        "push/e2ee/notify",
        {"realm_uuid": realm, "push_requests": [_apns_request(token, generate_push_key(), {})]},
    )
    # Answered before the provider: its OK (1.5 s away) is not counted as sent.
    assert status == 200 and body["apple_successfully_sent_count"] == 0


async def test_duplicate_requests_are_sent_once(env: Env) -> None:
    server, realm = await env.ready_server()
    token = apns_token()
    await server.e2ee_register(realm, token)
    req = _apns_request(token, generate_push_key(), {"n": 1})
    body = {"realm_uuid": realm, "push_requests": [req, req]}
    _, first = await server.json("push/e2ee/notify", body)
    assert first["apple_successfully_sent_count"] == 2
    _, again = await server.json("push/e2ee/notify", body)
    assert again["apple_successfully_sent_count"] == 2
    assert len(env.apns.requests_for(token)) == 1


async def test_key_rotation(tmp_path: Any, sims: Any, second_key: tuple[str, str]) -> None:
    apns, fcm = sims
    new_pub, new_priv = second_key
    both = {VECTOR_KEY["public_key"]: VECTOR_KEY["private_key"], new_pub: new_priv}
    config = zulip_config(apns, fcm, tmp_path, bouncer_keys=both)
    async with GatewayHarness(config) as harness:
        env = Env(harness, apns, fcm)
        server, realm = await env.ready_server()
        assert (await server.e2ee_register(realm, apns_token()))[0] == 200
        assert (await server.e2ee_register(realm, apns_token(), public_key=new_pub))[0] == 200
    config = zulip_config(apns, fcm, tmp_path, bouncer_keys={new_pub: new_priv})
    async with GatewayHarness(config) as harness:
        server.client = harness.client
        status, body = await server.e2ee_register(realm, apns_token())
        assert (status, body["code"]) == (400, "INVALID_BOUNCER_PUBLIC_KEY")
        assert (await server.e2ee_register(realm, apns_token(), public_key=new_pub))[0] == 200


async def test_no_secrets_in_logs(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    server, realm = await env.ready_server()
    apns = apns_token()
    await server.e2ee_register(realm, apns)
    env.apns.script(apns, ApnsResponse.error("Unregistered"))
    key = generate_push_key()
    req = _apns_request(apns, key, {"secret": "content"})
    await server.json("push/e2ee/notify", {"realm_uuid": realm, "push_requests": [req]})
    await server.json(
        "push/e2ee/notify", {"realm_uuid": realm, "push_requests": [{**req, "token_id": "bogus!"}]}
    )
    await asyncio.sleep(0)
    text = caplog.text
    for secret in (
        apns,
        apns.lower(),
        server.key,
        VECTOR_KEY["private_key"],
        req["payload"]["encrypted_data"],
    ):
        assert secret not in text

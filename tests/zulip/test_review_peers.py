"""Review: what the real peers read from pushgw (zulip-flutter through FCM/APNs, and the
Zulip server through the bouncer API), asserted end to end against the simulators.

The `_app_*` helpers restate, in Python, the checks zulip-flutter makes when a message
arrives (types as strings, which keys are required), so that a payload the real app
would drop or mis-show fails here.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from typing import Any

from gateway.testing import FcmResponse
from plugins.zulip.crypto import decrypt_content, encrypt_content, generate_push_key, token_id_of
from tests.zulip.conftest import IOS_APP_ID, Env, apns_token, fcm_token

_DART_INT = re.compile(r"[+-]?[0-9]+")


def _dart_int(value: Any) -> int:
    """`int.parse(value as String, radix: 10)` of zulip-flutter's `_IntConverter`."""
    assert isinstance(value, str), f"{value!r} is not a String"
    assert _DART_INT.fullmatch(value), f"{value!r} does not parse as an int"
    return int(value)


def _app_token_id(token: str) -> str:
    """zulip-flutter `NotificationService.computeTokenId` (ASCII tokens: code units = bytes)."""
    return base64.b64encode(hashlib.sha256(token.encode("ascii")).digest()[:8]).decode()


def _app_encrypted_fcm(data: dict[str, Any]) -> tuple[int, bytes]:
    """`EncryptedFcmMessage.fromJson`: push_key_id a decimal String, encrypted_data base64."""
    return _dart_int(data["push_key_id"]), base64.b64decode(data["encrypted_data"], validate=True)


def _app_encrypted_apns(payload: dict[str, Any]) -> tuple[int, bytes]:
    """`EncryptedApnsPayload.fromJson`: push_key_id an int (a JSON number), not a String."""
    push_key_id = payload["push_key_id"]
    assert isinstance(push_key_id, int) and not isinstance(push_key_id, bool)
    return push_key_id, base64.b64decode(payload["encrypted_data"], validate=True)


def _app_legacy_fcm_message(data: dict[str, Any]) -> dict[str, Any]:
    """`MessageLegacyFcmMessage.fromJson` (event `message`) with its recipient."""
    assert data["event"] == "message"
    realm_url = data.get("realm_url", data.get("realm_uri"))
    assert isinstance(realm_url, str)
    out = {
        "realm_url": realm_url,
        "user_id": _dart_int(data["user_id"]),
        "sender_id": _dart_int(data["sender_id"]),
        "message_id": _dart_int(data["zulip_message_id"]),
        "time": _dart_int(data["time"]),
    }
    for key in ("sender_avatar_url", "sender_full_name", "content"):
        assert isinstance(data[key], str)
    if "stream_id" in data:
        out["channel_id"] = _dart_int(data["stream_id"])
        assert isinstance(data["topic"], str)
    elif "pm_users" in data:
        out["pm_users"] = [_dart_int(p) for p in data["pm_users"].split(",")]
    return out


async def _legacy_register_both(env: Env) -> tuple[Any, str, str]:
    server = env.server()
    await server.register()
    apns, fcm = apns_token(), fcm_token()
    assert (await server.legacy_register(apns, 1, user_id=10))[0] == 200
    assert (await server.legacy_register(fcm, 2, user_id=10))[0] == 200
    return server, apns, fcm


# --- E2EE -------------------------------------------------------------------------------


async def test_e2ee_fcm_message_is_an_encrypted_fcm_message_to_the_app(env: Env) -> None:
    """zulip/zulip-flutter lib/api/notifications.dart (`EncryptedFcmMessage`: push_key_id
    via `_IntConverter` from a String) and lib/notifications/receive.dart
    (`_onRemoteMessage`: a message that fails to parse is treated as legacy plaintext and,
    on a 468+ server, ignored). zulip/zulip zilencer/lib/push_notifications.py builds
    `data={push_key_id: str(...), encrypted_data}` with only `android.priority`."""
    server, realm = await env.ready_server()
    # The shape of a real FCM registration token: instance id, ':', then base64url.
    token = "dGhpcyBpcyBub3Q6YSB0b2tlbg:APA91b" + fcm_token()[4:]
    assert (await server.e2ee_register(realm, token, "fcm", ios_app_id=None))[0] == 200
    key = generate_push_key()
    content = {"type": "message", "realm_url": "https://chat.example.org", "user_id": 10}
    encrypted = encrypt_content(key, content)
    request = {
        "token_id": token_id_of(token),
        "fcm_priority": "high",
        "payload": {"push_key_id": 2**32 - 1, "encrypted_data": encrypted},
    }
    status, body = await server.json(
        "push/e2ee/notify", {"realm_uuid": realm, "push_requests": [request]}
    )
    assert status == 200 and body["android_successfully_sent_count"] == 1, body
    [sent] = env.fcm.requests_for(token)
    assert set(sent.message) == {"token", "data", "android"}
    assert sent.message["android"] == {"priority": "high"}
    assert set(sent.message["data"]) == {"push_key_id", "encrypted_data"}
    push_key_id, _ = _app_encrypted_fcm(sent.message["data"])
    assert push_key_id == 2**32 - 1
    assert sent.message["data"]["encrypted_data"] == encrypted
    assert json.loads(decrypt_content(key, sent.message["data"]["encrypted_data"])) == content


async def test_e2ee_apns_body_reaches_the_notification_service_extension(env: Env) -> None:
    """zulip/zulip-flutter lib/notifications/ios_service.dart (the extension runs only with
    `mutable-content: 1`; `EncryptedApnsPayload.fromJson` needs a numeric push_key_id) and
    lib/api/notifications.dart. zulip/zulip zilencer/lib/push_notifications.py sends the
    payload as the APNs message, apns-topic = ios_app_id, priority/push-type from headers.
    A localized server-built alert (non-ASCII) must arrive as the same text."""
    server, realm = await env.ready_server()
    token = apns_token()
    assert (await server.e2ee_register(realm, token))[0] == 200
    key = generate_push_key()
    payload = {
        "push_key_id": 7,
        "encrypted_data": encrypt_content(key, {"type": "message", "user_id": 10}),
        "aps": {
            "mutable-content": 1,
            "alert": {"title": "Nouvelle notification — ✉"},
            "sound": "default",
        },
    }
    request = {
        "token_id": token_id_of(token),
        "http_headers": {"apns_priority": 10, "apns_push_type": "alert"},
        "payload": payload,
    }
    status, body = await server.json(
        "push/e2ee/notify", {"realm_uuid": realm, "push_requests": [request]}
    )
    assert status == 200 and body["apple_successfully_sent_count"] == 1, body
    [sent] = env.apns.requests_for(token)
    assert sent.headers["apns-topic"] == IOS_APP_ID
    assert (sent.headers["apns-priority"], sent.headers["apns-push-type"]) == ("10", "alert")
    assert json.loads(sent.body.decode("utf-8")) == payload
    assert _app_encrypted_apns(sent.json or {})[0] == 7
    assert len(sent.body) <= 4096


async def test_e2ee_delete_token_ids_are_the_ids_the_app_and_server_know(env: Env) -> None:
    """zulip/zulip-flutter lib/notifications/receive.dart (`computeTokenId`: base64 of the
    first 8 bytes of SHA-256) and zulip/zulip zilencer/lib/push_notifications.py
    (`delete_token_ids` holds base64 token ids; counts are ints; the server validates the
    response strictly and clears the device whose push_token_id is listed)."""
    server, realm = await env.ready_server()
    token = fcm_token()
    assert (await server.e2ee_register(realm, token, "fcm", ios_app_id=None))[0] == 200
    env.fcm.script(token, FcmResponse.unregistered())
    key = generate_push_key()
    request = {
        "token_id": _app_token_id(token),
        "fcm_priority": "normal",
        "payload": {"push_key_id": 1, "encrypted_data": encrypt_content(key, {"type": "remove"})},
    }
    status, body = await server.json(
        "push/e2ee/notify", {"realm_uuid": realm, "push_requests": [request]}
    )
    assert status == 200, body
    assert body["delete_token_ids"] == [_app_token_id(token)]
    for name in ("apple_successfully_sent_count", "android_successfully_sent_count"):
        assert type(body[name]) is int and body[name] == 0
    assert body["realm_push_status"] == {"can_push": True, "expected_end_timestamp": None}


# --- legacy -----------------------------------------------------------------------------


async def test_legacy_fcm_message_parses_as_the_app_parses_it(env: Env) -> None:
    """zulip/zulip-flutter lib/api/notifications.dart (`MessageLegacyFcmMessage`: user_id,
    sender_id, zulip_message_id, time, stream_id as decimal Strings; pm_users a
    comma-joined String) for the gcm_payload a pre-E2EE Zulip server builds
    (zulip/zulip zerver/lib/push_notifications.py `get_message_payload_gcm`)."""
    server, _, fcm = await _legacy_register_both(env)
    gcm_payload = {
        "server": "chat.example.org",
        "realm_id": 2,
        "realm_name": "Example",
        "realm_uri": "https://chat.example.org",
        "realm_url": "https://chat.example.org",
        "user_id": 10,
        "event": "message",
        "zulip_message_id": 4567,
        "time": 1754385395,
        "content": "hello ✉",
        "content_truncated": False,
        "sender_id": 6,
        "sender_email": "aaron@example.org",
        "sender_full_name": "Aaron",
        "sender_avatar_url": "https://chat.example.org/avatar/6",
        "recipient_type": "stream",
        "stream": "Denmark",
        "stream_id": 5,
        "topic": "test",
    }
    status, body = await server.json(
        "push/notify",
        {
            "user_id": 10,
            "apns_payload": {},
            "gcm_payload": gcm_payload,
            "gcm_options": {"priority": "high"},
        },
    )
    assert status == 200, body
    [sent] = env.fcm.requests_for(fcm)
    data = sent.message["data"]
    assert all(isinstance(v, str) for v in data.values())
    assert _app_legacy_fcm_message(data) == {
        "realm_url": "https://chat.example.org",
        "user_id": 10,
        "sender_id": 6,
        "message_id": 4567,
        "time": 1754385395,
        "channel_id": 5,
    }
    assert data["content"] == "hello ✉" and data["content_truncated"] == "False"
    assert set(sent.message) == {"token", "data", "android"}
    assert sent.message["android"] == {"priority": "high"}


async def test_legacy_fcm_remove_ids_parse_as_the_app_parses_them(env: Env) -> None:
    """zulip/zulip-flutter lib/api/notifications.dart (`RemoveLegacyFcmMessage`:
    zulip_message_ids split on ',' and each parsed as a decimal int); zulip/zulip
    zilencer/views.py truncates a remove to the 200 largest ids."""
    server, _, fcm = await _legacy_register_both(env)
    ids = ",".join(str(i) for i in range(1, 250))
    status, body = await server.json(
        "push/notify",
        {
            "user_id": 10,
            "gcm_payload": {
                "event": "remove",
                "realm_url": "https://chat.example.org",
                "user_id": 10,
                "zulip_message_ids": ids,
            },
            "gcm_options": {"priority": "normal"},
        },
    )
    assert status == 200, body
    [sent] = env.fcm.requests_for(fcm)
    data = sent.message["data"]
    assert [_dart_int(p) for p in data["zulip_message_ids"].split(",")] == list(range(50, 250))
    assert _dart_int(data["user_id"]) == 10


async def test_legacy_apns_body_keeps_the_ints_the_app_opens_with(env: Env) -> None:
    """zulip/zulip-flutter lib/notifications/open.dart (`parseLegacyIosApnsPayload`: the
    `zulip` object needs `user_id` and `sender_id` as ints, `stream_id` an int,
    `realm_url` a String); zulip/zulip zerver/lib/push_notifications.py sends
    `{**custom, "aps": rest}` with a 24 h expiration."""
    server, apns, _ = await _legacy_register_both(env)
    zulip = {
        "realm_url": "https://chat.example.org",
        "user_id": 10,
        "sender_id": 6,
        "recipient_type": "stream",
        "stream_id": 5,
        "topic": "test",
        "message_ids": [4567],
    }
    apns_payload = {
        "alert": {"title": "#Denmark > test", "subtitle": "Aaron:", "body": "hello"},
        "sound": "default",
        "badge": 0,
        "custom": {"zulip": zulip},
    }
    status, body = await server.json(
        "push/notify", {"user_id": 10, "apns_payload": apns_payload, "gcm_payload": {}}
    )
    assert status == 200, body
    [sent] = env.apns.requests_for(apns)
    assert sent.json == {
        "zulip": zulip,
        "aps": {
            "alert": {"title": "#Denmark > test", "subtitle": "Aaron:", "body": "hello"},
            "sound": "default",
            "badge": 0,
        },
    }
    assert sent.headers["apns-topic"] == IOS_APP_ID
    assert "apns-expiration" in sent.headers
    assert "apns-priority" not in sent.headers and "apns-push-type" not in sent.headers


async def test_legacy_notify_response_passes_the_servers_checks(env: Env) -> None:
    """zulip/zulip zerver/lib/push_notifications.py `send_notifications_to_bouncer` asserts
    int totals, a `deleted_devices` dict of two lists, and reads `realm` (None or
    `{can_push, expected_end_timestamp}`); it deletes its own tokens listed there by exact
    string, so they come back as the server sent them."""
    server, apns, fcm = await _legacy_register_both(env)
    gone = "AB" * 32
    status, body = await server.json(
        "push/notify",
        {
            "user_id": 10,
            "apns_payload": {"alert": "x"},
            "gcm_payload": {"event": "message"},
            "gcm_options": {"priority": "high"},
            "android_devices": [fcm, "fcm-gone"],
            "apple_devices": [apns, gone],
        },
    )
    assert status == 200, body
    assert type(body["total_android_devices"]) is int and body["total_android_devices"] == 1
    assert type(body["total_apple_devices"]) is int and body["total_apple_devices"] == 1
    assert body["deleted_devices"] == {"android_devices": ["fcm-gone"], "apple_devices": [gone]}
    assert body["realm"] is None


async def test_legacy_fcm_group_dm_parses_as_the_app_parses_it(env: Env) -> None:
    """zulip/zulip-flutter lib/api/notifications.dart (`LegacyFcmMessageDmRecipient`:
    `pm_users` a comma-joined String of ints, 1:1 DMs by `sender_id`/`user_id` Strings)."""
    server, _, fcm = await _legacy_register_both(env)
    base = {
        "realm_url": "https://chat.example.org",
        "user_id": 10,
        "event": "message",
        "zulip_message_id": 9,
        "time": 1754385395,
        "content": "hi",
        "sender_id": 6,
        "sender_full_name": "Aaron",
        "sender_avatar_url": "https://chat.example.org/avatar/6",
        "recipient_type": "private",
    }
    for extra, expected in (({"pm_users": "6,10,12"}, [6, 10, 12]), ({}, None)):
        env.fcm.clear_requests()
        status, body = await server.json(
            "push/notify", {"user_id": 10, "gcm_payload": {**base, **extra}}
        )
        assert status == 200, body
        [sent] = env.fcm.requests_for(fcm)
        parsed = _app_legacy_fcm_message(sent.message["data"])
        assert parsed.get("pm_users") == expected
        assert (parsed["sender_id"], parsed["user_id"]) == (6, 10)
        assert sent.message["android"] == {"priority": "high"}  # absent: by event

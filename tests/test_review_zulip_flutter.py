"""Review (zulip-flutter seat): what the simulators received, decoded as the app does.

The decoders below restate, in Python, the facts of zulip-flutter's parsers
(lib/api/notifications.dart, lib/notifications/receive.dart and open.dart): which
keys are read, and which JSON types they must have (FCM data values are strings;
`_IntConverter` parses decimal strings; `_IntListConverter` splits a comma-joined
string; APNs `push_key_id` is a JSON number; the legacy iOS tap handler reads
`zulip.user_id`/`sender_id`/`stream_id` as numbers and `pm_users` as a string).
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

from plugins.zulip.crypto import decrypt_content, encrypt_content, generate_push_key, token_id_of
from tests.zulip.conftest import Env, apns_token, fcm_token
from tests.zulip.conftest import env as env  # the fixtures
from tests.zulip.conftest import sims as sims


def _int(value: Any) -> int:
    """Dart `int.parse(value as String, radix: 10)`."""
    assert isinstance(value, str), value
    return int(value, 10)


def _b64(value: Any) -> bytes:
    assert isinstance(value, str), value
    return base64.b64decode(value, validate=True)


def app_decode_fcm(data: dict[str, Any], push_key: bytes | None = None) -> dict[str, Any]:
    """`NotificationService._onRemoteMessage`: E2EE first, then legacy by `event`."""
    assert all(isinstance(v, str) for v in data.values()), data  # FCM's own rule
    try:
        push_key_id = _int(data["push_key_id"])
        encrypted = _b64(data["encrypted_data"])
    except (KeyError, AssertionError, ValueError):
        return _legacy_fcm(data)
    assert push_key is not None
    plaintext = decrypt_content(push_key, base64.b64encode(encrypted).decode())
    return {"kind": "e2ee", "push_key_id": push_key_id, "payload": json.loads(plaintext)}


def _legacy_fcm(data: dict[str, Any]) -> dict[str, Any]:
    realm_url = data.get("realm_url", data.get("realm_uri"))
    assert isinstance(realm_url, str)
    realm_name = data.get("realm_name")
    assert realm_name is None or isinstance(realm_name, str)
    user_id = _int(data["user_id"])
    if data.get("event") == "remove":
        ids = [int(p, 10) for p in data["zulip_message_ids"].split(",")]
        return {"kind": "remove", "user_id": user_id, "message_ids": ids}
    assert data.get("event") == "message", data
    if "stream_id" in data:
        recipient: Any = ("channel", _int(data["stream_id"]), data.get("stream"), data["topic"])
    elif "pm_users" in data:
        recipient = ("dm", [int(p, 10) for p in data["pm_users"].split(",")])
    else:
        recipient = ("dm", sorted({_int(data["sender_id"]), user_id}))
    assert isinstance(data["sender_avatar_url"], str)
    assert isinstance(data["sender_full_name"], str)
    assert isinstance(data["content"], str)
    return {
        "kind": "message",
        "realm_url": realm_url,
        "user_id": user_id,
        "sender_id": _int(data["sender_id"]),
        "message_id": _int(data["zulip_message_id"]),
        "time": _int(data["time"]),
        "recipient": recipient,
    }


def app_decode_apns_e2ee(body: dict[str, Any]) -> tuple[int, bytes]:
    """`EncryptedApnsPayload.fromJson` plus the NSE's precondition (`mutable-content`)."""
    push_key_id = body["push_key_id"]
    assert isinstance(push_key_id, int) and not isinstance(push_key_id, bool)
    assert body["aps"].get("mutable-content") == 1 and body["aps"].get("alert")
    return push_key_id, _b64(body["encrypted_data"])


def app_decode_legacy_apns_tap(body: dict[str, Any]) -> dict[str, Any]:
    """`NotificationOpenPayload.parseLegacyIosApnsPayload`."""
    zulip = body["zulip"]
    assert isinstance(zulip["user_id"], int) and isinstance(zulip["sender_id"], int)
    assert zulip.get("event") in (None, "message")
    realm_url = zulip.get("realm_url", zulip.get("realm_uri"))
    assert isinstance(realm_url, str)
    if zulip["recipient_type"] == "stream":
        assert isinstance(zulip["stream_id"], int) and isinstance(zulip["topic"], str)
        return {"realm_url": realm_url, "narrow": ("topic", zulip["stream_id"], zulip["topic"])}
    assert isinstance(zulip["pm_users"], str)
    return {
        "realm_url": realm_url,
        "narrow": ("dm", sorted(map(int, zulip["pm_users"].split(",")))),
    }


REALM_URL = "https://chat.example.org"


def _server_gcm_message(**extra: Any) -> dict[str, Any]:
    """A legacy `gcm_payload` as a Zulip server builds it (ints stay ints)."""
    return {
        "server": "chat.example.org",
        "realm_id": 2,
        "realm_name": "Example",
        "realm_uri": REALM_URL,
        "realm_url": REALM_URL,
        "user_id": 10,
        "event": "message",
        "zulip_message_id": 4321,
        "time": 1754577820,
        "content": "hello",
        "content_truncated": False,
        "sender_id": 11,
        "sender_email": "a@example.org",
        "sender_full_name": "A",
        "sender_avatar_url": "https://chat.example.org/avatar/11",
        **extra,
    }


async def test_legacy_fcm_message_and_remove_decode_as_the_app(env: Env) -> None:
    server, realm = await env.ready_server()
    user_uuid = str(uuid.uuid4())
    fcm = fcm_token()
    await server.legacy_register(fcm, 2, user_uuid=user_uuid)
    stream = _server_gcm_message(recipient_type="stream", stream="general", stream_id=5, topic="t")
    group = _server_gcm_message(recipient_type="private", pm_users="10,11,12")
    remove = {
        "server": "chat.example.org",
        "realm_id": 2,
        "realm_uri": REALM_URL,
        "realm_url": REALM_URL,
        "user_id": 10,
        "event": "remove",
        "zulip_message_ids": ",".join(str(i) for i in range(1, 250)),
        "zulip_message_id": 1,
    }
    for payload in (stream, group, remove):
        status, resp = await server.json(
            "push/notify",
            {
                "user_uuid": user_uuid,
                "realm_uuid": realm,
                "gcm_payload": payload,
                "gcm_options": {},
                "android_devices": [fcm],
                "apple_devices": [],
            },
        )
        assert status == 200, resp
    got = [app_decode_fcm(r.message["data"]) for r in env.fcm.requests_for(fcm)]
    assert got[0]["recipient"] == ("channel", 5, "general", "t")
    assert (got[0]["message_id"], got[0]["time"], got[0]["user_id"]) == (4321, 1754577820, 10)
    assert got[1]["recipient"] == ("dm", [10, 11, 12])
    assert got[2] == {"kind": "remove", "user_id": 10, "message_ids": list(range(50, 250))}


async def test_legacy_apns_message_opens_the_right_narrow(env: Env) -> None:
    server, _realm = await env.ready_server()
    apns = apns_token()
    await server.legacy_register(apns, 1, user_id=10)
    zulip = _server_gcm_message(recipient_type="stream", stream="general", stream_id=5, topic="t")
    status, resp = await server.json(
        "push/notify",
        {
            "user_id": 10,
            "apns_payload": {
                "alert": {"title": "#general > t", "body": "A: hello"},
                "sound": "default",
                "badge": 0,
                "custom": {"zulip": zulip},
            },
            "apple_devices": [apns],
        },
    )
    assert status == 200, resp
    [a] = env.apns.requests_for(apns)
    assert a.json is not None
    assert app_decode_legacy_apns_tap(a.json) == {
        "realm_url": REALM_URL,
        "narrow": ("topic", 5, "t"),
    }


async def test_e2ee_pushes_decode_as_the_app(env: Env) -> None:
    server, realm = await env.ready_server()
    apns, fcm = apns_token(), fcm_token()
    await server.e2ee_register(realm, apns)
    await server.e2ee_register(realm, fcm, "fcm", ios_app_id=None)
    key = generate_push_key()
    content = {
        "type": "message",
        "realm_url": REALM_URL,
        "realm_name": "Example",
        "user_id": 10,
        "sender_id": 11,
        "sender_avatar_url": "https://chat.example.org/avatar/11",
        "sender_full_name": "A",
        "recipient_type": "direct",
        "recipient_user_ids": [10, 11],
        "message_id": 4321,
        "time": 1754577820,
        "content": "hello",
    }
    push_key_id = 2**32 - 1  # a u32 the client chose: the largest one
    enc = encrypt_content(key, content)
    aps = {"mutable-content": 1, "alert": {"title": "New notification"}, "sound": "default"}
    status, resp = await server.json(
        "push/e2ee/notify",
        {
            "realm_uuid": realm,
            "push_requests": [
                {
                    "token_id": token_id_of(apns),
                    "http_headers": {"apns_priority": 10, "apns_push_type": "alert"},
                    "payload": {"push_key_id": push_key_id, "encrypted_data": enc, "aps": aps},
                },
                {
                    "token_id": token_id_of(fcm),
                    "fcm_priority": "high",
                    "payload": {"push_key_id": push_key_id, "encrypted_data": enc},
                },
            ],
        },
    )
    assert status == 200, resp
    assert (resp["apple_successfully_sent_count"], resp["android_successfully_sent_count"]) == (
        1,
        1,
    )
    [f] = env.fcm.requests_for(fcm)
    assert app_decode_fcm(f.message["data"], key) == {
        "kind": "e2ee",
        "push_key_id": push_key_id,
        "payload": content,
    }
    [a] = env.apns.requests_for(apns)
    assert a.json is not None
    got_id, ciphertext = app_decode_apns_e2ee(a.json)
    assert got_id == push_key_id
    plaintext = decrypt_content(key, base64.b64encode(ciphertext).decode())
    assert json.loads(plaintext) == content

"""APNs headers per push, against Zulip's own bouncer (zulip/zulip) as the reference.

What Zulip's bouncer sends (aioapns 4.0 builds the headers from `NotificationRequest`
and adds nothing of its own: no topic suffix, no default expiration or priority):

- E2EE (`zilencer/lib/push_notifications.py`, `send_e2ee_push_notifications`):
  `apns-topic` = the registration's `ios_app_id` verbatim, for every push type;
  `apns-priority` and `apns-push-type` as the request's `http_headers` name them; no
  `apns-expiration` (no `time_to_live`), no `apns-collapse-id`.
- Legacy notify and test notification (`zerver/lib/push_notifications.py`,
  `send_apple_push_notification`): `apns-topic` = `ios_app_id`, `apns-expiration` =
  now + 86400 (`time_to_live=24 * 3600`), neither priority nor push type.

Apple wants `<bundle>.voip` / `<bundle>.push-type.liveactivity` topics for VoIP and Live
Activity pushes, but those go to PushKit and Live Activity tokens; the Zulip app only
registers ordinary remote-notification tokens, for which such a topic is answered
`DeviceTokenNotForTopic` (and the registration would be ended). A real Zulip server only
sends `alert` (priority 10) and `background` (priority 5, removals): Zulip's
`send_push_notifications`. So pushgw, like Zulip, never rewrites the topic; a push
type that needs a topic of its own (`voip`, ...) is refused before sending instead of
costing the registration (tests/test_review_apple_rules.py).

These tests pin that parity through the APNs simulator, with `topics` set as Apple would
enforce them for the app's key.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from plugins.zulip.crypto import encrypt_content, generate_push_key, token_id_of
from tests.zulip.conftest import IOS_APP_ID, Env, apns_token

DEV_APP_ID = IOS_APP_ID + ".dev"

# The headers aioapns 4.0 sends for a Zulip E2EE push (apns-id is always sent).
E2EE_APNS_HEADERS = {"apns-id", "apns-topic", "apns-priority", "apns-push-type"}
LEGACY_APNS_HEADERS = {"apns-id", "apns-topic", "apns-expiration"}


def _apns_headers(headers: dict[str, str]) -> set[str]:
    return {name for name in headers if name.startswith("apns-")}


def _e2ee_request(token: str, priority: int, push_type: str) -> dict[str, Any]:
    return {
        "token_id": token_id_of(token),
        "http_headers": {"apns_priority": priority, "apns_push_type": push_type},
        "payload": {
            "push_key_id": 7,
            "encrypted_data": encrypt_content(generate_push_key(), {"type": "test"}),
            "aps": {"mutable-content": 1, "alert": {"title": "New notification"}},
        },
    }


@pytest.mark.parametrize(
    ("priority", "push_type"),
    [
        (10, "alert"),  # what Zulip servers send for messages and tests
        (5, "background"),  # ... and for removals
        (10, "mdm"),
    ],
)
async def test_e2ee_topic_is_the_ios_app_id_for_every_push_type(
    env: Env, priority: int, push_type: str
) -> None:
    env.apns.topics = frozenset({IOS_APP_ID})
    server, realm = await env.ready_server()
    token = apns_token()
    assert (await server.e2ee_register(realm, token))[0] == 200
    req = _e2ee_request(token, priority, push_type)
    status, body = await server.json(
        "push/e2ee/notify", {"realm_uuid": realm, "push_requests": [req]}
    )
    assert status == 200, body
    assert (body["apple_successfully_sent_count"], body["delete_token_ids"]) == (1, [])
    [sent] = env.apns.requests_for(token)
    assert _apns_headers(sent.headers) == E2EE_APNS_HEADERS
    assert sent.headers["apns-topic"] == IOS_APP_ID
    assert sent.headers["apns-push-type"] == push_type
    assert sent.headers["apns-priority"] == str(priority)
    assert sent.json == req["payload"]


@pytest.mark.zulip_config(ios_app_ids={DEV_APP_ID: "ios"})
async def test_each_registration_gets_its_own_ios_app_id_as_topic(env: Env) -> None:
    # One APNs key serves both bundle ids (the alias routes the dev build through the
    # same app); each push names the bundle its token was registered for, as Zulip does.
    env.apns.topics = frozenset({IOS_APP_ID, DEV_APP_ID})
    server, realm = await env.ready_server()
    prod, dev = apns_token(), apns_token()
    await server.e2ee_register(realm, prod)
    await server.e2ee_register(realm, dev, ios_app_id=DEV_APP_ID)
    requests = [_e2ee_request(prod, 10, "alert"), _e2ee_request(dev, 10, "alert")]
    status, body = await server.json(
        "push/e2ee/notify", {"realm_uuid": realm, "push_requests": requests}
    )
    assert status == 200 and body["apple_successfully_sent_count"] == 2, body
    assert env.apns.requests_for(prod)[0].headers["apns-topic"] == IOS_APP_ID
    assert env.apns.requests_for(dev)[0].headers["apns-topic"] == DEV_APP_ID


async def test_legacy_notify_headers_are_zulips(env: Env) -> None:
    env.apns.topics = frozenset({IOS_APP_ID})
    server, _realm = await env.ready_server()
    token = apns_token()
    assert (await server.legacy_register(token, 1, user_id=5))[0] == 200
    before = int(time.time())
    status, body = await server.json(
        "push/notify",
        {
            "user_id": 5,
            "apns_payload": {
                "alert": {"title": "Iago", "subtitle": "", "body": "hello"},
                "sound": "default",
                "badge": 0,
                "custom": {"zulip": {"event": "message", "message_ids": [1]}},
            },
            "apple_devices": [token],
        },
    )
    after = int(time.time())
    assert status == 200 and body["total_apple_devices"] == 1, body
    [sent] = env.apns.requests_for(token)
    assert sent.status == 200
    assert _apns_headers(sent.headers) == LEGACY_APNS_HEADERS
    assert sent.headers["apns-topic"] == IOS_APP_ID
    assert before + 86400 <= int(sent.headers["apns-expiration"]) <= after + 86400


async def test_legacy_test_notification_headers_are_zulips(env: Env) -> None:
    env.apns.topics = frozenset({IOS_APP_ID})
    server, _realm = await env.ready_server()
    token = apns_token()
    assert (await server.legacy_register(token, 1, user_id=5))[0] == 200
    before = int(time.time())
    base = {"realm_name": "Example", "realm_url": "https://chat.example.org", "user_id": 5}
    status, body = await server.json(
        "push/test_notification",
        {"token": token, "token_kind": 1, "user_id": 5, "user_uuid": None, "base_payload": base},
    )
    after = int(time.time())
    assert status == 200, body
    [sent] = env.apns.requests_for(token)
    assert sent.status == 200
    assert _apns_headers(sent.headers) == LEGACY_APNS_HEADERS
    assert sent.headers["apns-topic"] == IOS_APP_ID
    assert before + 86400 <= int(sent.headers["apns-expiration"]) <= after + 86400

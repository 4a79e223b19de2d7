"""Review (Matrix client developers): what real clients' pushers get on the device.

Pusher `data` shapes taken from shipping clients (Element X iOS: `event_id_only` with a
`default_payload` holding `aps.mutable-content`, a `loc-key` alert and
`pusher_notification_client_identifier`; Element X Android: `event_id_only` with
`default_payload: {"cs": <client secret>}`; Element Android's "test push", which posts
`{event_id, devices: [{app_id, pushkey}]}` itself), sent through the real HTTP app to the
APNs and FCM simulators, and compared with what Sygnal 0.17 sends for the same input.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.testing import ApnsSimulator, FcmSimulator
from tests.matrix.conftest import NOTIFY, apns_pushkey, device, fcm_pushkey
from tests.matrix.conftest import apns as apns
from tests.matrix.conftest import fcm as fcm
from tests.matrix.conftest import make_gateway as make_gateway

IOS = "com.example.ios"
ANDROID = "com.example.android"

ELEMENT_X_IOS_PAYLOAD = {
    "aps": {"mutable-content": 1, "alert": {"loc-key": "Notification", "loc-args": []}},
    "pusher_notification_client_identifier": "b7e2c1",
}
# Synapse's `format: event_id_only` frame (synapse/push/httppusher.py)
EVENT_ID_ONLY = {
    "event_id": "$a1:example.org",
    "room_id": "!r:example.org",
    "counts": {"unread": 3},
    "prio": "high",
}
# Synapse's badge-only frame
BADGE = {"id": "", "type": None, "sender": "", "counts": {"unread": 0}}


async def _notify(gw: Any, frame: dict[str, Any], dev: dict[str, Any]) -> tuple[int, Any]:
    body = {"notification": {**frame, "devices": [dev]}}
    response = await gw.client.post(NOTIFY, data=json.dumps(body).encode())
    return response.status, json.loads(await response.text())


async def test_element_x_ios_event_id_only_is_sygnal_byte_for_byte(
    make_gateway: Any, apns: ApnsSimulator
) -> None:
    key, token = apns_pushkey()
    data = {"format": "event_id_only", "default_payload": ELEMENT_X_IOS_PAYLOAD}
    async with make_gateway() as gw:
        assert await _notify(gw, EVENT_ID_ONLY, device(IOS, key, data=data)) == (
            200,
            {"rejected": []},
        )
        assert await _notify(gw, BADGE, device(IOS, key, data=data)) == (200, {"rejected": []})
    event, badge = apns.requests
    assert event.token == badge.token == token
    # the NSE reads room_id, event_id, unread_count and the client identifier
    assert event.json == {
        **ELEMENT_X_IOS_PAYLOAD,
        "room_id": "!r:example.org",
        "event_id": "$a1:example.org",
        "unread_count": 3,
    }
    assert event.headers["apns-priority"] == "10"
    assert "apns-push-type" not in event.headers
    # a badge frame ignores default_payload and clears the badge (0 is a badge)
    assert badge.json == {"aps": {"badge": 0}}


async def test_element_x_android_event_id_only_data_is_all_strings(
    make_gateway: Any, fcm: FcmSimulator
) -> None:
    pushkey = fcm_pushkey()
    data = {"format": "event_id_only", "default_payload": {"cs": "s3cr3t"}}
    async with make_gateway() as gw:
        assert await _notify(
            gw, {**EVENT_ID_ONLY, "prio": "low"}, device(ANDROID, pushkey, data=data)
        ) == (
            200,
            {"rejected": []},
        )
        # Synapse's badge-only frame with a zero count has nothing to say on FCM
        assert await _notify(gw, BADGE, device(ANDROID, pushkey, data=data)) == (
            200,
            {"rejected": []},
        )
    (request,) = fcm.requests
    assert request.token == pushkey
    assert request.message["data"] == {
        "cs": "s3cr3t",
        "event_id": "$a1:example.org",
        "room_id": "!r:example.org",
        "prio": "normal",
        "unread": "3",
    }
    assert request.message["android"] == {"priority": "normal"}


async def test_element_android_test_push_is_delivered_not_rejected(
    make_gateway: Any, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    """The client's own troubleshooting request: no room, no counts, no `data`, no
    `pushkey_ts`; a `rejected` answer makes the client report a broken pusher."""
    key, _ = apns_pushkey()
    pushkey = fcm_pushkey()
    frame = {"event_id": "$THIS_IS_A_FAKE_EVENT_ID"}
    async with make_gateway() as gw:
        for dev in ({"app_id": ANDROID, "pushkey": pushkey}, {"app_id": IOS, "pushkey": key}):
            assert await _notify(gw, frame, dev) == (200, {"rejected": []})
    assert fcm.requests[0].message["data"] == {
        "event_id": "$THIS_IS_A_FAKE_EVENT_ID",
        "prio": "high",
    }
    assert apns.requests[0].json == {"event_id": "$THIS_IS_A_FAKE_EVENT_ID"}

"""Review: homeservers other than the newest Synapse as the peer of `/_matrix/push/v1/notify`.

Each body is built the way that server builds it, field for field:

- Dendrite: matrix-org/dendrite:internal/pushgateway/pushgateway.go (Go structs,
  `omitempty` everywhere but `counts.unread`, `devices` and `devices[].data`),
  userapi/consumers/roomserver.go (`notifyHTTP`: no `prio` ever, `counts.unread` even
  when 0, `id` next to `event_id`), userapi/util/notify.go (badge updates: only
  `counts` and `devices`), userapi/util/devices.go (`data` = pusher data minus `url`,
  `null` when nothing is left; `tweaks` sent in both formats, `highlight: null`).
  Encoded as `encoding/json` does: struct order, compact, `<`/`>`/`&` escaped.
- Conduit / conduwuit / continuwuity: src/service/pusher/mod.rs (`send_notice`) with
  ruma's push_gateway `send_event_notification::v1` (`prio` omitted when `high`,
  `counts` omitted when zero, `pushkey_ts` omitted, `data` omitted when empty,
  `tweaks` omitted in `event_id_only`; continuwuity adds `room_alias` and extra pusher
  data keys).
- Older Synapse (element-hq/synapse:synapse/push/httppusher.py before #15387):
  `tweaks` always present, `{}` included, in full frames and badge updates.

What Sygnal does with each is element-hq/sygnal:sygnal/notifications.py (validation),
apnspushkin.py (`_get_payload_event_id_only`, `_get_payload_full`) and gcmpushkin.py
(`_build_data`).
"""

from __future__ import annotations

import gzip
import json
import zlib
from typing import Any

import pytest

from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.fcm_sim import FcmResponse, FcmSimulator
from gateway.testing.harness import GatewayHarness
from tests.matrix.conftest import NOTIFY, apns_pushkey, fcm_pushkey

IOS = "com.example.ios"
ANDROID = "com.example.android"
EVENT_ID = "$ev1:example.org"
ROOM_ID = "!room:example.org"
ELEMENT_IOS_PAYLOAD = {"aps": {"mutable-content": 1, "alert": {"loc-key": "Notification"}}}


def go_json(body: Any) -> bytes:
    """`encoding/json.Marshal`: compact, HTML characters escaped as `\\u003c` etc."""
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    for char, escape in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e")):
        text = text.replace(char, escape)
    return text.encode()


def rust_json(body: Any) -> bytes:
    """serde_json: compact, raw UTF-8, field order as declared."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


async def post(
    gw: GatewayHarness, raw: bytes, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    response = await gw.client.post(
        NOTIFY, data=raw, headers=headers or {"Content-Type": "application/json"}
    )
    text = await response.text()
    if response.status == 200:
        assert response.content_type == "application/json"
        return 200, json.loads(text)
    return response.status, text


# --- Dendrite --------------------------------------------------------------------------


def dendrite_device(app_id: str, pushkey: str, data: Any, tweaks: Any = None) -> dict[str, Any]:
    device: dict[str, Any] = {"app_id": app_id, "data": data, "pushkey": pushkey}
    device["pushkey_ts"] = 1_700_000_000
    if tweaks:
        device["tweaks"] = tweaks
    return device


DENDRITE_TWEAKS = {"highlight": None, "sound": "default"}  # default rules, Go nil value


def dendrite_event_id_only(device: dict[str, Any], unread: int) -> bytes:
    return go_json(
        {
            "notification": {
                "counts": {"unread": unread},
                "devices": [device],
                "event_id": EVENT_ID,
                "room_id": ROOM_ID,
            }
        }
    )


def dendrite_full(device: dict[str, Any]) -> bytes:
    return go_json(
        {
            "notification": {
                "content": {"body": "a <b> & c", "msgtype": "m.text"},
                "counts": {"unread": 3},
                "devices": [device],
                "event_id": EVENT_ID,
                "id": EVENT_ID,
                "room_id": ROOM_ID,
                "room_name": "Ops",
                "sender": "@alice:example.org",
                "type": "m.room.message",
            }
        }
    )


def dendrite_badge(device: dict[str, Any], unread: int) -> bytes:
    return go_json({"notification": {"counts": {"unread": unread}, "devices": [device]}})


async def test_dendrite_event_id_only_frames(
    gw: GatewayHarness, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    """No `prio` (high), `counts.unread` 0 sent, tweaks kept: delivered as Sygnal does
    (`unread_count: 0` on APNs; a zero count left out of FCM data)."""
    pushkey, hexkey = apns_pushkey()
    data = {"default_payload": ELEMENT_IOS_PAYLOAD, "format": "event_id_only"}
    status, body = await post(
        gw, dendrite_event_id_only(dendrite_device(IOS, pushkey, data, DENDRITE_TWEAKS), 0)
    )
    assert (status, body) == (200, {"rejected": []})
    [request] = apns.requests
    assert request.token == hexkey
    assert request.headers["apns-priority"] == "10"
    assert {k: v for k, v in request.json.items() if k != "aps"} == {
        "room_id": ROOM_ID,
        "event_id": EVENT_ID,
        "unread_count": 0,
    }
    token = fcm_pushkey()
    status, body = await post(
        gw,
        dendrite_event_id_only(dendrite_device(ANDROID, token, {"format": "event_id_only"}), 0),
    )
    assert (status, body) == (200, {"rejected": []})
    [request] = fcm.requests
    assert request.message["data"] == {"event_id": EVENT_ID, "room_id": ROOM_ID, "prio": "high"}
    assert request.message["android"] == {"priority": "high"}


async def test_dendrite_full_frame(
    gw: GatewayHarness, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    """`id` beside `event_id`, Go-escaped HTML in the body, no sender_display_name."""
    pushkey, _ = apns_pushkey()
    status, body = await post(
        gw, dendrite_full(dendrite_device(IOS, pushkey, {"brand": "x"}, DENDRITE_TWEAKS))
    )
    assert (status, body) == (200, {"rejected": []})
    assert apns.requests[0].json == {
        "aps": {
            "alert": {
                "loc-key": "MSG_FROM_USER_IN_ROOM_WITH_CONTENT",
                "loc-args": ["@alice:example.org", "Ops", "a <b> & c"],
            },
            "badge": 3,
            "sound": "default",  # divergence 4: the push rule's sound is honoured
        },
        "room_id": ROOM_ID,
        "event_id": EVENT_ID,
    }
    token = fcm_pushkey()
    status, body = await post(gw, dendrite_full(dendrite_device(ANDROID, token, {"brand": "x"})))
    assert (status, body) == (200, {"rejected": []})
    assert fcm.requests[0].message["data"] == {
        "event_id": EVENT_ID,
        "type": "m.room.message",
        "sender": "@alice:example.org",
        "room_name": "Ops",
        "room_id": ROOM_ID,
        "content_body": "a <b> & c",
        "content_msgtype": "m.text",
        "prio": "high",
        "unread": "3",
    }


async def test_dendrite_badge_updates(
    gw: GatewayHarness, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    """userapi/util/notify.go: no event_id, room_id, type or sender at all."""
    pushkey, _ = apns_pushkey()
    data = {"default_payload": ELEMENT_IOS_PAYLOAD, "format": "event_id_only"}
    for unread in (2, 0):
        status, body = await post(gw, dendrite_badge(dendrite_device(IOS, pushkey, data), unread))
        assert (status, body) == (200, {"rejected": []})
    assert [r.json for r in apns.requests] == [{"aps": {"badge": 2}}, {"aps": {"badge": 0}}]
    token = fcm_pushkey()
    for unread in (2, 0):
        status, body = await post(
            gw, dendrite_badge(dendrite_device(ANDROID, token, {"format": "event_id_only"}), unread)
        )
        assert (status, body) == (200, {"rejected": []})
    # Sygnal's `_build_data`: a zero count and no ids leave nothing to send.
    assert [r.message["data"] for r in fcm.requests] == [{"prio": "high", "unread": "2"}]


async def test_dendrite_rejected_pushkey_matches_what_it_sent(
    gw: GatewayHarness, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    """roomserver.go (`notifyHTTP`) deletes the pushers whose pushkey is in `rejected`,
    matched exactly against the pushkeys it sent."""
    pushkey, hexkey = apns_pushkey()
    apns.script(hexkey, ApnsResponse.error("Unregistered"))
    status, body = await post(
        gw, dendrite_full(dendrite_device(IOS, pushkey, {"brand": "x"}, DENDRITE_TWEAKS))
    )
    assert (status, body) == (200, {"rejected": [pushkey]})
    token = fcm_pushkey()
    fcm.script(token, FcmResponse.unregistered())
    status, body = await post(
        gw,
        dendrite_event_id_only(dendrite_device(ANDROID, token, {"format": "event_id_only"}), 1),
    )
    assert (status, body) == (200, {"rejected": [token]})


async def test_dendrite_pusher_without_data_is_refused_as_sygnal_refuses_it(
    gw: GatewayHarness, apns: ApnsSimulator
) -> None:
    """userapi/util/devices.go (`mapWithout` returns nil when the pusher's data held only
    `url`) with pushgateway.go (`Data` has no `omitempty`): `"data": null`. Sygnal's
    `get_key(raw, "data", dict)` answers 400 `data is of invalid type`, and so does
    matrix.md §1.1 ("null included"). Dendrite logs the failure and drops the push: a
    url-only pusher on Dendrite gets no notifications from either gateway. Asserted as
    specified; reported."""
    pushkey, _ = apns_pushkey()
    status, body = await post(gw, dendrite_full(dendrite_device(IOS, pushkey, None)))
    assert (status, body) == (400, "data is of invalid type")
    assert apns.requests == []


# --- Conduit / conduwuit / continuwuity ------------------------------------------------


def ruma_device(app_id: str, pushkey: str, **extra: Any) -> dict[str, Any]:
    return {"app_id": app_id, "pushkey": pushkey, **extra}


def conduit_event_id_only(device: dict[str, Any], *, unread: int, prio: str | None) -> bytes:
    notification: dict[str, Any] = {"event_id": EVENT_ID, "room_id": ROOM_ID}
    if prio is not None:
        notification["prio"] = prio
    if unread:
        notification["counts"] = {"unread": unread}
    notification["devices"] = [device]
    return rust_json({"notification": notification})


def continuwuity_full(device: dict[str, Any]) -> bytes:
    return rust_json(
        {
            "notification": {
                "event_id": EVENT_ID,
                "room_id": ROOM_ID,
                "type": "m.room.message",
                "sender": "@alice:example.org",
                "sender_display_name": "Alice",
                "room_name": "Ops",
                "room_alias": "#ops:example.org",
                "prio": "low",
                "content": {"msgtype": "m.text", "body": "héllo", "m.mentions": {}},
                "devices": [device],
            }
        }
    )


async def test_conduit_event_id_only_low_priority_without_counts_or_pushkey_ts(
    gw: GatewayHarness, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    pushkey, _ = apns_pushkey()
    device = ruma_device(IOS, pushkey, data={"format": "event_id_only"})
    status, body = await post(gw, conduit_event_id_only(device, unread=0, prio="low"))
    assert (status, body) == (200, {"rejected": []})
    [request] = apns.requests
    assert request.json == {"room_id": ROOM_ID, "event_id": EVENT_ID}
    assert request.headers["apns-priority"] == "5"
    token = fcm_pushkey()
    status, body = await post(
        gw, conduit_event_id_only(ruma_device(ANDROID, token), unread=4, prio=None)
    )
    assert (status, body) == (200, {"rejected": []})
    [request] = fcm.requests
    assert request.message["data"] == {
        "event_id": EVENT_ID,
        "room_id": ROOM_ID,
        "prio": "high",  # ruma omits `prio` when it is `high`
        "unread": "4",
    }


async def test_continuwuity_full_frame_with_extra_pusher_data(
    gw: GatewayHarness, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    """`devices[].data` is the pusher's whole data (MSC4076 key included, so no
    `counts`); tweaks as ruma serialises them, `highlight: false` and a custom one."""
    tweaks = {"highlight": False, "sound": "ping", "org.example.x": {"a": 1}}
    data = {"org.matrix.msc4076.disable_badge_count": True, "brand": "FluffyChat"}
    pushkey, _ = apns_pushkey()
    status, body = await post(
        gw, continuwuity_full(ruma_device(IOS, pushkey, data=data, tweaks=tweaks))
    )
    assert (status, body) == (200, {"rejected": []})
    [request] = apns.requests
    assert request.json == {
        "aps": {
            "alert": {
                "loc-key": "MSG_FROM_USER_IN_ROOM_WITH_CONTENT",
                "loc-args": ["Alice", "Ops", "héllo"],
            },
            "sound": "ping",
        },
        "room_id": ROOM_ID,
        "event_id": EVENT_ID,
    }
    assert request.headers["apns-priority"] == "5"
    token = fcm_pushkey()
    status, body = await post(gw, continuwuity_full(ruma_device(ANDROID, token, data=data)))
    assert (status, body) == (200, {"rejected": []})
    assert fcm.requests[0].message["data"] == {
        "event_id": EVENT_ID,
        "type": "m.room.message",
        "sender": "@alice:example.org",
        "room_name": "Ops",
        "room_alias": "#ops:example.org",
        "sender_display_name": "Alice",
        "room_id": ROOM_ID,
        "content_msgtype": "m.text",
        "content_body": "héllo",
        "prio": "normal",
    }
    assert fcm.requests[0].message["android"] == {"priority": "normal"}


# --- older Synapse ---------------------------------------------------------------------


async def test_older_synapse_frames_with_empty_tweaks(
    gw: GatewayHarness, apns: ApnsSimulator
) -> None:
    """Synapse before 1.83 sent `tweaks` in every frame, `{}` included, and badge
    updates with `tweaks: {}` too."""
    pushkey, _ = apns_pushkey()
    device = {
        "app_id": IOS,
        "pushkey": pushkey,
        "pushkey_ts": 1_600_000_000,
        "data": {},
        "tweaks": {},
    }
    full = {
        "notification": {
            "id": EVENT_ID,
            "event_id": EVENT_ID,
            "room_id": ROOM_ID,
            "type": "m.room.encrypted",
            "sender": "@alice:example.org",
            "prio": "high",
            "counts": {"unread": 1},
            "devices": [device],
        }
    }
    badge = {
        "notification": {
            "id": "",
            "type": None,
            "sender": "",
            "counts": {"unread": 0},
            "devices": [device],
        }
    }
    for frame in (full, badge):
        status, body = await post(gw, json.dumps(frame).encode())
        assert (status, body) == (200, {"rejected": []})
    assert [r.json for r in apns.requests] == [
        {
            "aps": {
                "alert": {"loc-key": "MSG_FROM_USER", "loc-args": ["@alice:example.org"]},
                "badge": 1,
            },
            "room_id": ROOM_ID,
            "event_id": EVENT_ID,
        },
        {"aps": {"badge": 0}},
    ]


# --- transport variants ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "encode"),
    [
        ({"Content-Type": "application/json; charset=utf-8"}, lambda raw: raw),
        ({"Content-Type": "application/json", "Content-Encoding": "gzip"}, gzip.compress),
        ({"Content-Type": "application/json", "Content-Encoding": "deflate"}, zlib.compress),
        ({}, lambda raw: raw + b"\n"),  # no Content-Type; json.Encoder's trailing newline
    ],
    ids=["charset", "gzip", "deflate", "bare"],
)
async def test_transport_variants(
    gw: GatewayHarness, apns: ApnsSimulator, headers: dict[str, str], encode: Any
) -> None:
    pushkey, _ = apns_pushkey()
    raw = dendrite_event_id_only(dendrite_device(IOS, pushkey, {"format": "event_id_only"}), 5)
    response = await gw.client.post(NOTIFY, data=encode(raw), headers=headers)
    assert response.status == 200
    assert json.loads(await response.text()) == {"rejected": []}
    assert apns.requests[0].json == {"room_id": ROOM_ID, "event_id": EVENT_ID, "unread_count": 5}

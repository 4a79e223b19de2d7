"""matrix.md §3 (APNs) and §4 (FCM): payloads exactly as Sygnal builds them."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugins.matrix.payloads import (
    MAX_DEFAULT_PAYLOAD_DEPTH,
    PayloadRejected,
    apns_payload,
    encode,
    fcm_data,
    fcm_message,
    fit_apns,
    fit_fcm_data,
    nested_deeper_than,
    truncate_bytes,
)
from plugins.matrix.validation import Device, parse_notification

SENDER = "@alice:example.org"


def notif(**fields: Any) -> Any:
    fields.setdefault("devices", [{"app_id": "a", "pushkey": "k"}])
    return parse_notification({"notification": fields})


def dev(data: dict[str, Any] | None = None, sound: str | None = None) -> Device:
    return Device("a", "k", 0, data, sound)


def loc(**fields: Any) -> tuple[str, list[str]] | None:
    payload = apns_payload(notif(**fields), dev())
    assert payload is not None
    alert = payload["aps"].get("alert")
    return (alert["loc-key"], alert["loc-args"]) if alert else None


MSG = {"type": "m.room.message", "sender": SENDER, "sender_display_name": "Alice"}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {**MSG, "room_name": "Room", "content": {"msgtype": "m.image", "body": "pic.png"}},
            ("IMAGE_FROM_USER_IN_ROOM", ["Alice", "pic.png", "Room"]),
        ),
        (
            {**MSG, "room_name": "Room", "content": {"msgtype": "m.text", "body": "hi"}},
            ("MSG_FROM_USER_IN_ROOM_WITH_CONTENT", ["Alice", "Room", "hi"]),
        ),
        (
            {**MSG, "room_alias": "#r:x", "content": {"msgtype": "m.notice", "body": "hi"}},
            ("MSG_FROM_USER_IN_ROOM_WITH_CONTENT", ["Alice", "#r:x", "hi"]),
        ),
        (
            {**MSG, "room_name": "Room", "content": {"msgtype": "m.emote", "body": "waves"}},
            ("ACTION_FROM_USER_IN_ROOM", ["Room", "Alice", "waves"]),
        ),
        (
            {**MSG, "room_name": "Room", "content": {"msgtype": "m.text"}},
            ("MSG_FROM_USER_IN_ROOM", ["Alice", "Room"]),
        ),
        (
            {**MSG, "room_name": "Room", "content": {"msgtype": "m.text", "body": 5}},
            ("MSG_FROM_USER_IN_ROOM", ["Alice", "Room"]),
        ),
        (
            {**MSG, "content": {"msgtype": "m.image", "body": "pic"}},
            ("IMAGE_FROM_USER", ["Alice", "pic"]),
        ),
        (
            {**MSG, "content": {"msgtype": "m.text", "body": "hi"}},
            ("MSG_FROM_USER_WITH_CONTENT", ["Alice", "hi"]),
        ),
        (
            {**MSG, "content": {"msgtype": "m.emote", "body": "waves"}},
            ("ACTION_FROM_USER", ["Alice", "waves"]),
        ),
        ({**MSG}, ("MSG_FROM_USER", ["Alice"])),
        (
            {**MSG, "type": "m.room.encrypted", "room_name": "Room"},
            ("MSG_FROM_USER_IN_ROOM", ["Alice", "Room"]),
        ),
        (
            {**MSG, "type": "m.call.invite", "content": {"offer": {"sdp": "v=0\r\nm=video 9"}}},
            ("VIDEO_CALL_FROM_USER", ["Alice"]),
        ),
        (
            {**MSG, "type": "m.call.invite", "content": {"offer": {"sdp": "m=audio"}}},
            ("VOICE_CALL_FROM_USER", ["Alice"]),
        ),
        ({**MSG, "type": "m.call.invite"}, ("VOICE_CALL_FROM_USER", ["Alice"])),
        (
            {
                **MSG,
                "type": "m.room.member",
                "user_is_target": True,
                "membership": "invite",
                "room_name": "Room",
                "room_alias": "#r:x",
            },
            ("USER_INVITE_TO_NAMED_ROOM", ["Alice", "Room"]),
        ),
        (
            {
                **MSG,
                "type": "m.room.member",
                "user_is_target": True,
                "membership": "invite",
                "room_alias": "#r:x",
            },
            ("USER_INVITE_TO_NAMED_ROOM", ["Alice", "#r:x"]),
        ),
        (
            {**MSG, "type": "m.room.member", "user_is_target": True, "membership": "invite"},
            ("USER_INVITE_TO_CHAT", ["Alice"]),
        ),
        ({**MSG, "type": "m.sticker"}, ("MSG_FROM_USER", ["Alice"])),
        ({"type": "m.sticker", "sender": SENDER}, ("MSG_FROM_USER", [SENDER])),
        ({"type": "m.sticker"}, ("MSG_FROM_USER", [" "])),
        (
            {"type": "m.sticker", "sender": SENDER, "sender_display_name": ""},
            ("MSG_FROM_USER", [""]),
        ),
    ],
)
def test_loc_keys(fields: dict[str, Any], expected: tuple[str, list[str]]) -> None:
    assert loc(**fields) == expected


def test_other_member_event_sends_badge_only() -> None:
    payload = apns_payload(
        notif(**{**MSG, "type": "m.room.member"}, membership="join", counts={"unread": 1}), dev()
    )
    assert payload == {"aps": {"badge": 1}}
    member = notif(**{**MSG, "type": "m.room.member"}, membership="join")
    assert apns_payload(member, dev()) is None


def test_full_payload_with_default_payload_and_badge() -> None:
    n = notif(
        **MSG,
        event_id="$e",
        room_id="!r",
        room_name="Room",
        content={"msgtype": "m.text", "body": "hi"},
        counts={"unread": 2, "missed_calls": 0},
    )
    data = {
        "default_payload": {
            "aps": {"mutable-content": 1, "alert": {"loc-key": "X", "x": 1}},
            "extra": True,
        }
    }
    payload = apns_payload(n, dev(data))
    assert payload == {
        "aps": {
            "mutable-content": 1,
            "alert": {
                "loc-key": "MSG_FROM_USER_IN_ROOM_WITH_CONTENT",
                "x": 1,
                "loc-args": ["Alice", "Room", "hi"],
            },
            "badge": 2,
        },
        "extra": True,
        "room_id": "!r",
        "event_id": "$e",
    }
    assert data["default_payload"]["aps"]["alert"]["loc-key"] == "X"  # not mutated


def test_string_alert_in_default_payload_is_replaced() -> None:
    payload = apns_payload(notif(**MSG), dev({"default_payload": {"aps": {"alert": "x"}}}))
    assert payload is not None
    assert payload["aps"]["alert"] == {"loc-key": "MSG_FROM_USER", "loc-args": ["Alice"]}


def test_event_id_only() -> None:
    n = notif(event_id="$e", room_id="!r", counts={"unread": 0, "missed_calls": 3})
    payload = apns_payload(n, dev({"default_payload": {"aps": {"content-available": 1}}}))
    assert payload == {
        "aps": {"content-available": 1},
        "room_id": "!r",
        "event_id": "$e",
        "unread_count": 0,
        "missed_calls": 3,
    }
    assert "unread_count" not in (apns_payload(n, dev(), send_badge_counts=False) or {})


def test_badge_frame_ignores_default_payload() -> None:
    n = notif(id="", type=None, sender="", counts={"unread": 4})
    assert apns_payload(n, dev({"default_payload": {"a": 1}})) == {"aps": {"badge": 4}}
    assert apns_payload(n, dev(), send_badge_counts=False) is None


def test_badge_sum_and_zero() -> None:
    n = notif(**MSG, counts={"unread": 0})
    assert apns_payload(n, dev())["aps"]["badge"] == 0  # type: ignore[index]
    n = notif(**MSG, counts={"missed_calls": 2})
    assert apns_payload(n, dev())["aps"]["badge"] == 2  # type: ignore[index]
    assert "badge" not in apns_payload(notif(**MSG), dev())["aps"]  # type: ignore[index]


def test_default_payload_not_an_object_is_rejected() -> None:
    with pytest.raises(PayloadRejected):
        apns_payload(notif(**MSG), dev({"default_payload": [1]}))
    with pytest.raises(PayloadRejected):
        fcm_data(notif(**MSG, event_id="$e"), dev({"default_payload": "x"}))


def _nested(levels: int) -> dict[str, Any]:
    """A default_payload `levels` objects deep ({"aps": {}} is two)."""
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def test_default_payload_nested_too_deeply_is_rejected() -> None:
    fits = dev({"default_payload": _nested(MAX_DEFAULT_PAYLOAD_DEPTH)})
    assert apns_payload(notif(**MSG), fits) is not None
    assert fcm_data(notif(**MSG, event_id="$e"), fits) is not None
    # 600 levels: copy.deepcopy used to raise RecursionError (a 500).
    for levels in (MAX_DEFAULT_PAYLOAD_DEPTH + 1, 600):
        too_deep = dev({"default_payload": _nested(levels)})
        with pytest.raises(PayloadRejected):
            apns_payload(notif(**MSG), too_deep)
        with pytest.raises(PayloadRejected):
            fcm_data(notif(**MSG, event_id="$e"), too_deep)
    listed = {"a": [[[]]], "b": 1}  # four levels: arrays count too
    assert not nested_deeper_than(listed, 4) and nested_deeper_than(listed, 3)


def test_sound_divergence() -> None:
    payload = apns_payload(notif(**MSG), dev(sound="ping.caf"))
    assert payload is not None and payload["aps"]["sound"] == "ping.caf"
    payload = apns_payload(notif(**MSG), dev(sound="ping.caf"), honour_sound=False)
    assert payload is not None and "sound" not in payload["aps"]
    payload = apns_payload(notif(**MSG), dev({"default_payload": {"aps": {"sound": "x"}}}, "y"))
    assert payload is not None and payload["aps"]["sound"] == "x"
    badge_only = apns_payload(notif(counts={"unread": 1}, type=None), dev(sound="ping"))
    assert badge_only == {"aps": {"badge": 1}}


def test_long_fields_cut_to_1024_characters() -> None:
    payload = apns_payload(
        notif(**{**MSG, "sender_display_name": "é" * 2000}, room_name="r" * 1500), dev()
    )
    assert payload is not None
    args = payload["aps"]["alert"]["loc-args"]
    assert args == ["é" * 1024, "r" * 1024]


# --- truncation ------------------------------------------------------------------


def test_6000_character_body_fits_with_loc_key() -> None:
    n = notif(**MSG, room_name="Room", content={"msgtype": "m.text", "body": "x" * 6000})
    payload = fit_apns(apns_payload(n, dev()))  # type: ignore[arg-type]
    assert len(encode(payload)) == 4096
    assert payload["aps"]["alert"]["loc-key"] == "MSG_FROM_USER_IN_ROOM_WITH_CONTENT"
    assert payload["aps"]["alert"]["loc-args"][:2] == ["Alice", "Room"]


def test_multibyte_cut_on_character_boundaries() -> None:
    n = notif(**MSG, room_name="Room", content={"msgtype": "m.text", "body": "日本語" * 800})
    payload = fit_apns(apns_payload(n, dev()))  # type: ignore[arg-type]
    body = payload["aps"]["alert"]["loc-args"][2]
    assert len(encode(payload)) <= 4096
    assert len(encode(payload)) > 4096 - 3
    assert set(body) <= set("日本語")


def test_unfittable_payload_rejected() -> None:
    with pytest.raises(PayloadRejected):
        fit_apns({"event_id": "x" * 5000})
    with pytest.raises(PayloadRejected):
        fit_apns({"aps": {"badge": 1}, "big": "x" * 5000})


def _sygnal_truncate(payload: dict[str, Any], limit: int) -> dict[str, Any]:
    """A direct transcription of the rule in matrix.md §3, one character per step."""
    payload = copy.deepcopy(payload)
    aps = payload["aps"]

    def fields() -> list[tuple[str, int]]:
        alert = aps.get("alert")
        if isinstance(alert, str):
            return [("alert", 0)]
        out = []
        if isinstance(alert, dict):
            if isinstance(alert.get("body"), str):
                out.append(("body", 0))
            out += [("arg", i) for i in range(len(alert.get("loc-args", [])))]
        return out

    def get(f: tuple[str, int]) -> str:
        if f[0] == "alert":
            return aps["alert"]  # type: ignore[no-any-return]
        if f[0] == "body":
            return aps["alert"]["body"]  # type: ignore[no-any-return]
        return aps["alert"]["loc-args"][f[1]]  # type: ignore[no-any-return]

    def put(f: tuple[str, int], v: str) -> None:
        if f[0] == "alert":
            aps["alert"] = v
        elif f[0] == "body":
            aps["alert"]["body"] = v
        else:
            aps["alert"]["loc-args"][f[1]] = v

    while len(encode(payload)) > limit:
        best, best_len = None, 0
        for f in fields():
            n = len(get(f).encode())
            if n > best_len:
                best, best_len = f, n
        if best is None:
            raise PayloadRejected("no")
        put(best, get(best)[:-1])
    return payload


_text = st.text(alphabet=st.sampled_from(list('ab"\\\n\x01é日😀 ')), max_size=300)


@settings(max_examples=200, deadline=None)
@given(
    body=_text,
    args=st.lists(_text, max_size=4),
    alert_string=st.booleans(),
    limit=st.integers(min_value=20, max_value=400),
)
def test_truncation_matches_the_one_char_at_a_time_rule(
    body: str, args: list[str], alert_string: bool, limit: int
) -> None:
    alert: Any = body if alert_string else {"body": body, "loc-args": args}
    payload = {"aps": {"alert": alert, "badge": 1}, "room_id": "!r"}
    try:
        expected = _sygnal_truncate(payload, limit)
    except PayloadRejected:
        with pytest.raises(PayloadRejected):
            fit_apns(payload, limit)
        return
    assert fit_apns(payload, limit) == expected


# --- FCM -------------------------------------------------------------------------


def test_fcm_v1_data_exact() -> None:
    n = notif(
        **MSG,
        event_id="$e",
        room_id="!r",
        room_name="Room",
        content={"msgtype": "m.text", "body": "hi", "format": 5, "nested": {"a": 1}},
        counts={"unread": 2, "missed_calls": 0},
        prio="high",
    )
    data = fcm_data(n, dev({"default_payload": {"flag": True, "n": 1, "s": "v"}}))
    assert data == {
        "flag": "true",
        "n": "1",
        "s": "v",
        "event_id": "$e",
        "type": "m.room.message",
        "sender": SENDER,
        "room_name": "Room",
        "sender_display_name": "Alice",
        "room_id": "!r",
        "content_msgtype": "m.text",
        "content_body": "hi",
        "prio": "high",
        "unread": "2",
    }
    assert list(data)[:6] == ["flag", "n", "s", "event_id", "type", "sender"]


def test_fcm_legacy_data_keeps_content_and_int_counts() -> None:
    n = notif(event_id="$e", content={"body": "x", "n": 1}, counts={"unread": 3}, prio="low")
    assert fcm_data(n, dev(), v1=False) == {
        "event_id": "$e",
        "content": {"body": "x", "n": 1},
        "prio": "normal",
        "unread": 3,
    }


def test_fcm_event_id_only() -> None:
    n = notif(event_id="$e", room_id="!r", counts={"unread": 2, "missed_calls": 0})
    assert fcm_data(n, dev()) == {"event_id": "$e", "room_id": "!r", "prio": "high", "unread": "2"}


def test_fcm_badge_frame() -> None:
    n = notif(id="", type=None, sender="", counts={"unread": 1})
    assert fcm_data(n, dev()) == {"sender": "", "prio": "high", "unread": "1"}
    assert fcm_data(n, dev(), send_badge_counts=False) is None
    assert fcm_data(notif(id="", sender="", counts={"unread": 0}), dev()) is None


def test_1024_byte_rule() -> None:
    assert truncate_bytes("a" * 1024) == "a" * 1024
    cut = truncate_bytes("r" * 1500)
    assert cut == "r" * 1021 + "…"
    straddle = truncate_bytes("a" * 1020 + "語" * 10)  # 語 spans bytes 1020..1022
    assert straddle == "a" * 1020 + "…"
    n = notif(event_id="$e", room_name="r" * 1500)
    assert fcm_data(n, dev())["room_name"] == "r" * 1021 + "…"  # type: ignore[index]


def test_fcm_size_guard() -> None:
    data = {f"content_k{i}": "x" * 900 for i in range(4)}
    data.update(
        event_id="$e",
        room_id="!r",
        prio="high",
        unread="1",
        content_body="b" * 900,
        room_name="n" * 800,
    )
    fitted = fit_fcm_data(data)
    assert len(encode(fitted)) <= 4096
    assert {"event_id", "room_id", "prio", "unread", "content_body", "room_name"} <= set(fitted)
    with pytest.raises(PayloadRejected):
        fit_fcm_data({"event_id": "e" * 5000})


def test_fcm_message_merges_fcm_options() -> None:
    options = {"android": {"ttl": "60s"}, "apns": {"headers": {"apns-priority": "10"}}}
    message = fcm_message({"a": "b"}, fcm_options=options, low_priority=True)
    assert message == {
        "android": {"ttl": "60s", "priority": "normal"},
        "apns": {"headers": {"apns-priority": "10"}},
        "data": {"a": "b"},
    }
    assert options["android"] == {"ttl": "60s"}
    assert json.loads(encode(message)) == message

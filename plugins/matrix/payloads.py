"""Provider payloads exactly as Sygnal builds them (matrix.md §3, §4), plus the fixes.

Pure functions. `None` from a builder means "nothing to send, the device is accepted";
`PayloadRejected` means "reject the pushkey, send nothing".
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from gateway.api import fcm_data_size_bound
from plugins.matrix.validation import Device, Notification

__all__ = [
    "APNS_LIMIT",
    "FCM_DATA_LIMIT",
    "MAX_DEFAULT_PAYLOAD_DEPTH",
    "PayloadRejected",
    "apns_payload",
    "apns_priority",
    "encode",
    "fcm_data",
    "fcm_message",
    "fit_apns",
    "fit_fcm_data",
    "truncate_bytes",
]

APNS_LIMIT = 4096
FCM_DATA_LIMIT = 4096
MAX_FIELD_CHARS = 1024  # APNs: from/room display cut, in characters (Sygnal MAX_FIELD_LENGTH)
MAX_FIELD_BYTES = 1024  # FCM: per-field limit in UTF-8 bytes (Sygnal MAX_BYTES_PER_FIELD)
# Real default_payloads nest 2-4 levels; Sygnal's APNs path fails (500) a few hundred down.
MAX_DEFAULT_PAYLOAD_DEPTH = 100

_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def encode(payload: Any) -> bytes:
    """The exact bytes the core sends (compact UTF-8 JSON)."""
    return _encoder.encode(payload).encode("utf-8")


class PayloadRejected(Exception):
    """The pushkey is rejected without sending (bad default_payload, unfittable payload)."""


def nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests objects/arrays more than `limit` levels (itself = 1).

    Iterative, so any depth the decoder accepted can be measured."""
    pending = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if not isinstance(node, (dict, list)):
            continue
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        pending.extend((child, depth + 1) for child in children)
    return False


def default_payload_of(device: Device) -> dict[str, Any] | None:
    """The device's `default_payload` ({} when absent); raise when it is not an object
    or nests more than MAX_DEFAULT_PAYLOAD_DEPTH levels.

    The depth bound keeps every later copy and JSON encoding of the payload (here, in
    build.py and in the core) far from the interpreter's recursion limit. Like a
    non-object `default_payload`, it is pusher data the homeserver resends unchanged
    with every notification, so the pushkey is rejected rather than the request
    refused: a 400 would be retried for a day and block that pusher's later pushes.
    """
    if device.data is None:
        return None
    value = device.data.get("default_payload", {})
    if not isinstance(value, dict):
        raise PayloadRejected("default_payload is not an object")
    if nested_deeper_than(value, MAX_DEFAULT_PAYLOAD_DEPTH):
        raise PayloadRejected("default_payload nested too deeply")
    return value


def apns_priority(n: Notification) -> int:
    return 5 if n.prio == "low" else 10


# --- APNs ---------------------------------------------------------------------------


def _badge(n: Notification, send_badge_counts: bool) -> int | None:
    if not send_badge_counts:
        return None
    badge = None
    if n.counts.unread is not None:
        badge = n.counts.unread
    if n.counts.missed_calls is not None:
        badge = (badge or 0) + n.counts.missed_calls
    return badge


def _loc(n: Notification) -> tuple[str | None, list[str] | None]:
    if not n.sender and not n.sender_display_name:
        sender = " "
    elif n.sender_display_name is not None:
        sender = n.sender_display_name
    else:
        sender = n.sender or ""
    sender = sender[:MAX_FIELD_CHARS]

    if n.type in ("m.room.message", "m.room.encrypted"):
        room = n.room_name or n.room_alias or None
        if room:
            room = room[:MAX_FIELD_CHARS]
        text = action = None
        image = False
        content = n.content
        if content and "msgtype" in content and isinstance(content.get("body"), str):
            body = content["body"]
            if content["msgtype"] == "m.emote":
                action = body
            else:
                text = body
            image = content["msgtype"] == "m.image"
        if room:
            if image:
                return "IMAGE_FROM_USER_IN_ROOM", [sender, text or "", room]
            if text:
                return "MSG_FROM_USER_IN_ROOM_WITH_CONTENT", [sender, room, text]
            if action:
                return "ACTION_FROM_USER_IN_ROOM", [room, sender, action]
            return "MSG_FROM_USER_IN_ROOM", [sender, room]
        if image:
            return "IMAGE_FROM_USER", [sender, text or ""]
        if text:
            return "MSG_FROM_USER_WITH_CONTENT", [sender, text]
        if action:
            return "ACTION_FROM_USER", [sender, action]
        return "MSG_FROM_USER", [sender]
    if n.type == "m.call.invite":
        offer = n.content.get("offer") if n.content else None
        sdp = offer.get("sdp") if isinstance(offer, dict) else None
        video = isinstance(sdp, str) and "m=video" in sdp
        return ("VIDEO_CALL_FROM_USER" if video else "VOICE_CALL_FROM_USER"), [sender]
    if n.type == "m.room.member":
        if n.user_is_target and n.membership == "invite":
            room = n.room_name or n.room_alias
            if room:
                return "USER_INVITE_TO_NAMED_ROOM", [sender, room[:MAX_FIELD_CHARS]]
            return "USER_INVITE_TO_CHAT", [sender]
        return None, None
    if n.type:
        return "MSG_FROM_USER", [sender]
    return None, None


def is_event_id_only(n: Notification) -> bool:
    return bool(n.event_id) and not n.type


def apns_payload(
    n: Notification,
    device: Device,
    *,
    send_badge_counts: bool = True,
    honour_sound: bool = True,
) -> dict[str, Any] | None:
    """The APNs JSON body for a plain notification, before truncation; None: send nothing."""
    default_payload = default_payload_of(device)
    if is_event_id_only(n):
        payload = dict(default_payload or {})
        if n.room_id:
            payload["room_id"] = n.room_id
        payload["event_id"] = n.event_id
        if send_badge_counts:
            if n.counts.unread is not None:
                payload["unread_count"] = n.counts.unread
            if n.counts.missed_calls is not None:
                payload["missed_calls"] = n.counts.missed_calls
        return payload

    loc_key, loc_args = _loc(n)
    badge = _badge(n, send_badge_counts)
    if loc_key is None and badge is None:
        return None
    payload = copy.deepcopy(default_payload) if n.type and default_payload else {}
    aps = payload.get("aps")
    if not isinstance(aps, dict):
        aps = payload["aps"] = {}
    if loc_key:
        alert = aps.get("alert")
        if not isinstance(alert, dict):
            alert = aps["alert"] = {}
        alert["loc-key"] = loc_key
        alert["loc-args"] = loc_args
    if badge is not None:
        aps["badge"] = badge
    if loc_key:
        if n.room_id:
            payload["room_id"] = n.room_id
        if n.event_id:
            payload["event_id"] = n.event_id
    if honour_sound:
        add_sound(payload, device)
    return payload


def add_sound(payload: dict[str, Any], device: Device) -> bool:
    """Divergence: `tweaks.sound` becomes `aps.sound` on alerting payloads.

    Returns whether a sound was added (callers drop it again if it cannot fit)."""
    aps = payload.get("aps")
    if device.sound and isinstance(aps, dict) and "alert" in aps and "sound" not in aps:
        aps["sound"] = device.sound
        return True
    return False


def _json_len(text: str) -> list[int]:
    """Encoded size of each character of `text` inside a compact JSON string."""
    sizes = []
    for char in text:
        code = ord(char)
        if char in '"\\' or char in "\n\r\t\b\f":
            sizes.append(2)
        elif code < 0x20:
            sizes.append(6)
        else:
            sizes.append(len(char.encode("utf-8")))
    return sizes


def fit_apns(payload: dict[str, Any], limit: int = APNS_LIMIT) -> dict[str, Any]:
    """Sygnal's truncation: shorten the longest alert text until the body fits.

    Removes one character at a time from the longest (UTF-8 bytes) of `aps.alert`
    (string), `aps.alert.body`, `aps.alert.loc-args[i]` (ties in that order) and stops
    as soon as the compact encoding fits. Raises PayloadRejected when it cannot fit.
    """
    size = len(encode(payload))
    if size <= limit:
        return payload
    aps = payload.get("aps")
    if not isinstance(aps, dict):
        raise PayloadRejected("payload too large and nothing to shorten")
    payload = dict(payload)
    aps = payload["aps"] = copy.deepcopy(aps)
    alert = aps.get("alert")
    # (getter, setter) pairs in tie-break order
    fields: list[tuple[str, Any]] = []
    if isinstance(alert, str):
        fields.append(("alert", None))
    elif isinstance(alert, dict):
        if isinstance(alert.get("body"), str):
            fields.append(("body", None))
        args = alert.get("loc-args")
        if isinstance(args, list):
            fields.extend(("arg", i) for i, a in enumerate(args) if isinstance(a, str))

    def get(f: tuple[str, Any]) -> str:
        kind, index = f
        if kind == "alert":
            return aps["alert"]  # type: ignore[no-any-return]
        if kind == "body":
            return aps["alert"]["body"]  # type: ignore[no-any-return]
        return aps["alert"]["loc-args"][index]  # type: ignore[no-any-return]

    def put(f: tuple[str, Any], value: str) -> None:
        kind, index = f
        if kind == "alert":
            aps["alert"] = value
        elif kind == "body":
            aps["alert"]["body"] = value
        else:
            aps["alert"]["loc-args"][index] = value

    texts = [get(f) for f in fields]
    lengths = [len(t) for t in texts]  # characters kept
    utf8 = [len(t.encode("utf-8")) for t in texts]
    costs = [_json_len(t) for t in texts]
    while size > limit:
        best = -1
        for i, length in enumerate(utf8):
            if length > 0 and (best < 0 or length > utf8[best]):
                best = i
        if best < 0:
            raise PayloadRejected("payload too large and nothing left to shorten")
        lengths[best] -= 1
        char = texts[best][lengths[best]]
        utf8[best] -= len(char.encode("utf-8"))
        size -= costs[best][lengths[best]]
    for f, text, length in zip(fields, texts, lengths, strict=True):
        put(f, text[:length])
    return payload


# --- FCM ----------------------------------------------------------------------------

_FCM_FIELDS = (
    "event_id",
    "type",
    "sender",
    "room_name",
    "room_alias",
    "membership",
    "sender_display_name",
    "content",
    "room_id",
)
# v1 size guard: what may be dropped, in order (content_* keys first, handled apart).
_FCM_DROPPABLE = ("room_name", "room_alias", "sender_display_name", "sender", "membership", "type")


def truncate_bytes(text: str, max_bytes: int = MAX_FIELD_BYTES) -> str:
    """Sygnal's truncate_str: over `max_bytes`, keep whole characters of the first
    `max_bytes - 3` bytes and append `…`."""
    raw = text.encode("utf-8")
    if len(raw) <= max_bytes:
        return text
    return raw[: max_bytes - 3].decode("utf-8", "ignore") + "…"


def fcm_counts(n: Notification, send_badge_counts: bool, v1: bool = True) -> dict[str, Any]:
    counts: dict[str, Any] = {}
    if send_badge_counts:
        if n.counts.unread:
            counts["unread"] = str(n.counts.unread) if v1 else n.counts.unread
        if n.counts.missed_calls:
            counts["missed_calls"] = str(n.counts.missed_calls) if v1 else n.counts.missed_calls
    return counts


def stringify(value: Any) -> str:
    return value if isinstance(value, str) else _encoder.encode(value)


def fcm_data(
    n: Notification, device: Device, *, send_badge_counts: bool = True, v1: bool = True
) -> dict[str, Any] | None:
    """The FCM `data` map (§4 steps 1-7); None: nothing to send."""
    default_payload = default_payload_of(device)
    data: dict[str, Any] = dict(default_payload or {})
    for attr in _FCM_FIELDS:
        if attr == "content":
            if n.content is not None:
                data["content"] = n.content
            continue
        value = getattr(n, attr)
        if value is not None:
            data[attr] = truncate_bytes(value)
    if v1 and isinstance(data.get("content"), dict):
        content = data.pop("content")
        for key, value in content.items():
            if isinstance(value, str):
                data["content_" + key] = truncate_bytes(value)
    data["prio"] = "normal" if n.prio == "low" else "high"
    counts = fcm_counts(n, send_badge_counts, v1)
    if not data.get("room_id") and not data.get("event_id") and not counts:
        return None
    data.update(counts)
    if v1:
        data = {k: stringify(v) for k, v in data.items()}
    return data


def fit_fcm_data(data: dict[str, str], limit: int = FCM_DATA_LIMIT) -> dict[str, str]:
    """v1 size guard (divergence): drop optional keys until the data map fits."""
    chars = sum(len(key) + len(value) for key, value in data.items())
    if fcm_data_size_bound(chars, len(data)) <= limit or len(encode(data)) <= limit:
        return data
    data = dict(data)
    contents = sorted(
        (k for k in data if k.startswith("content_") and k != "content_body"),
        key=lambda k: -len(data[k].encode("utf-8")),
    )
    order = [*contents, "content_body", *_FCM_DROPPABLE]
    for key in order:
        if key in data:
            del data[key]
            if len(encode(data)) <= limit:
                return data
    raise PayloadRejected("FCM data too large")


def fcm_message(
    data: Mapping[str, Any], *, fcm_options: Mapping[str, Any], low_priority: bool
) -> dict[str, Any]:
    """The v1 `message` object without `token`: fcm_options, data, android.priority."""
    message = copy.deepcopy(dict(fcm_options)) if fcm_options else {}
    message["data"] = dict(data)
    android = message.get("android")
    android = dict(android) if isinstance(android, dict) else {}
    android["priority"] = "normal" if low_priority else "high"
    message["android"] = android
    return message

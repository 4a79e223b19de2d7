"""Parsing and validating `POST /_matrix/push/v1/notify` bodies (matrix.md §1.1).

Pure functions, no I/O. Every client mistake becomes a `NotifyError` whose message is
the exact plain-text body Sygnal answers with a 400; nothing a client sends can raise
anything else. The parsed `Notification` keeps the original object (`raw`) because
gateway-side MSC3013 encryption encrypts the notification as received.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MSG_BAD_JSON",
    "MSG_BAD_NOTIFICATION",
    "MSG_ENCRYPTED",
    "MSG_NO_DEVICES",
    "Counts",
    "Device",
    "Notification",
    "NotifyError",
    "parse_notification",
    "parse_notify",
]

MSG_BAD_JSON = "Expected JSON request body"
MSG_BAD_NOTIFICATION = "Invalid notification: expecting object in 'notification' key"
MSG_DEVICES = "Expected list in 'devices' key"
MSG_NO_DEVICES = "No devices in notification"
MSG_APP_ID = "Device with missing or non-string app_id"
MSG_PUSHKEY = "Device with missing or non-string pushkey"
MSG_ENCRYPTED = "Invalid encrypted notification"

_STRING_FIELDS = (
    "event_id",
    "room_id",
    "type",
    "sender",
    "sender_display_name",
    "room_name",
    "room_alias",
    "prio",
    "membership",
)
_CRYPTO_FIELDS = ("ciphertext", "ephemeral", "mac")
# A JSON escape that may encode a UTF-16 surrogate (lone surrogates cannot be sent).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Matrix integers (spec appendix, "Canonical JSON"): [-(2**53)+1, (2**53)-1]. Counts
# outside it are no count a homeserver sends, and unbounded ones break payload encoding
# (the APNs badge sums two counts; Python refuses to print integers past 4300 digits).
_MATRIX_INT_MAX = 2**53 - 1


class NotifyError(ValueError):
    """A malformed notify request; `str()` is the exact 400 body."""


@dataclass(frozen=True, slots=True)
class Counts:
    unread: int | None = None
    missed_calls: int | None = None


@dataclass(frozen=True, slots=True)
class Device:
    """One entry of `notification.devices`."""

    app_id: str
    pushkey: str
    pushkey_ts: int = 0
    data: dict[str, Any] | None = None
    sound: str | None = None

    def __repr__(self) -> str:  # never show the pushkey
        return f"Device(app_id={self.app_id!r})"


@dataclass(frozen=True, slots=True)
class Notification:
    """A validated notification. String fields hold None when absent or not a string."""

    raw: dict[str, Any]
    devices: tuple[Device, ...]
    event_id: str | None = None
    room_id: str | None = None
    type: str | None = None
    sender: str | None = None
    sender_display_name: str | None = None
    room_name: str | None = None
    room_alias: str | None = None
    prio: str | None = None
    membership: str | None = None
    user_is_target: bool = False
    content: dict[str, Any] | None = None
    counts: Counts = field(default_factory=Counts)
    has_counts: bool = False
    # MSC3013 homeserver-encrypted frame
    ciphertext: str | None = None
    ephemeral: str | None = None
    mac: str | None = None
    is_counts_only: bool | None = None
    # `parse_notification(..., defer_encrypted=True)`: the MSC3013 fields were malformed
    # and are left out above; the caller answers MSG_ENCRYPTED if a device uses them.
    invalid_encrypted: bool = False

    @property
    def encrypted(self) -> bool:
        return self.ciphertext is not None

    def __repr__(self) -> str:  # never show content
        return f"Notification(devices={len(self.devices)}, encrypted={self.encrypted})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _finite_float(text: str) -> float:
    """A JSON number that overflows (`1e400`) decodes to inf: it is the `Infinity` of
    §1.1 in another spelling, and no encoder downstream (payloads, gateway-encrypt
    plaintext) accepts it, so it is refused here like the constant."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("number out of range")
    return value


def _scrub_string(text: str) -> str:
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _LONE_SURROGATE.sub("\ufffd", text)


def _scrub_surrogates(value: Any) -> Any:
    """Replace lone UTF-16 surrogates (from `\\udXXX` escapes) by U+FFFD in every string
    and key, in place.

    Iterative on purpose: the decoder accepts nesting as deep as the interpreter's
    recursion limit allows at the call site, so a recursive walk could fail (a 500)
    where parsing succeeded. The decoded value is fresh, so mutating it is safe.
    """
    if isinstance(value, str):
        return _scrub_string(value)
    pending = [value]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            if any(_scrub_string(key) is not key for key in node):
                items = list(node.items())
                node.clear()
                node.update((_scrub_string(key), child) for key, child in items)
            for key, child in node.items():
                if isinstance(child, str):
                    node[key] = _scrub_string(child)
                elif isinstance(child, (dict, list)):
                    pending.append(child)
        elif isinstance(node, list):
            for index, child in enumerate(node):
                if isinstance(child, str):
                    node[index] = _scrub_string(child)
                elif isinstance(child, (dict, list)):
                    pending.append(child)
    return value


# One decoder: `json.loads` with any keyword argument builds a new one per call.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def decode_json(body: bytes) -> Any:
    """Strict UTF-8 JSON without NaN/Infinity; lone surrogates made harmless."""
    try:
        value = _DECODER.decode(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise NotifyError(MSG_BAD_JSON) from None
    if _SURROGATE_ESCAPE.search(body):
        value = _scrub_surrogates(value)
    return value


def _parse_device(raw: Any) -> Device:
    if not isinstance(raw, dict) or not isinstance(raw.get("app_id"), str):
        raise NotifyError(MSG_APP_ID)
    if not isinstance(raw.get("pushkey"), str):
        raise NotifyError(MSG_PUSHKEY)
    pushkey_ts = raw.get("pushkey_ts", 0)
    if not _is_int(pushkey_ts):
        raise NotifyError("pushkey_ts is of invalid type")
    data = raw.get("data")
    if "data" in raw and not isinstance(data, dict):
        raise NotifyError("data is of invalid type")
    tweaks = raw.get("tweaks", {})
    if not isinstance(tweaks, dict):
        raise NotifyError("tweaks is of invalid type")
    sound = tweaks.get("sound")
    if "sound" in tweaks and not isinstance(sound, str):
        raise NotifyError("sound is of invalid type")
    return Device(raw["app_id"], raw["pushkey"], pushkey_ts, data, sound)


def parse_notification(body: Any, *, defer_encrypted: bool = False) -> Notification:
    """Validate a decoded request body, in the order of matrix.md §1.1.

    With `defer_encrypted`, malformed MSC3013 fields (`ciphertext`/`ephemeral`/`mac`,
    `is_counts_only`) do not raise when there are devices: the notification comes back
    without them and with `invalid_encrypted` set, for the caller to answer
    `MSG_ENCRYPTED` only if one of the devices belongs to an app that reads them (an app
    with `msc3013_mode: off` ignores them, as Sygnal does). Without devices the order of
    §1.1 holds: `MSG_ENCRYPTED` before `MSG_NO_DEVICES`.
    """
    notif = body.get("notification") if isinstance(body, dict) else None
    if not isinstance(notif, dict):
        raise NotifyError(MSG_BAD_NOTIFICATION)
    devices_raw = notif.get("devices")
    if not isinstance(devices_raw, list):
        raise NotifyError(MSG_DEVICES)
    counts = Counts()
    has_counts = "counts" in notif
    if has_counts:
        raw_counts = notif["counts"]
        if not isinstance(raw_counts, dict):
            raise NotifyError("counts is of invalid type")
        values: dict[str, int | None] = {}
        for key in ("unread", "missed_calls"):
            if key in raw_counts:
                value = raw_counts[key]
                if not _is_int(value) or abs(value) > _MATRIX_INT_MAX:
                    raise NotifyError(f"{key} is of invalid type")
                values[key] = raw_counts[key]
        counts = Counts(values.get("unread"), values.get("missed_calls"))
    devices = tuple(_parse_device(d) for d in devices_raw)

    present = [k for k in _CRYPTO_FIELDS if k in notif]
    crypto: dict[str, str | None] = dict.fromkeys(_CRYPTO_FIELDS)
    invalid_encrypted = False
    if present:
        if len(present) != len(_CRYPTO_FIELDS) or not all(
            isinstance(notif[k], str) for k in _CRYPTO_FIELDS
        ):
            invalid_encrypted = True
        else:
            crypto = {k: notif[k] for k in _CRYPTO_FIELDS}
    is_counts_only = notif.get("is_counts_only")
    if "is_counts_only" in notif and not isinstance(is_counts_only, bool):
        invalid_encrypted = True
    if invalid_encrypted:
        if not (defer_encrypted and devices):
            raise NotifyError(MSG_ENCRYPTED)
        crypto = dict.fromkeys(_CRYPTO_FIELDS)
        is_counts_only = None

    if not devices:
        raise NotifyError(MSG_NO_DEVICES)

    strings = {k: (v if isinstance(v := notif.get(k), str) else None) for k in _STRING_FIELDS}
    content = notif.get("content")
    return Notification(
        raw=notif,
        devices=devices,
        user_is_target=notif.get("user_is_target") is True,
        content=content if isinstance(content, dict) else None,
        counts=counts,
        has_counts=has_counts,
        ciphertext=crypto["ciphertext"],
        ephemeral=crypto["ephemeral"],
        mac=crypto["mac"],
        is_counts_only=is_counts_only,
        invalid_encrypted=invalid_encrypted,
        **strings,
    )


def parse_notify(body: bytes, *, defer_encrypted: bool = False) -> Notification:
    """Decode and validate a notify request body; raise `NotifyError` with Sygnal's message."""
    return parse_notification(decode_json(body), defer_encrypted=defer_encrypted)

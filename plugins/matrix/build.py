"""What to send for one device: Sygnal payloads or MSC3013 frames (matrix.md §3, §4, §6).

Pure (apart from the random ephemeral key of gateway-encrypt mode). `plan()` returns a
`Planned` push, None for "nothing to send, accepted", or raises `PayloadRejected`.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from gateway.api import ApnsAppConfig
from plugins.matrix import msc3013
from plugins.matrix.config import MatrixAppConfig
from plugins.matrix.payloads import (
    APNS_LIMIT,
    FCM_DATA_LIMIT,
    PayloadRejected,
    add_sound,
    apns_payload,
    apns_priority,
    default_payload_of,
    encode,
    fcm_counts,
    fcm_data,
    fcm_message,
    fit_apns,
    fit_fcm_data,
    stringify,
    truncate_bytes,
)
from plugins.matrix.validation import Device, Notification

__all__ = ["Planned", "apns_token", "plan"]

_NOT_B64 = re.compile(r"[^A-Za-z0-9+/]")
_HEX_TOKEN = re.compile(r"[0-9A-Fa-f]+")
_CRYPTO = ("ciphertext", "ephemeral", "mac")
# The Matrix client-server API caps a pusher's pushkey at 512 bytes (`/pushers/set`).
# A longer one is no real APNs token; sent anyway it becomes an oversized `:path`
# header that the HTTP/2 peer answers by closing the shared connection (every retry
# again), so the homeserver would get 502s for a day instead of a rejection.
_MAX_PUSHKEY_BYTES = 512
_plain_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


@dataclass(frozen=True, slots=True)
class Planned:
    payload: dict[str, Any]
    priority: int  # APNs priority (10/5); FCM uses `low` from it
    push_type: str | None
    encrypted: bool = False  # gateway-encrypted
    oversize: bool = False  # ciphertext omitted


def apns_token(pushkey: str, convert: bool) -> str:
    """The device token for `/3/device/<token>`: base64 pushkey → lowercase hex.

    Like Sygnal's non-validating `b64decode`, characters outside the alphabet are
    skipped; missing padding is tolerated. Raises PayloadRejected when nothing decodes.
    Without `convert` the pushkey is used verbatim and must already be a (non-empty)
    hex device token: anything else can never be delivered (APNs answers
    `BadDeviceToken`, or the core refuses a path-unsafe token, which would be a 502),
    so it is rejected without sending. So is a pushkey over the Matrix limit of 512
    bytes.
    """
    if len(pushkey.encode("utf-8")) > _MAX_PUSHKEY_BYTES:
        raise PayloadRejected("pushkey longer than 512 bytes")
    if not convert:
        if not _HEX_TOKEN.fullmatch(pushkey):
            raise PayloadRejected("pushkey is not a hex device token")
        return pushkey
    cleaned = _NOT_B64.sub("", pushkey.split("=", 1)[0])
    if len(cleaned) % 4 == 1:
        raise PayloadRejected("pushkey is not base64")
    try:
        raw = base64.b64decode(cleaned + "=" * (-len(cleaned) % 4))
    except (binascii.Error, ValueError):
        raise PayloadRejected("pushkey is not base64") from None
    if not raw:
        raise PayloadRejected("empty pushkey")
    return raw.hex()


# --- MSC3013 frames ------------------------------------------------------------------


def _bound_push_type(app: MatrixAppConfig) -> str | None:
    """The push type every push of `app` must carry (a VoIP app's PushKit tokens take
    `voip` only: APNs answers `InvalidPushType` to any other), None when the frame may
    choose (`alert`, `background`)."""
    core = app.core
    return core.bound_push_type if isinstance(core, ApnsAppConfig) else None


@dataclass(frozen=True, slots=True)
class _Frame:
    """The encrypted fields to forward and what kind of frame it is."""

    fields: dict[str, str]  # ciphertext, ephemeral, mac
    algorithm: str | None
    kind: str  # "event" | "boolean" | "counts"


def _frame_kind(is_counts_only: bool | None, has_counts: bool) -> str:
    if is_counts_only is True:
        return "boolean"
    if has_counts:
        return "counts"
    return "event"


def _apns_frame(
    frame: _Frame,
    n: Notification,
    device: Device,
    app: MatrixAppConfig,
    default_payload: dict[str, Any] | None,
) -> Planned | None:
    top: dict[str, Any] = dict(frame.fields)
    if frame.algorithm is not None:
        top["algorithm"] = frame.algorithm
    if frame.kind == "event":
        payload = copy.deepcopy(default_payload or {})
        aps = payload.get("aps")
        if not isinstance(aps, dict):
            aps = payload["aps"] = {}
        aps["mutable-content"] = 1
        if "alert" not in aps:
            aps["alert"] = copy.deepcopy(app.msc3013_fallback_alert)
        payload.update(top)
        if app.honour_sound and add_sound(payload, device) and len(encode(payload)) > APNS_LIMIT:
            # The sound (a divergence, Sygnal ignores it) gives way first: it must not
            # cost the encrypted notification its ciphertext, or the pushkey (§6.1).
            del payload["aps"]["sound"]
        priority, push_type = 10, _bound_push_type(app) or app.push_type or "alert"
    elif frame.kind == "boolean":
        payload = {"aps": {"content-available": 1}, **top}
        # `background`, except on an app whose tokens take one push type only (a VoIP
        # app's PushKit tokens): Apple refuses a background push to those.
        priority, push_type = 5, _bound_push_type(app) or "background"
    else:
        badge = None
        if app.send_badge_counts:
            if n.counts.unread is not None:
                badge = n.counts.unread
            if n.counts.missed_calls is not None:
                badge = (badge or 0) + n.counts.missed_calls
        if badge is None:
            return None
        payload = {"aps": {"badge": badge}, **top}
        priority, push_type = 5, _bound_push_type(app) or app.push_type or "alert"
    oversize = False
    if len(encode(payload)) > APNS_LIMIT:
        oversize = True
        for key in _CRYPTO:
            payload.pop(key, None)
        payload["ciphertext_omitted"] = True
        payload = fit_apns(payload)
    return Planned(payload, priority, push_type, oversize=oversize)


def _fcm_frame(
    frame: _Frame,
    n: Notification,
    app: MatrixAppConfig,
    default_payload: dict[str, Any] | None,
) -> Planned | None:
    data: dict[str, Any] = {}
    if frame.kind == "event":
        data = {k: stringify(v) for k, v in (default_payload or {}).items()}
    data.update(frame.fields)
    if frame.algorithm is not None:
        data["algorithm"] = frame.algorithm
    low = frame.kind != "event"
    if frame.kind == "boolean":
        data["is_counts_only"] = "true"
    elif frame.kind == "counts":
        data.update(fcm_counts(n, app.send_badge_counts))
    oversize = False
    if len(encode(data)) > FCM_DATA_LIMIT:
        oversize = True
        for key in _CRYPTO:
            data.pop(key, None)
        data["ciphertext_omitted"] = "true"
        data = fit_fcm_data(data)
    message = fcm_message(data, fcm_options=app.fcm_options, low_priority=low)
    return Planned(message, 5 if low else 10, None, oversize=oversize)


def _frame_payload(
    frame: _Frame,
    n: Notification,
    device: Device,
    app: MatrixAppConfig,
    default_payload: dict[str, Any] | None,
) -> Planned | None:
    if app.is_apns:
        return _apns_frame(frame, n, device, app, default_payload)
    return _fcm_frame(frame, n, app, default_payload)


# --- gateway-encrypt -----------------------------------------------------------------

_PLACEHOLDER = {"ephemeral": "A" * 43, "mac": "A" * 11}


def _ciphertext_b64_len(plaintext_len: int) -> int:
    padded = (plaintext_len // 16 + 1) * 16
    return math.ceil(padded * 4 / 3)


def _shrink_steps(plain: dict[str, Any]) -> list[dict[str, Any]]:
    """Successively smaller plaintexts (§6.2): content strings cut, content dropped,
    then room_name, room_alias, sender_display_name."""
    steps = [plain]
    current = dict(plain)
    content = current.get("content")
    if isinstance(content, dict):
        current["content"] = {
            k: truncate_bytes(v) if isinstance(v, str) else v for k, v in content.items()
        }
        steps.append(dict(current))
        del current["content"]
        steps.append(dict(current))
    for key in ("room_name", "room_alias", "sender_display_name"):
        if key in current:
            del current[key]
            steps.append(dict(current))
    return steps


def _gateway_encrypt(
    n: Notification,
    device: Device,
    app: MatrixAppConfig,
    default_payload: dict[str, Any] | None,
) -> Planned | None:
    data = device.data or {}
    try:
        recipient = msc3013.decode_public_key(data.get("public_key"))
    except msc3013.Msc3013Error:
        raise PayloadRejected("MSC3013 device without a usable public_key") from None
    counts_only_type = data.get("counts_only_type", "none")
    plain: dict[str, Any] = {k: v for k, v in n.raw.items() if k != "devices"}
    kind = "event"
    if not n.event_id:
        if counts_only_type == "boolean":
            kind = "boolean"
        elif counts_only_type == "full" and n.has_counts:
            kind = "counts"
    algorithm = data.get("algorithm")
    algorithm = algorithm if isinstance(algorithm, str) else None

    chosen = plain
    for candidate in _shrink_steps(plain):
        chosen = candidate
        size = len(_plain_encoder.encode(candidate).encode("utf-8"))
        fields = {**_PLACEHOLDER, "ciphertext": "A" * _ciphertext_b64_len(size)}
        trial = _frame_payload(_Frame(fields, algorithm, kind), n, device, app, default_payload)
        if trial is None or not trial.oversize:
            break
    plaintext = _plain_encoder.encode(chosen).encode("utf-8")
    try:
        sealed = msc3013.encrypt(plaintext, recipient, mac_mode=app.msc3013_mac)
    except msc3013.Msc3013Error:  # low-order key: decode_public_key already refuses it
        raise PayloadRejected("MSC3013 device without a usable public_key") from None
    fields = {"ciphertext": sealed.ciphertext, "ephemeral": sealed.ephemeral, "mac": sealed.mac}
    planned = _frame_payload(_Frame(fields, algorithm, kind), n, device, app, default_payload)
    if planned is None:
        return None
    return Planned(planned.payload, planned.priority, planned.push_type, True, planned.oversize)


# --- entry point ---------------------------------------------------------------------


def _fit_with_sound(
    payload: dict[str, Any], device: Device, app: MatrixAppConfig
) -> dict[str, Any]:
    """`fit_apns` of the payload with `tweaks.sound` added (§3), or without the sound
    when only the sound makes it unfittable.

    Honouring the sound is a divergence (Sygnal ignores it): a sound so long that the
    payload cannot fit must not turn a notification Sygnal delivers into a rejected
    pushkey, which makes Synapse delete the pusher.
    """
    if app.honour_sound:
        aps = payload.get("aps")
        with_sound = {**payload, "aps": dict(aps)} if isinstance(aps, dict) else payload
        if add_sound(with_sound, device):
            try:
                return fit_apns(with_sound)
            except PayloadRejected:
                pass  # fitted below without the sound, or rejected as Sygnal would fail
    return fit_apns(payload)


def wants_encryption(device: Device) -> bool:
    algorithm = (device.data or {}).get("algorithm")
    return isinstance(algorithm, str) and algorithm in msc3013.ALGORITHMS


def plan(n: Notification, device: Device, app: MatrixAppConfig) -> Planned | None:
    """The push for `device` through `app`; None: nothing to send (accepted)."""
    default_payload = default_payload_of(device)  # raises for a non-object default_payload
    mode = app.msc3013_mode
    if mode != "off" and n.encrypted:
        assert n.ciphertext is not None and n.ephemeral is not None and n.mac is not None
        algorithm = (device.data or {}).get("algorithm")
        frame = _Frame(
            {"ciphertext": n.ciphertext, "ephemeral": n.ephemeral, "mac": n.mac},
            algorithm if isinstance(algorithm, str) else None,
            _frame_kind(n.is_counts_only, n.has_counts),
        )
        return _frame_payload(frame, n, device, app, default_payload)
    if mode == "auto" and wants_encryption(device):
        return _gateway_encrypt(n, device, app, default_payload)
    if app.is_apns:
        # The sound is added by _fit_with_sound, which can fall back to none.
        payload = apns_payload(
            n, device, send_badge_counts=app.send_badge_counts, honour_sound=False
        )
        if payload is None:
            return None
        return Planned(_fit_with_sound(payload, device, app), apns_priority(n), app.push_type)
    data = fcm_data(n, device, send_badge_counts=app.send_badge_counts)
    if data is None:
        return None
    message = fcm_message(
        fit_fcm_data(data), fcm_options=app.fcm_options, low_priority=n.prio == "low"
    )
    return Planned(message, apns_priority(n), None)

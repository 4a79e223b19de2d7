"""Provider payloads (specs/zulip.md §6, §8): pure builders, no I/O.

APNs payloads are the JSON body for `/3/device/<token>`; FCM payloads are the HTTP v1
`message` object without `token`, as the core expects.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = [
    "MAX_REMOVE_IDS",
    "apns_test_body",
    "e2ee_apns_body",
    "e2ee_fcm_message",
    "fcm_data",
    "fcm_test_message",
    "legacy_apns_body",
    "legacy_fcm_message",
    "truncate_remove",
]

MAX_REMOVE_IDS = 200
LEGACY_APNS_EXPIRATION = 86400


def e2ee_apns_body(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The request's payload verbatim (numeric `push_key_id`, server-built `aps`)."""
    return dict(payload)


def e2ee_fcm_message(push_key_id: int, encrypted_data: str, priority: str) -> dict[str, Any]:
    return {
        "data": {"push_key_id": str(push_key_id), "encrypted_data": encrypted_data},
        "android": {"priority": priority},
    }


def _fcm_value(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return str(value)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def fcm_data(payload: Mapping[str, Any]) -> dict[str, str]:
    """FCM `data` must be string → string: render every value as Zulip's bouncer does."""
    return {str(k): _fcm_value(v) for k, v in payload.items()}


def _parse_ids(value: Any) -> list[int] | None:
    if isinstance(value, str):
        parts = [p.strip() for p in value.split(",") if p.strip()]
    elif isinstance(value, list):
        parts = value
    else:
        return None
    ids: list[int] = []
    for part in parts:
        try:
            ids.append(int(part))
        except (TypeError, ValueError):
            return None
    return ids


def truncate_remove(payload: Mapping[str, Any]) -> dict[str, Any]:
    """For `remove` events keep the 200 largest message ids, ascending, comma-joined."""
    out = dict(payload)
    if out.get("event") == "remove" and out.get("zulip_message_ids"):
        ids = _parse_ids(out["zulip_message_ids"])
        if ids is not None:
            kept = sorted(ids)[-MAX_REMOVE_IDS:]
            out["zulip_message_ids"] = ",".join(str(i) for i in kept)
    return out


def legacy_apns_body(apns_payload: Mapping[str, Any]) -> dict[str, Any]:
    """`{**custom, "aps": apns_payload minus custom}` with remove ids truncated."""
    aps = {k: v for k, v in apns_payload.items() if k != "custom"}
    custom = apns_payload.get("custom")
    body: dict[str, Any] = dict(custom) if isinstance(custom, Mapping) else {}
    if isinstance(body.get("zulip"), Mapping):
        body["zulip"] = truncate_remove(body["zulip"])
    body["aps"] = aps
    return body


def legacy_fcm_message(gcm_payload: Mapping[str, Any], priority: str) -> dict[str, Any]:
    return {"data": fcm_data(truncate_remove(gcm_payload)), "android": {"priority": priority}}


def apns_test_body(base_payload: Mapping[str, Any]) -> dict[str, Any]:
    payload = {**base_payload, "event": "test"}
    realm_name = payload.get("realm_name", "")
    realm_url = payload.get("realm_url", payload.get("realm_uri", ""))
    return {
        "zulip": payload,
        "aps": {
            "alert": {
                "title": "Test notification",
                "body": f"This is a test notification from {realm_name} ({realm_url}).",
            },
            "sound": "default",
        },
    }


def fcm_test_message(base_payload: Mapping[str, Any], now: int) -> dict[str, Any]:
    payload = {**base_payload, "event": "test", "time": now}
    return {"data": fcm_data(payload), "android": {"priority": "high"}}

"""Review: Synapse as the peer that posts to pushgw's `/_matrix/push/v1/notify`.

The bodies below are built the way Synapse's HTTP pusher builds them
(`element-hq/synapse:synapse/push/httppusher.py`: `dispatch_push_event` for the
event frames, `_send_badge` for badge updates), encoded as Synapse encodes them
(canonical JSON: sorted keys, compact, UTF-8). What Synapse then does with pushgw's
answer is modelled by `synapse_verdict` after the same file (`_process_one`,
`dispatch_push`) and `synapse/http/client.py` (`post_json_get_json`): any non-2xx
status, or a 2xx body that is not JSON, fails the attempt (the pusher backs off and
retries, for up to a day); a 2xx JSON object's `rejected` list deletes the pusher
when it holds the pusher's own pushkey, compared as an exact string.
"""

from __future__ import annotations

import base64
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import olm
import pytest

from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.fcm_sim import FcmResponse, FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config
from plugins.matrix.config import MatrixConfig
from tests.matrix.conftest import NOTIFY, apns_pushkey, fcm_pushkey

IOS = "com.example.ios"
ANDROID = "com.example.android"
EVENT_ID = "$ev3957tyerfgewrf384:example.org"
ROOM_ID = "!slw48wfj34rtnrf:example.org"
PUSHKEY_TS = 1_700_000_000  # Synapse sends int(pusher.ts / 1000)
ELEMENT_IOS_DATA = {
    # What Element iOS registers (minus `url`, which Synapse strips).
    "format": "event_id_only",
    "default_payload": {
        "aps": {
            "mutable-content": 1,
            "alert": {"loc-key": "Notification", "loc-args": []},
        }
    },
}


# --- Synapse's side --------------------------------------------------------------------


def canonical(body: Any) -> bytes:
    """Synapse posts `encode_canonical_json(...)`: sorted keys, no spaces, raw UTF-8."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def synapse_device(
    app_id: str, pushkey: str, data: dict[str, Any] | None = None, tweaks: Any = None
) -> dict[str, Any]:
    """`dispatch_push`'s device: `tweaks` only when non-empty, `data` = pusher data - url."""
    device: dict[str, Any] = {
        "app_id": app_id,
        "pushkey": pushkey,
        "pushkey_ts": PUSHKEY_TS,
        "data": dict(data or {}),
    }
    if tweaks:
        device["tweaks"] = tweaks
    return device


def event_id_only_frame(device: dict[str, Any], *, prio: str = "high", unread: int = 3) -> Any:
    """`dispatch_push_event` with `data.format == "event_id_only"` (tweaks dropped)."""
    return {
        "notification": {
            "event_id": EVENT_ID,
            "room_id": ROOM_ID,
            "prio": prio,
            "counts": {"unread": unread},
            "devices": [device],
        }
    }


def full_frame(device: dict[str, Any], *, badge: int | None = 2, **fields: Any) -> Any:
    """`dispatch_push_event` in the default format; `badge=None` is MSC4076's
    `disable_badge_count` (no `counts` at all)."""
    notification: dict[str, Any] = {
        "id": EVENT_ID,  # "deprecated: remove soon", still sent
        "event_id": EVENT_ID,
        "room_id": ROOM_ID,
        "type": "m.room.message",
        "sender": "@alice:example.org",
        "prio": "high",
        "content": {"msgtype": "m.text", "body": "Hello"},
        "sender_display_name": "Alice",
        "room_name": "Ops",
    }
    if badge is not None:
        notification["counts"] = {"unread": badge}
    notification.update(fields)
    notification["devices"] = [device]
    return {"notification": notification}


def badge_frame(device: dict[str, Any], unread: int) -> Any:
    """`_send_badge`: sent on read receipts, fire and forget."""
    return {
        "notification": {
            "id": "",
            "type": None,
            "sender": "",
            "counts": {"unread": unread},
            "devices": [device],
        }
    }


@dataclass(frozen=True)
class Verdict:
    ok: bool  # the attempt succeeded; False: back off and retry the same event
    pusher_deleted: bool = False


def synapse_verdict(status: int, body: bytes, own_pushkey: str) -> Verdict:
    """What Synapse's `HttpPusher` does with one answer to its notify request."""
    if not 200 <= status < 300:
        return Verdict(ok=False)  # HttpResponseException -> `return False` -> backoff
    try:
        response = json.loads(body.decode("utf-8"))
    except ValueError:
        return Verdict(ok=False)  # post_json_get_json raised: also a failed attempt
    rejected = response.get("rejected", [])
    return Verdict(ok=True, pusher_deleted=any(pk == own_pushkey for pk in rejected))


async def post_as_synapse(gw: GatewayHarness, body: Any) -> tuple[int, bytes, Verdict]:
    pushkey = body["notification"]["devices"][0]["pushkey"]
    response = await gw.client.post(
        NOTIFY,
        data=canonical(body),
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    raw = await response.read()
    return response.status, raw, synapse_verdict(response.status, raw, pushkey)


# --- event frames ----------------------------------------------------------------------


async def test_event_id_only_frame_element_ios(gw: GatewayHarness, apns: ApnsSimulator) -> None:
    """element-hq/synapse:synapse/push/httppusher.py (`dispatch_push_event`, format
    `event_id_only`: only event_id, room_id, prio and counts.unread; tweaks emptied, so
    no `tweaks` key; `dispatch_push` forwards the pusher's data minus `url`)."""
    pushkey, hexkey = apns_pushkey()
    status, _, verdict = await post_as_synapse(
        gw, event_id_only_frame(synapse_device(IOS, pushkey, ELEMENT_IOS_DATA))
    )
    assert status == 200 and verdict == Verdict(ok=True)
    [request] = apns.requests
    assert request.token == hexkey
    assert request.json == {
        "aps": {"mutable-content": 1, "alert": {"loc-key": "Notification", "loc-args": []}},
        "room_id": ROOM_ID,
        "event_id": EVENT_ID,
        "unread_count": 3,
    }
    assert request.headers["apns-priority"] == "10"


async def test_event_id_only_frame_android_low_priority(
    gw: GatewayHarness, fcm: FcmSimulator
) -> None:
    """element-hq/synapse:synapse/push/httppusher.py (`dispatch_push_event`: `prio` is
    "low" unless the event is encrypted or has a highlight/sound tweak)."""
    token = fcm_pushkey()
    body = event_id_only_frame(
        synapse_device(ANDROID, token, {"format": "event_id_only"}), prio="low", unread=1
    )
    status, _, verdict = await post_as_synapse(gw, body)
    assert status == 200 and verdict == Verdict(ok=True)
    [request] = fcm.requests
    assert request.token == token
    assert request.message["data"] == {
        "event_id": EVENT_ID,
        "room_id": ROOM_ID,
        "prio": "normal",
        "unread": "1",
    }
    assert request.message["android"] == {"priority": "normal"}


async def test_full_frame_with_push_rule_tweaks(
    gw: GatewayHarness, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    """element-hq/synapse:synapse/push/httppusher.py (`tweaks_for_actions`: the default
    rules give `{"sound": "default", "highlight": true}`; the full frame carries the
    deprecated `id` too, and `sender_display_name`/`room_name` from push_tools.py)."""
    tweaks = {"sound": "default", "highlight": True}
    pushkey, _ = apns_pushkey()
    status, _, verdict = await post_as_synapse(
        gw, full_frame(synapse_device(IOS, pushkey, tweaks=tweaks))
    )
    assert status == 200 and verdict == Verdict(ok=True)
    assert apns.requests[0].json == {
        "aps": {
            "alert": {
                "loc-key": "MSG_FROM_USER_IN_ROOM_WITH_CONTENT",
                "loc-args": ["Alice", "Ops", "Hello"],
            },
            "badge": 2,
            "sound": "default",
        },
        "room_id": ROOM_ID,
        "event_id": EVENT_ID,
    }
    token = fcm_pushkey()
    status, _, verdict = await post_as_synapse(
        gw, full_frame(synapse_device(ANDROID, token, tweaks=tweaks))
    )
    assert status == 200 and verdict == Verdict(ok=True)
    assert fcm.requests[0].message["data"] == {
        "event_id": EVENT_ID,
        "type": "m.room.message",
        "sender": "@alice:example.org",
        "room_name": "Ops",
        "sender_display_name": "Alice",
        "room_id": ROOM_ID,
        "content_msgtype": "m.text",
        "content_body": "Hello",
        "prio": "high",
        "unread": "2",
    }


async def test_invite_frame(gw: GatewayHarness, apns: ApnsSimulator) -> None:
    """element-hq/synapse:synapse/push/httppusher.py (member state events add
    `membership` and `user_is_target`; Synapse no longer sends `room_alias`)."""
    pushkey, _ = apns_pushkey()
    body = full_frame(
        synapse_device(IOS, pushkey),
        type="m.room.member",
        content={"membership": "invite", "displayname": "Bob", "is_direct": True},
        membership="invite",
        user_is_target=True,
    )
    status, _, verdict = await post_as_synapse(gw, body)
    assert status == 200 and verdict.ok
    assert apns.requests[0].json["aps"]["alert"] == {  # type: ignore[index]
        "loc-key": "USER_INVITE_TO_NAMED_ROOM",
        "loc-args": ["Alice", "Ops"],
    }


async def test_msc4076_frames_without_counts(
    gw: GatewayHarness, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    """element-hq/synapse:synapse/push/httppusher.py (`disable_badge_count`, MSC4076:
    no `counts` key at all). A message still alerts, without a badge; a member event
    that is not an invite has nothing to show: nothing sent, and a 200 (not a
    failure Synapse would retry for a day)."""
    data = {"org.matrix.msc4076.disable_badge_count": True}
    pushkey, _ = apns_pushkey()
    status, _, verdict = await post_as_synapse(
        gw, full_frame(synapse_device(IOS, pushkey, data), badge=None)
    )
    assert status == 200 and verdict == Verdict(ok=True)
    assert "badge" not in apns.requests[0].json["aps"]  # type: ignore[index]
    leave = full_frame(
        synapse_device(IOS, pushkey, data),
        badge=None,
        type="m.room.member",
        content={"membership": "leave"},
        membership="leave",
        user_is_target=False,
    )
    status, _, verdict = await post_as_synapse(gw, leave)
    assert status == 200 and verdict == Verdict(ok=True)
    assert len(apns.requests) == 1


# --- badge updates ---------------------------------------------------------------------


async def test_badge_frames(gw: GatewayHarness, apns: ApnsSimulator, fcm: FcmSimulator) -> None:
    """element-hq/synapse:synapse/push/httppusher.py (`_send_badge`, after read receipts:
    `{"id": "", "type": null, "sender": "", "counts": {"unread": N}}`, no event_id; the
    pusher data keeps `format` and `default_payload`). A badge of 0 (all read) must
    reach APNs, or the icon keeps its last count; FCM with nothing to say sends nothing."""
    pushkey, _ = apns_pushkey()
    device = synapse_device(IOS, pushkey, ELEMENT_IOS_DATA)
    for unread in (4, 0):
        status, _, verdict = await post_as_synapse(gw, badge_frame(device, unread))
        assert status == 200 and verdict == Verdict(ok=True)
    assert [r.json for r in apns.requests] == [{"aps": {"badge": 4}}, {"aps": {"badge": 0}}]
    token = fcm_pushkey()
    status, _, verdict = await post_as_synapse(
        gw, badge_frame(synapse_device(ANDROID, token, {"format": "event_id_only"}), 0)
    )
    assert status == 200 and verdict == Verdict(ok=True)
    assert fcm.requests == []


# --- answers Synapse acts on -----------------------------------------------------------


async def test_dead_tokens_delete_exactly_that_pusher(
    gw: GatewayHarness, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    """element-hq/synapse:synapse/push/httppusher.py (`_process_one`: a rejected pushkey
    is removed only when it equals the pusher's own pushkey, as a string). pushgw
    converts APNs pushkeys to hex; the answer must carry the base64 pushkey as sent."""
    raw = bytes(range(0xF0, 0x100)) + bytes(16)  # base64 with '+', '/' and '='
    pushkey = base64.b64encode(raw[:31]).decode()
    assert set("+/=") <= set(pushkey)
    apns.script(raw[:31].hex(), ApnsResponse.error("Unregistered"))
    status, body, verdict = await post_as_synapse(
        gw, event_id_only_frame(synapse_device(IOS, pushkey, ELEMENT_IOS_DATA))
    )
    assert status == 200 and json.loads(body) == {"rejected": [pushkey]}
    assert verdict == Verdict(ok=True, pusher_deleted=True)

    token = fcm_pushkey()
    fcm.script(token, FcmResponse.unregistered())
    status, _, verdict = await post_as_synapse(gw, full_frame(synapse_device(ANDROID, token)))
    assert status == 200 and verdict == Verdict(ok=True, pusher_deleted=True)

    # Sygnal parity: an app_id no app matches is rejected (the pusher goes).
    status, _, verdict = await post_as_synapse(
        gw, full_frame(synapse_device("org.unknown.app", token))
    )
    assert status == 200 and verdict == Verdict(ok=True, pusher_deleted=True)


async def test_failures_keep_the_pusher_and_are_retried(
    gw: GatewayHarness, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    """element-hq/synapse:synapse/push/httppusher.py (`dispatch_push` returns False on
    any exception of `post_json_get_json`, i.e. any non-2xx: the pusher backs off
    1 s doubling to 1 h and retries the same event, giving up after a day) and
    matrix-org/matrix-spec:content/push-gateway-api.md ("If the endpoint returns an
    HTTP error code, the homeserver SHOULD retry"). A permanent provider error, an
    exhausted retry budget or a wrong Firebase URL must not look like a dead token."""
    forbidden, forbidden_hex = apns_pushkey()
    apns.script(forbidden_hex, ApnsResponse.error("Forbidden"))
    down, down_hex = apns_pushkey()
    apns.script(down_hex, ApnsResponse(503, "ServiceUnavailable"))
    for pushkey in (forbidden, down):
        status, body, verdict = await post_as_synapse(gw, full_frame(synapse_device(IOS, pushkey)))
        assert (status, body) == (502, b"")
        assert verdict == Verdict(ok=False)

    denied = fcm_pushkey()
    fcm.script(denied, FcmResponse.permission_denied())
    wrong_project = fcm_pushkey()
    fcm.script(
        wrong_project,
        FcmResponse(404, "NOT_FOUND", "Requested entity was not found."),
    )
    for token in (denied, wrong_project):
        status, _, verdict = await post_as_synapse(gw, full_frame(synapse_device(ANDROID, token)))
        assert status == 502 and verdict == Verdict(ok=False)


async def test_success_body_is_what_synapse_parses(gw: GatewayHarness) -> None:
    """element-hq/synapse:synapse/http/client.py (`post_json_get_json` decodes the 2xx body
    as UTF-8 JSON, else raises, which fails the push) and
    matrix-org/matrix-spec:data/api/push-gateway/push_notifier.yaml (200: an object with
    a required `rejected` array of strings)."""
    pushkey, _ = apns_pushkey()
    response = await gw.client.post(
        NOTIFY, data=canonical(full_frame(synapse_device(IOS, pushkey)))
    )
    assert response.status == 200
    assert response.content_type == "application/json"
    assert json.loads((await response.read()).decode("utf-8")) == {"rejected": []}


# --- disagreements the pushgw spec fixes (reported, not changed) -----------------------


async def test_non_string_sound_tweak_blocks_the_pusher(
    gw: GatewayHarness, apns: ApnsSimulator
) -> None:
    """element-hq/synapse:synapse/push/httppusher.py (`tweaks_for_actions`: a `set_tweak`
    action without `value` gives `True`) with synapse/handlers/push_rules.py
    (`check_actions` accepts any `{"set_tweak": ...}` object): a user's push rule
    `{"set_tweak": "sound"}` makes Synapse send `tweaks: {"sound": true}`.

    matrix.md §1.1 fixes 400 `sound is of invalid type` (Sygnal parity). Synapse takes the
    400 as a failed attempt: that event is retried for a day and, as the pusher sends in
    order, every later event of the pusher waits behind it. Asserted as specified;
    reported as a disagreement."""
    pushkey, _ = apns_pushkey()
    status, body, verdict = await post_as_synapse(
        gw, full_frame(synapse_device(IOS, pushkey, tweaks={"sound": True, "highlight": True}))
    )
    assert (status, body) == (400, b"sound is of invalid type")
    assert verdict == Verdict(ok=False)
    assert apns.requests == []


async def test_topic_disallowed_is_not_held_by_the_invalidation_guard(
    apns: ApnsSimulator, tmp_path: Path
) -> None:
    """element-hq/synapse:synapse/push/httppusher.py (`_process_one` removes the pusher of
    a rejected pushkey) with element-hq/sygnal:sygnal/apnspushkin.py (`TOKEN_ERRORS`
    lists `(400, "TopicDisallowed")`).

    APNs answers TopicDisallowed for a topic the credential may not push to: a
    configuration mistake that hits every token of the app alike. matrix.md §3 and
    providers.md §2.2 fix it as `rejected` (parity) and `permanent` in the core, so the
    mass-invalidation guard never sees it: where a wrong environment (BadDeviceToken)
    is held after a few answers (502, pushers kept), TopicDisallowed keeps rejecting,
    and Synapse deletes every pusher of the app. docs/matrix.md says the guard covers
    it. Asserted as specified; reported as a disagreement."""
    apps = {IOS: apns_app_config(apns, tmp_path)}
    config = base_config(
        tmp_path,
        {"matrix": {"apps": apps, "notify_deadline": 3.0}},
        delivery={"invalidation_guard_min": 4},
    )
    async with GatewayHarness(config) as gw:
        apns.script_all(ApnsResponse.error("BadDeviceToken"))
        deleted = [
            (await post_as_synapse(gw, full_frame(synapse_device(IOS, apns_pushkey()[0]))))[2]
            for _ in range(8)
        ]
        assert deleted[0] == Verdict(ok=True, pusher_deleted=True)
        assert deleted[-1] == Verdict(ok=False)  # held: the pusher is kept
    async with GatewayHarness(config) as gw:
        apns.script_all(ApnsResponse.error("TopicDisallowed"))
        deleted = [
            (await post_as_synapse(gw, full_frame(synapse_device(IOS, apns_pushkey()[0]))))[2]
            for _ in range(8)
        ]
        assert deleted == [Verdict(ok=True, pusher_deleted=True)] * 8


async def test_gateway_encrypt_badge_update_is_an_alert(
    gw: GatewayHarness, apns: ApnsSimulator
) -> None:
    """element-hq/synapse:synapse/push/httppusher.py (`_send_badge` on every read receipt
    that changes the count; pusher data forwarded minus `url`, so a client's
    `algorithm`/`public_key` reach pushgw, without `counts_only_type` unless the
    client set it).

    matrix.md §6.2 fixes `counts_only_type` `none` (the default) as "encrypt as any
    frame", and §6.1 sends an unmarked frame as an alert with the fallback text: each
    badge update becomes a visible "New message" alert on iOS. Asserted as specified;
    reported as a disagreement."""
    decryption = olm.PkDecryption()
    data = {"algorithm": "com.famedly.curve25519-aes-sha2", "public_key": decryption.public_key}
    pushkey, _ = apns_pushkey()
    status, _, verdict = await post_as_synapse(
        gw, badge_frame(synapse_device(IOS, pushkey, data), 0)
    )
    assert status == 200 and verdict.ok
    aps = apns.requests[0].json["aps"]  # type: ignore[index]
    assert aps["alert"] == {"body": "New message"}
    assert apns.requests[0].headers["apns-push-type"] == "alert"


# --- the Push Gateway API's error answers ----------------------------------------------


async def test_unsupported_endpoints_and_methods_are_m_unrecognized(gw: GatewayHarness) -> None:
    """matrix-org/matrix-spec:content/push-gateway-api.md ("Unsupported endpoints": an
    unknown endpoint gets a 404 `M_UNRECOGNIZED` error, an unsupported method on a known
    endpoint a 405 `M_UNRECOGNIZED` error; the error body format of the Client-Server
    API). pushgw answered aiohttp's plain-text `404: Not Found` / `405: Method Not
    Allowed`."""
    unrecognized = {"errcode": "M_UNRECOGNIZED", "error": "Unrecognized request"}
    for method in ("GET", "PUT", "DELETE"):
        response = await gw.client.request(method, NOTIFY)
        assert response.status == 405
        assert response.headers["Allow"] == "POST"
        assert response.content_type == "application/json"
        assert await response.json() == unrecognized
    for path in ("/_matrix/push/v1/other", "/_matrix/push/v2/notify", NOTIFY + "/"):
        response = await gw.client.post(path, data=b"{}")
        assert response.status == 404
        assert response.content_type == "application/json"
        assert await response.json() == unrecognized
    assert (await gw.client.get("/health")).status == 200


# --- timeouts ----------------------------------------------------------------------------


def test_notify_deadline_past_synapse_timeout_warns(
    apns: ApnsSimulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """element-hq/synapse:synapse/http/client.py (`BaseHttpClient.request`: the answer's
    headers must come within 60 s, else `RequestTimedOutError`, which
    synapse/push/httppusher.py `dispatch_push` counts as a failed attempt and retries).
    A `notify_deadline` of 60 s or more lets pushgw still deliver after Synapse gave up,
    and Synapse sends the event again: start-up says so (the default, 15 s, is silent)."""
    apps = {IOS: apns_app_config(apns, tmp_path)}
    with caplog.at_level(logging.WARNING, logger="plugins.matrix"):
        MatrixConfig.model_validate({"apps": apps})
        assert not [r for r in caplog.records if "notify_deadline" in r.getMessage()]
        MatrixConfig.model_validate({"apps": apps, "notify_deadline": 90})
    [record] = [r for r in caplog.records if "notify_deadline" in r.getMessage()]
    assert record.levelno == logging.WARNING and "60" in record.getMessage()


def test_deadline_plus_request_timeout_past_synapse_timeout_warns(
    apns: ApnsSimulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A request in flight at `notify_deadline` is let finish, up to its app's
    `request_timeout`: 45 s + 20 s can answer after Synapse's 60 s, so start-up says so
    and names the app whose timeout it is."""
    apps = {IOS: apns_app_config(apns, tmp_path, request_timeout=20.0)}
    with caplog.at_level(logging.WARNING, logger="plugins.matrix"):
        MatrixConfig.model_validate({"apps": apps, "notify_deadline": 35})
        assert not [r for r in caplog.records if "notify_deadline" in r.getMessage()]
        MatrixConfig.model_validate({"apps": apps, "notify_deadline": 45})
    [record] = [r for r in caplog.records if "notify_deadline" in r.getMessage()]
    assert "request_timeout 20" in record.getMessage() and IOS in record.getMessage()

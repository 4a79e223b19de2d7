"""Black-box tests over HTTP against the simulators (matrix.md §9 checklist)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.fcm_sim import FcmResponse, FcmSimulator
from gateway.testing.harness import GatewayHarness
from tests.matrix.conftest import (
    NOTIFY,
    Post,
    apns_pushkey,
    device,
    fcm_pushkey,
    notification,
)

IOS = "com.example.ios"
ANDROID = "com.example.android"


# --- HTTP surface ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{", "Expected JSON request body"),
        (b'{"notification": {"devices": [], "a": NaN}}', "Expected JSON request body"),
        (b"[]", "Invalid notification: expecting object in 'notification' key"),
        (b'{"notification": {}}', "Expected list in 'devices' key"),
        (b'{"notification": {"devices": [], "counts": 1}}', "counts is of invalid type"),
        (
            b'{"notification": {"devices": [], "counts": {"unread": "1"}}}',
            "unread is of invalid type",
        ),
        (
            b'{"notification": {"devices": [], "counts": {"missed_calls": 1.0}}}',
            "missed_calls is of invalid type",
        ),
        (b'{"notification": {"devices": [1]}}', "Device with missing or non-string app_id"),
        (
            b'{"notification": {"devices": [{"app_id": "a"}]}}',
            "Device with missing or non-string pushkey",
        ),
        (
            b'{"notification": {"devices": [{"app_id": "a", "pushkey": "k", "pushkey_ts": "x"}]}}',
            "pushkey_ts is of invalid type",
        ),
        (
            b'{"notification": {"devices": [{"app_id": "a", "pushkey": "k", "data": null}]}}',
            "data is of invalid type",
        ),
        (
            b'{"notification": {"devices": [{"app_id": "a", "pushkey": "k", "tweaks": []}]}}',
            "tweaks is of invalid type",
        ),
        (
            b'{"notification": {"devices": [{"app_id": "a", "pushkey": "k", '
            b'"tweaks": {"sound": 1}}]}}',
            "sound is of invalid type",
        ),
        (
            # an app that reads the MSC3013 fields (msc3013_mode auto): for an unknown
            # app or an `off` app they are ignored (test_msc3013_http.py)
            b'{"notification": {"devices": [{"app_id": "com.example.ios", "pushkey": "k"}],'
            b' "mac": "x"}}',
            "Invalid encrypted notification",
        ),
        (b'{"notification": {"devices": []}}', "No devices in notification"),
    ],
)
async def test_validation_errors(post: Post, body: bytes, message: str) -> None:
    assert await post(body) == (400, message)


async def test_body_too_large(gw: GatewayHarness) -> None:
    response = await gw.client.post(NOTIFY, data=b" " * (600 * 1024))
    assert response.status == 413


async def test_chunked_bodies_are_read_and_limited(gw: GatewayHarness) -> None:
    async def chunked(body: bytes, times: int = 1) -> AsyncIterator[bytes]:
        for _ in range(times):
            yield body

    small = await gw.client.post(NOTIFY, data=chunked(b'{"notification": {"devices": []}}'))
    assert (small.status, await small.text()) == (400, "No devices in notification")
    large = await gw.client.post(NOTIFY, data=chunked(b" " * 65536, times=10))
    assert large.status == 413


async def test_health_and_methods(gw: GatewayHarness) -> None:
    response = await gw.client.get("/health")
    assert response.status == 200 and await response.read() == b""
    assert (await gw.client.head("/health")).status == 200
    assert (await gw.client.get(NOTIFY)).status == 405
    assert (await gw.client.get("/_matrix/push/v1/other")).status == 404


async def test_accepted_device(post: Post, apns: ApnsSimulator) -> None:
    key, _ = apns_pushkey()
    assert await post(notification([device(IOS, key)])) == (200, {"rejected": []})
    assert len(apns.requests) == 1


# --- routing -------------------------------------------------------------------------


async def test_unknown_and_ambiguous_app_ids(
    make_gateway: Any, apns: ApnsSimulator, tmp_path: Any
) -> None:
    from gateway.testing.harness import apns_app_config

    apps = {
        "*.example.*": apns_app_config(apns, tmp_path),
        "com.example.a*": apns_app_config(apns, tmp_path),
        "com.example.abc": apns_app_config(apns, tmp_path),
    }
    async with make_gateway(apps=apps) as gw:
        keys = [apns_pushkey(i)[0] for i in range(4)]
        body = notification(
            [
                device("org.unknown", keys[0]),
                device("com.example.ax", keys[1]),  # ambiguous
                device("net.example.x", keys[2]),  # single glob
                device("com.example.abc", keys[3]),  # exact, also matches two globs
            ]
        )
        response = await gw.client.post(NOTIFY, json=body)
        assert await response.json() == {"rejected": keys[:2]}
        assert sorted(r.token for r in apns.requests) == sorted(apns_pushkey(i)[1] for i in (2, 3))


# --- outcomes --------------------------------------------------------------------------


async def test_mixed_request_rejected_in_device_order(
    post: Post, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    gone_fcm = fcm_pushkey(1)
    fcm.script(gone_fcm, FcmResponse.unregistered())
    ok_key, _ = apns_pushkey(2)
    gone_apns, gone_hex = apns_pushkey(3)
    apns.script(gone_hex, ApnsResponse.error("Unregistered"))
    body = notification(
        [
            device(ANDROID, gone_fcm),
            device(IOS, ok_key),
            device("unknown.app", "dup"),
            device(IOS, gone_apns),
            device("unknown.app", "dup"),
        ]
    )
    assert await post(body) == (200, {"rejected": [gone_fcm, "dup", gone_apns, "dup"]})


@pytest.mark.parametrize(
    "reason",
    ["BadDeviceToken", "DeviceTokenNotForTopic", "TopicDisallowed", "Unregistered", "ExpiredToken"],
)
async def test_apns_rejections(post: Post, apns: ApnsSimulator, reason: str) -> None:
    key, hexkey = apns_pushkey(7)
    apns.script(hexkey, ApnsResponse.error(reason))
    assert await post(notification([device(IOS, key)])) == (200, {"rejected": [key]})
    assert len(apns.requests_for(hexkey)) == 1


async def test_permanent_apns_error_is_502(post: Post, apns: ApnsSimulator) -> None:
    bad, bad_hex = apns_pushkey(1)
    gone, gone_hex = apns_pushkey(2)
    apns.script(bad_hex, ApnsResponse.error("Forbidden"))
    apns.script(gone_hex, ApnsResponse.error("Unregistered"))
    assert await post(notification([device(IOS, bad), device(IOS, gone)])) == (502, "")
    assert len(apns.requests_for(bad_hex)) == 1


async def test_apns_transient_then_ok(post: Post, apns: ApnsSimulator) -> None:
    key, hexkey = apns_pushkey()
    apns.script(hexkey, ApnsResponse(500, "InternalServerError"), ApnsResponse.ok())
    assert await post(notification([device(IOS, key)])) == (200, {"rejected": []})
    assert len(apns.requests_for(hexkey)) == 2
    first, second = apns.requests_for(hexkey)
    assert first.headers["apns-id"] == second.headers["apns-id"]


async def test_apns_transient_until_deadline_is_502(post: Post, apns: ApnsSimulator) -> None:
    key, hexkey = apns_pushkey()
    apns.script(hexkey, ApnsResponse(503, "ServiceUnavailable"))
    assert await post(notification([device(IOS, key)])) == (502, "")
    assert len(apns.requests_for(hexkey)) >= 2


async def test_request_in_flight_at_the_deadline_is_let_finish(
    make_gateway: Any, apns: ApnsSimulator
) -> None:
    """The deadline (3 s here) stops retries, not a request already made: its answer is
    definite, where cutting it off would answer 502 for a push APNs may have delivered
    (and Synapse would send it again). The wait is bounded by the app's request_timeout
    (docs/matrix.md)."""
    key, hexkey = apns_pushkey()
    apns.script(hexkey, ApnsResponse(503, "ServiceUnavailable"), ApnsResponse.ok(delay=4.0))
    async with make_gateway(ios={"request_timeout": 60.0}) as gw:
        response = await gw.client.post(NOTIFY, json=notification([device(IOS, key)]))
        assert (response.status, await response.json()) == (200, {"rejected": []})
    assert [r.status for r in apns.requests_for(hexkey)] == [503, 200]


async def test_fcm_outcomes(post: Post, fcm: FcmSimulator) -> None:
    gone, invalid, mismatch = fcm_pushkey(1), fcm_pushkey(2), fcm_pushkey(3)
    fcm.script(gone, FcmResponse.unregistered())
    fcm.script(invalid, FcmResponse.invalid_token())
    fcm.script(mismatch, FcmResponse.sender_id_mismatch())
    body = notification([device(ANDROID, k) for k in (gone, invalid, mismatch)])
    assert await post(body) == (200, {"rejected": [gone, invalid, mismatch]})
    assert len(fcm.requests) == 3


async def test_fcm_bad_request_not_about_token_is_502(post: Post, fcm: FcmSimulator) -> None:
    token = fcm_pushkey()
    fcm.script(token, FcmResponse.invalid_argument(field="message.data"))
    assert await post(notification([device(ANDROID, token)])) == (502, "")


async def test_fcm_unavailable_retried_after_retry_after_then_502(
    post: Post, fcm: FcmSimulator
) -> None:
    token = fcm_pushkey()
    fcm.script(token, FcmResponse.unavailable(retry_after=1))
    assert await post(notification([device(ANDROID, token)])) == (502, "")
    sent = fcm.requests_for(token)
    assert len(sent) >= 2
    assert sent[1].at - sent[0].at >= 1.0


async def test_fcm_unavailable_then_ok(post: Post, fcm: FcmSimulator) -> None:
    token = fcm_pushkey()
    fcm.script(token, FcmResponse.unavailable(retry_after=1), FcmResponse.ok())
    assert await post(notification([device(ANDROID, token)])) == (200, {"rejected": []})
    assert len(fcm.requests_for(token)) == 2
    assert "message" not in fcm.requests_for(token)[1].message  # never re-nested


async def test_undecodable_pushkey_and_bad_default_payload(
    post: Post, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    body = notification(
        [
            device(IOS, "!!!"),
            device(IOS, apns_pushkey()[0], data={"default_payload": "x"}),
            device(ANDROID, fcm_pushkey(), data={"default_payload": [1]}),
        ]
    )
    status, answer = await post(body)
    assert status == 200 and len(answer["rejected"]) == 3
    assert not apns.requests and not fcm.requests


async def test_raw_pushkey_that_is_not_a_hex_token_is_rejected(
    make_gateway: Any, apns: ApnsSimulator
) -> None:
    # With convert_device_token_to_hex: false the pushkey is the token; one that cannot be
    # an APNs device token used to reach the core, whose local refusal made the answer 502.
    bad = ["abc/def", "ab cd", "", "xyz", "abc-def"]
    good = "ABCDEF0123456789" * 4
    async with make_gateway(ios={"convert_device_token_to_hex": False}) as gw:
        body = notification([device(IOS, key) for key in [*bad, good]])
        response = await gw.client.post(NOTIFY, json=body)
        assert (response.status, await response.json()) == (200, {"rejected": bad})
    assert [request.token for request in apns.requests] == [good]


async def test_deeply_nested_default_payload_is_rejected(
    post: Post, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    # 600 levels used to raise RecursionError in copy.deepcopy on the APNs path (a 500).
    deep = '{"a": ' * 600 + "1" + "}" * 600
    keys = [apns_pushkey()[0], fcm_pushkey()]
    data = {"default_payload": "DEEP"}
    body = notification([device(IOS, keys[0], data=data), device(ANDROID, keys[1], data=data)])
    raw = json.dumps(body).replace('"DEEP"', deep).encode()
    assert await post(raw) == (200, {"rejected": keys})
    assert not apns.requests and not fcm.requests


async def test_lone_surrogate_in_a_deeply_nested_body(post: Post, fcm: FcmSimulator) -> None:
    # 500 levels parse fine; scrubbing the lone surrogates used to recurse (a 500).
    token = fcm_pushkey()
    body = notification([device(ANDROID, token)], sender="\ud800", content="DEEP")
    deep = '{"a": ' * 500 + '"\\ud800"' + "}" * 500
    raw = json.dumps(body).replace('"DEEP"', deep).encode()
    assert await post(raw) == (200, {"rejected": []})
    assert fcm.requests_for(token)[0].message["data"]["sender"] == "\ufffd"


async def test_internal_error_is_an_empty_500(
    gw: GatewayHarness, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr("plugins.matrix.handler.plan", broken)
    response = await gw.client.post(NOTIFY, json=notification([device(IOS, apns_pushkey()[0])]))
    assert (response.status, await response.read()) == (500, b"")  # matrix.md §1.2
    text = await (await gw.client.get("/metrics")).text()
    assert 'sygnal_pushgateway_status_codes_total{code="500"} 1.0' in text


# --- payload shapes ---------------------------------------------------------------------


async def test_apns_full_message(post: Post, apns: ApnsSimulator) -> None:
    key, hexkey = apns_pushkey()
    await post(notification([device(IOS, key)]))
    request = apns.requests[0]
    assert request.headers[":path"] == f"/3/device/{hexkey}"
    assert request.headers["apns-priority"] == "10"
    assert "apns-push-type" not in request.headers
    assert "apns-expiration" not in request.headers and "apns-collapse-id" not in request.headers
    assert request.json == {
        "aps": {
            "alert": {
                "loc-key": "MSG_FROM_USER_IN_ROOM_WITH_CONTENT",
                "loc-args": [
                    "Major Tom",
                    "Mission Control",
                    "I'm floating in a most peculiar way.",
                ],
            },
            "badge": 3,
        },
        "room_id": "!slw48wfj34rtnrf:example.com",
        "event_id": "$3957tyerfgewrf384",
    }


async def test_low_priority_and_push_type(
    make_gateway: Any, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    async with make_gateway(ios={"push_type": "alert"}) as gw:
        body = notification(
            [device(IOS, apns_pushkey()[0]), device(ANDROID, fcm_pushkey())], prio="low"
        )
        assert (await gw.client.post(NOTIFY, json=body)).status == 200
    assert apns.requests[0].headers["apns-priority"] == "5"
    assert apns.requests[0].headers["apns-push-type"] == "alert"
    message = fcm.requests[0].message
    assert message["android"] == {"priority": "normal"} and message["data"]["prio"] == "normal"


async def test_sound_tweak(post: Post, apns: ApnsSimulator) -> None:
    await post(notification([device(IOS, apns_pushkey()[0], tweaks={"sound": "default"})]))
    assert apns.requests[0].json["aps"]["sound"] == "default"  # type: ignore[index]


async def test_event_id_only_and_badge_frame(
    post: Post, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    data = {"default_payload": {"aps": {"content-available": 1}}}
    body = notification(
        [device(IOS, apns_pushkey()[0], data=data), device(ANDROID, fcm_pushkey())],
        type=...,
        sender=...,
        sender_display_name=...,
        room_name=...,
        room_alias=...,
        content=...,
        counts={"unread": 2, "missed_calls": 0},
    )
    assert (await post(body))[0] == 200
    assert apns.requests[0].json == {
        "aps": {"content-available": 1},
        "room_id": "!slw48wfj34rtnrf:example.com",
        "event_id": "$3957tyerfgewrf384",
        "unread_count": 2,
        "missed_calls": 0,
    }
    assert fcm.requests[0].message["data"] == {
        "event_id": "$3957tyerfgewrf384",
        "room_id": "!slw48wfj34rtnrf:example.com",
        "prio": "high",
        "unread": "2",
    }
    badge = {
        "notification": {
            "id": "",
            "type": None,
            "sender": "",
            "counts": {"unread": 5},
            "devices": [device(IOS, apns_pushkey()[0], data=data)],
        }
    }
    assert await post(badge) == (200, {"rejected": []})
    assert apns.requests[1].json == {"aps": {"badge": 5}}


async def test_send_badge_counts_false(
    make_gateway: Any, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    async with make_gateway(
        ios={"send_badge_counts": False}, android={"send_badge_counts": False}
    ) as gw:
        badge = {
            "notification": {
                "id": "",
                "type": None,
                "sender": "",
                "counts": {"unread": 5},
                "devices": [device(IOS, apns_pushkey()[0]), device(ANDROID, fcm_pushkey())],
            }
        }
        response = await gw.client.post(NOTIFY, json=badge)
        assert await response.json() == {"rejected": []}
        body = notification([device(IOS, apns_pushkey()[0])])
        await gw.client.post(NOTIFY, json=body)
    assert not fcm.requests
    assert len(apns.requests) == 1 and "badge" not in apns.requests[0].json["aps"]  # type: ignore[index]


async def test_long_body_truncated(post: Post, apns: ApnsSimulator) -> None:
    body = notification(
        [device(IOS, apns_pushkey()[0])], content={"msgtype": "m.text", "body": "ü" * 6000}
    )
    assert (await post(body))[0] == 200
    request = apns.requests[0]
    assert len(request.body) <= 4096
    assert request.json["aps"]["alert"]["loc-key"] == "MSG_FROM_USER_IN_ROOM_WITH_CONTENT"  # type: ignore[index]


async def test_fcm_v1_exact_body(make_gateway: Any, fcm: FcmSimulator) -> None:
    options = {"android": {"ttl": "3600s"}, "apns": {"headers": {"apns-priority": "10"}}}
    async with make_gateway(android={"fcm_options": options}) as gw:
        token = fcm_pushkey()
        body = notification(
            [device(ANDROID, token, data={"default_payload": {"k": 1}})],
            content={"msgtype": "m.text", "body": "hi", "n": 1},
        )
        assert (await gw.client.post(NOTIFY, json=body)).status == 200
    request = fcm.requests[0]
    assert request.headers["Authorization"].startswith("Bearer ")
    assert request.message == {
        "android": {"ttl": "3600s", "priority": "high"},
        "apns": {"headers": {"apns-priority": "10"}},
        "data": {
            "k": "1",
            "event_id": "$3957tyerfgewrf384",
            "type": "m.room.message",
            "sender": "@exampleuser:matrix.org",
            "room_name": "Mission Control",
            "room_alias": "#exampleroom:matrix.org",
            "sender_display_name": "Major Tom",
            "room_id": "!slw48wfj34rtnrf:example.com",
            "content_msgtype": "m.text",
            "content_body": "hi",
            "prio": "high",
            "unread": "2",
            "missed_calls": "1",
        },
        "token": token,
    }


# --- isolation ---------------------------------------------------------------------------


async def test_inflight_request_limit(
    make_gateway: Any, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    slow, slow_hex = apns_pushkey(1)
    apns.script(slow_hex, ApnsResponse.ok(delay=1.0))
    async with make_gateway(ios={"inflight_request_limit": 1}) as gw:
        first = asyncio.create_task(gw.client.post(NOTIFY, json=notification([device(IOS, slow)])))
        await apns.wait_for_requests(1)
        second = await gw.client.post(NOTIFY, json=notification([device(IOS, apns_pushkey(2)[0])]))
        assert second.status == 502
        other = await gw.client.post(NOTIFY, json=notification([device(ANDROID, fcm_pushkey())]))
        assert other.status == 200
        assert (await first).status == 200
        metrics = await (await gw.client.get("/metrics")).text()
    assert f'sygnal_inflight_request_limit_drop_total{{pushkin="{IOS}"}} 1.0' in metrics


async def test_inflight_request_limit_counts_requests_not_devices(
    make_gateway: Any, apns: ApnsSimulator
) -> None:
    # Sygnal dispatches a request's devices one after another, so a request holds at
    # most one of its pushkin's in-flight slots; pushgw sends them concurrently and must
    # not refuse a request's second device for the slot its first one holds.
    slow, slow_hex = apns_pushkey(1)
    apns.script(slow_hex, ApnsResponse.ok(delay=1.0))
    async with make_gateway(ios={"inflight_request_limit": 1}) as gw:
        both = [device(IOS, slow), device(IOS, apns_pushkey(2)[0])]
        first = asyncio.create_task(gw.client.post(NOTIFY, json=notification(both)))
        await apns.wait_for_requests(2)  # both devices sent while one slot is held
        other = await gw.client.post(NOTIFY, json=notification([device(IOS, apns_pushkey(3)[0])]))
        assert other.status == 502  # the slot is the first request's until it ends
        answer = await first
        assert (answer.status, await answer.json()) == (200, {"rejected": []})
        after = await gw.client.post(NOTIFY, json=notification([device(IOS, apns_pushkey(4)[0])]))
        assert after.status == 200  # and released when it ends
        metrics = await (await gw.client.get("/metrics")).text()
    assert f'sygnal_inflight_request_limit_drop_total{{pushkin="{IOS}"}} 1.0' in metrics


async def test_broken_app_does_not_delay_another(post: Post, apns: ApnsSimulator) -> None:
    slow, slow_hex = apns_pushkey(1)
    apns.script(slow_hex, ApnsResponse(503, "ServiceUnavailable"))
    task = asyncio.create_task(post(notification([device(IOS, slow)])))
    await apns.wait_for_requests(1)
    assert await post(notification([device(ANDROID, fcm_pushkey())])) == (200, {"rejected": []})
    assert not task.done()  # answered while the broken app still retries to its deadline
    assert (await task)[0] == 502


# --- metrics and privacy ------------------------------------------------------------------


async def test_metrics_and_no_pushkeys_anywhere(
    gw: GatewayHarness,
    post: Post,
    apns: ApnsSimulator,
    fcm: FcmSimulator,
    caplog: pytest.LogCaptureFixture,
    register_secret: Any,
) -> None:
    key, hexkey = apns_pushkey(9)
    gone = fcm_pushkey(9)
    for secret in (key, hexkey, gone):
        register_secret(secret)
    fcm.script(gone, FcmResponse.unregistered())
    with caplog.at_level("DEBUG"):
        await post(notification([device(IOS, key), device(ANDROID, gone), device("nope", key)]))
        await post(b"{")
    text = await (await gw.client.get("/metrics")).text()
    for family in (
        "sygnal_notifications_received_total 1.0",
        "sygnal_notifications_devices_received_total 3.0",
        f'sygnal_per_pushkin_type_total{{pushkin="{IOS}"}} 1.0',
        'sygnal_pushgateway_status_codes_total{code="200"} 1.0',
        'sygnal_pushgateway_status_codes_total{code="400"} 1.0',
        'sygnal_notify_time_bucket{code="200",le="+Inf"} 1.0',
        'sygnal_requests_in_flight{resource="V1NotifyHandler"} 0.0',
        f'sygnal_apns_status_codes_total{{code="200",pushkin="{IOS}"}} 1.0',
        f'sygnal_gcm_status_codes_total{{code="404",pushkin="{ANDROID}"}} 1.0',
        "sygnal_apns_request_time_count 1.0",
        "sygnal_active_apns_requests 0.0",
        "sygnal_gcm_request_time_count 1.0",
        "sygnal_active_gcm_requests 0.0",
        "sygnal_pending_gcm_requests 0.0",
        "sygnal_gcm_queue_time_count",
    ):
        assert family in text, family
    for secret in (key, hexkey, gone, "Major Tom", "peculiar"):
        assert secret not in text
        assert secret not in caplog.text
    assert "unknown app ID" in caplog.text


def _no_secret_in(payload: Any, secret: str) -> bool:
    return secret not in json.dumps(payload)

"""Hostile notify bodies: never a 500, never a needless rejection (matrix.md §1.1, §1.2, §3).

Each test here reproduced a defect found by feeding the notify endpoint inputs no
homeserver sends but any client of the endpoint can.
"""

from __future__ import annotations

import json
from typing import Any

import olm
import pytest

from gateway.testing.apns_sim import ApnsSimulator
from gateway.testing.fcm_sim import FcmSimulator
from plugins.matrix.validation import NotifyError, parse_notify
from tests.matrix.conftest import Post, apns_pushkey, device, fcm_pushkey, notification

IOS = "com.example.ios"
ANDROID = "com.example.android"
ALGO = "m.curve25519-aes-sha2"


def _with_literal(body: dict[str, Any], marker: str, literal: str) -> bytes:
    """`body` as JSON with the string `marker` replaced by a raw JSON number literal."""
    encoded = json.dumps(body)
    assert encoded.count(json.dumps(marker)) == 1
    return encoded.replace(json.dumps(marker), literal).encode()


# --- numbers that overflow to infinity -------------------------------------------------


@pytest.mark.parametrize("literal", ["1e400", "-1e400", "1E+999"])
def test_overflowing_number_is_a_400(literal: str) -> None:
    # Python decodes these to inf, which no encoder downstream accepts: they are the
    # Infinity of §1.1 row 1 spelled differently.
    raw = _with_literal(notification([device(IOS, "k")], x="@@"), "@@", literal)
    with pytest.raises(NotifyError) as info:
        parse_notify(raw)
    assert str(info.value) == "Expected JSON request body"


@pytest.mark.parametrize("app", [IOS, ANDROID])
async def test_overflowing_number_in_default_payload(
    post: Post, apns: ApnsSimulator, fcm: FcmSimulator, app: str
) -> None:
    key = apns_pushkey()[0] if app == IOS else fcm_pushkey()
    body = notification([device(app, key, data={"default_payload": {"n": "@@"}})])
    assert await post(_with_literal(body, "@@", "1e400")) == (400, "Expected JSON request body")
    assert not apns.requests and not fcm.requests


async def test_overflowing_number_in_gateway_encrypted_content(
    post: Post, apns: ApnsSimulator
) -> None:
    data = {"algorithm": ALGO, "public_key": olm.PkDecryption().public_key}
    content = {"msgtype": "m.text", "body": "hi", "n": "@@"}
    body = notification([device(IOS, apns_pushkey()[0], data=data)], content=content)
    assert await post(_with_literal(body, "@@", "1e400")) == (400, "Expected JSON request body")
    assert not apns.requests


def test_large_finite_numbers_still_accepted() -> None:
    raw = _with_literal(notification([device(IOS, "k")], x="@@"), "@@", "1.7e308")
    assert parse_notify(raw).raw["x"] == 1.7e308


# --- counts beyond any real count --------------------------------------------------------


async def test_huge_counts_are_a_400_not_a_500(post: Post, apns: ApnsSimulator) -> None:
    # Two 4300-digit counts decode fine, but the APNs badge (their sum) has 4301 digits,
    # which Python refuses to turn into text: the payload could not be encoded (a 500).
    body = notification(
        [device(IOS, apns_pushkey()[0])], counts={"unread": "@@", "missed_calls": 1}
    )
    raw = _with_literal(body, "@@", "9" * 4300).replace(
        b'"missed_calls": 1', b'"missed_calls": ' + b"9" * 4300
    )
    assert await post(raw) == (400, "unread is of invalid type")
    assert not apns.requests


@pytest.mark.parametrize(
    ("counts", "message"),
    [
        ({"unread": 2**53}, "unread is of invalid type"),
        ({"unread": -(2**53)}, "unread is of invalid type"),
        ({"missed_calls": 2**53}, "missed_calls is of invalid type"),
    ],
)
def test_counts_outside_matrix_integer_range(counts: dict[str, int], message: str) -> None:
    raw = json.dumps(notification([device(IOS, "k")], counts=counts)).encode()
    with pytest.raises(NotifyError) as info:
        parse_notify(raw)
    assert str(info.value) == message


def test_counts_at_matrix_integer_bounds_accepted() -> None:
    counts = {"unread": 2**53 - 1, "missed_calls": -(2**53) + 1}
    parsed = parse_notify(json.dumps(notification([device(IOS, "k")], counts=counts)).encode())
    assert (parsed.counts.unread, parsed.counts.missed_calls) == (2**53 - 1, -(2**53) + 1)


# --- over-long APNs pushkeys -------------------------------------------------------------


async def test_overlong_apns_pushkey_rejected_without_sending(
    post: Post, apns: ApnsSimulator
) -> None:
    # A 100 kB pushkey became a 150 kB `:path` header: the HTTP/2 peer tore the shared
    # connection down (taking other in-flight pushes with it), every retry did the same,
    # and the homeserver got a 502, so it would retry the event for a day.
    pushkey = "A" * 100_000
    assert await post(notification([device(IOS, pushkey)])) == (200, {"rejected": [pushkey]})
    assert not apns.requests


async def test_pushkey_of_512_bytes_still_sent(post: Post, apns: ApnsSimulator) -> None:
    pushkey = "A" * 512  # the Matrix limit for a pushkey
    assert await post(notification([device(IOS, pushkey)])) == (200, {"rejected": []})
    assert apns.requests[0].token == "00" * 384


async def test_overlong_hex_pushkey_rejected_without_sending(
    make_gateway: Any, apns: ApnsSimulator
) -> None:
    async with make_gateway(ios={"convert_device_token_to_hex": False}) as gw:
        pushkey = "ab" * 50_000
        response = await gw.client.post(
            "/_matrix/push/v1/notify", json=notification([device(IOS, pushkey)])
        )
        assert await response.json() == {"rejected": [pushkey]}
    assert not apns.requests


# --- tweaks.sound (a divergence) must not cost the pusher -------------------------------------


async def test_unfittable_sound_is_dropped_not_rejected(post: Post, apns: ApnsSimulator) -> None:
    # Sygnal ignores tweaks.sound and would deliver this; honouring it made the payload
    # unfittable, and the rejected pushkey would make Synapse delete the pusher.
    key, _ = apns_pushkey()
    body = notification([device(IOS, key, tweaks={"sound": "s" * 5000})])
    assert await post(body) == (200, {"rejected": []})
    payload = apns.requests[0].json
    assert payload is not None and "sound" not in payload["aps"]
    assert payload["aps"]["alert"]["loc-key"] == "MSG_FROM_USER_IN_ROOM_WITH_CONTENT"


async def test_unfittable_sound_dropped_on_encrypted_frame(post: Post, apns: ApnsSimulator) -> None:
    data = {"algorithm": ALGO, "public_key": olm.PkDecryption().public_key}
    body = notification([device(IOS, apns_pushkey()[0], data=data, tweaks={"sound": "s" * 5000})])
    assert await post(body) == (200, {"rejected": []})
    payload = apns.requests[0].json
    assert payload is not None and "sound" not in payload["aps"]
    assert "ciphertext" in payload  # the sound gave way, not the encrypted notification


async def test_fitting_sound_still_sent(post: Post, apns: ApnsSimulator) -> None:
    body = notification([device(IOS, apns_pushkey()[0], tweaks={"sound": "ping.caf"})])
    assert await post(body) == (200, {"rejected": []})
    payload = apns.requests[0].json
    assert payload is not None and payload["aps"]["sound"] == "ping.caf"


# --- one request, thousands of devices -------------------------------------------------


async def test_a_request_of_thousands_of_unknown_devices_is_not_thousands_of_log_lines(
    post: Post, caplog: pytest.LogCaptureFixture
) -> None:
    """The endpoint has no authentication and one body holds thousands of devices: each
    rejected device was a WARNING line, so one request wrote thousands. The first few
    are logged as they come, the rest counted in one line; every pushkey is still
    rejected in the answer."""
    devices = [device(f"made.up.{i}", f"key{i}") for i in range(3_000)]
    with caplog.at_level("INFO", logger="plugins.matrix"):
        status, answer = await post(notification(devices))
    assert status == 200
    assert len(answer["rejected"]) == 3_000
    lines = [r for r in caplog.records if r.name == "plugins.matrix"]
    assert len(lines) <= 11
    assert sum("pushkey rejected" in r.getMessage() for r in lines) == 10
    assert lines[-1].getMessage() == (
        "notify request of 3000 devices: 2990 more device messages not logged"
    )


async def test_a_single_device_request_logs_its_line(
    post: Post, caplog: pytest.LogCaptureFixture
) -> None:
    """What Synapse sends (one device per request) is logged as before: no summary line."""
    with caplog.at_level("INFO", logger="plugins.matrix"):
        await post(notification([device("made.up", "key")]))
    messages = [r.getMessage() for r in caplog.records if r.name == "plugins.matrix"]
    assert messages == ["device 0: unknown app ID, pushkey rejected"]

"""MSC3013 over HTTP (matrix.md §6.1, §6.2): pass-through and gateway-encrypt modes."""

from __future__ import annotations

import json
from typing import Any

import olm
import pytest

from gateway.testing.apns_sim import ApnsSimulator
from gateway.testing.fcm_sim import FcmSimulator
from tests.matrix.conftest import NOTIFY, Post, apns_pushkey, device, fcm_pushkey, notification

IOS = "com.example.ios"
ANDROID = "com.example.android"
ALGO = "com.famedly.curve25519-aes-sha2"
FRAME = {"ciphertext": "Q2lwaGVyIHRleHQ+/w", "ephemeral": "RXBoZW1lcmFsIGtleQ", "mac": "TWFjIQ"}


def frame(devices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"notification": {**FRAME, **extra, "devices": devices}}


async def test_passthrough_event(post: Post, apns: ApnsSimulator, fcm: FcmSimulator) -> None:
    data = {"algorithm": ALGO, "default_payload": {"aps": {"category": "MSG"}, "x": 1}}
    body = frame(
        [
            device(IOS, apns_pushkey()[0], data=data, tweaks={"sound": "ping"}),
            device(ANDROID, fcm_pushkey(), data=data),
        ]
    )
    assert await post(body) == (200, {"rejected": []})
    request = apns.requests[0]
    assert request.json == {
        "aps": {
            "category": "MSG",
            "mutable-content": 1,
            "alert": {"body": "New message"},
            "sound": "ping",
        },
        "x": 1,
        **FRAME,
        "algorithm": ALGO,
    }
    assert request.headers["apns-priority"] == "10"
    assert request.headers["apns-push-type"] == "alert"
    message = fcm.requests[0].message
    assert message["data"] == {"aps": '{"category":"MSG"}', "x": "1", **FRAME, "algorithm": ALGO}
    assert message["android"] == {"priority": "high"}


async def test_passthrough_boolean_counts_only(
    post: Post, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    data = {"algorithm": ALGO}
    body = frame(
        [device(IOS, apns_pushkey()[0], data=data), device(ANDROID, fcm_pushkey(), data=data)],
        is_counts_only=True,
    )
    assert (await post(body))[0] == 200
    request = apns.requests[0]
    assert request.json == {"aps": {"content-available": 1}, **FRAME, "algorithm": ALGO}
    assert request.headers["apns-priority"] == "5"
    assert request.headers["apns-push-type"] == "background"
    message = fcm.requests[0].message
    assert message["data"] == {**FRAME, "algorithm": ALGO, "is_counts_only": "true"}
    assert message["android"] == {"priority": "normal"}


async def test_passthrough_full_counts(post: Post, apns: ApnsSimulator, fcm: FcmSimulator) -> None:
    body = frame(
        [device(IOS, apns_pushkey()[0]), device(ANDROID, fcm_pushkey())],
        counts={"unread": 3, "missed_calls": 1},
    )
    assert (await post(body))[0] == 200
    assert apns.requests[0].json == {"aps": {"badge": 4}, **FRAME}
    assert apns.requests[0].headers["apns-priority"] == "5"
    assert fcm.requests[0].message["data"] == {**FRAME, "unread": "3", "missed_calls": "1"}


async def test_passthrough_oversize(
    post: Post, apns: ApnsSimulator, fcm: FcmSimulator, gw: Any
) -> None:
    big = dict(FRAME, ciphertext="A" * 5000)
    body = {
        "notification": {
            **big,
            "devices": [device(IOS, apns_pushkey()[0]), device(ANDROID, fcm_pushkey())],
        }
    }
    assert (await post(body))[0] == 200
    assert apns.requests[0].json == {
        "aps": {"mutable-content": 1, "alert": {"body": "New message"}},
        "ciphertext_omitted": True,
    }
    assert fcm.requests[0].message["data"] == {"ciphertext_omitted": "true"}
    text = await (await gw.client.get("/metrics")).text()
    assert f'pushgw_matrix_msc3013_oversize_total{{pushkin="{IOS}"}} 1.0' in text


async def test_mode_off_is_sygnal_parity(make_gateway: Any, apns: ApnsSimulator) -> None:
    async with make_gateway(ios={"msc3013_mode": "off"}) as gw:
        body = frame([device(IOS, apns_pushkey()[0])], counts={"unread": 1})
        assert (await gw.client.post(NOTIFY, json=body)).status == 200
    assert apns.requests[0].json == {"aps": {"badge": 1}}


# A malformed MSC3013 section only matters to devices whose app reads it (mode auto or
# passthrough): it is answered 400 before anything is sent if the request has such a
# device, and ignored (Sygnal parity) when every device is on an `off` app or unknown.
BROKEN = {"mac": "not-msc3013", "is_counts_only": "yes"}


async def test_mode_off_with_an_unknown_app_ignores_a_broken_section(
    make_gateway: Any, apns: ApnsSimulator
) -> None:
    async with make_gateway(ios={"msc3013_mode": "off"}) as gw:
        key, hexkey = apns_pushkey()
        body = notification([device(IOS, key), device("com.example.unknown", "gone")], **BROKEN)
        response = await gw.client.post(NOTIFY, json=body)
        assert (response.status, await response.json()) == (200, {"rejected": ["gone"]})
    assert [r.token for r in apns.requests] == [hexkey]
    assert "mac" not in apns.requests[0].json


@pytest.mark.parametrize("mode", ["auto", "passthrough"])
async def test_broken_section_with_a_device_that_reads_it_is_a_400(
    make_gateway: Any, apns: ApnsSimulator, fcm: FcmSimulator, mode: str
) -> None:
    async with make_gateway(ios={"msc3013_mode": "off"}, android={"msc3013_mode": mode}) as gw:
        body = notification([device(IOS, apns_pushkey()[0]), device(ANDROID, fcm_pushkey())])
        body["notification"]["mac"] = "not-msc3013"
        response = await gw.client.post(NOTIFY, json=body)
        assert (response.status, await response.text()) == (400, "Invalid encrypted notification")
    assert apns.requests == [] and fcm.requests == []  # nothing sent, not even to `off`


async def test_mode_off_next_to_auto_with_a_valid_section(
    make_gateway: Any, apns: ApnsSimulator, fcm: FcmSimulator
) -> None:
    async with make_gateway(ios={"msc3013_mode": "off"}) as gw:
        devices = [device(IOS, apns_pushkey()[0]), device(ANDROID, fcm_pushkey())]
        body = notification(devices, counts=..., **FRAME)
        assert (await gw.client.post(NOTIFY, json=body)).status == 200
    sent = apns.requests[0].json  # off: the fields ignored, Sygnal's alert
    assert not FRAME.keys() & sent.keys() and sent["aps"]["alert"]["loc-key"]
    assert fcm.requests[0].message["data"] == FRAME  # auto: forwarded


# --- gateway-encrypt -------------------------------------------------------------------------


def _decrypt(decryption: olm.PkDecryption, fields: dict[str, Any]) -> dict[str, Any]:
    for key in ("ciphertext", "ephemeral", "mac"):
        assert "=" not in fields[key]
    plaintext = decryption.decrypt(
        olm.PkMessage(fields["ephemeral"], fields["mac"], fields["ciphertext"])
    )
    return json.loads(plaintext)  # type: ignore[no-any-return]


@pytest.mark.parametrize("algorithm", ["m.curve25519-aes-sha2", "com.famedly.curve25519-aes-sha2"])
async def test_gateway_encrypt_decrypts_with_python_olm(
    post: Post, apns: ApnsSimulator, fcm: FcmSimulator, algorithm: str
) -> None:
    decryption = olm.PkDecryption()
    data = {"algorithm": algorithm, "public_key": decryption.public_key, "counts_only_type": "none"}
    body = notification(
        [device(IOS, apns_pushkey()[0], data=data), device(ANDROID, fcm_pushkey(), data=data)]
    )
    expected = {k: v for k, v in body["notification"].items() if k != "devices"}
    assert await post(body) == (200, {"rejected": []})
    payload = apns.requests[0].json
    assert payload is not None
    assert _decrypt(decryption, payload) == expected
    assert payload["algorithm"] == algorithm and payload["aps"]["mutable-content"] == 1
    data_map = fcm.requests[0].message["data"]
    assert _decrypt(decryption, data_map) == expected
    for request_body in (apns.requests[0].body.decode(), json.dumps(fcm.requests[0].message)):
        assert decryption.public_key not in request_body
        assert "counts_only_type" not in request_body
        assert "Major Tom" not in request_body and "peculiar" not in request_body
    assert apns.requests[0].json["ephemeral"] != data_map["ephemeral"]  # type: ignore[index]


async def test_gateway_encrypt_keeps_key_order_and_unicode(post: Post, apns: ApnsSimulator) -> None:
    decryption = olm.PkDecryption()
    data = {"algorithm": ALGO, "public_key": decryption.public_key}
    raw = (
        '{"notification":{"room_name":"Ünï 😀","event_id":"$e","prio":"high","devices":'
        + json.dumps([device(IOS, apns_pushkey()[0], data=data)])
        + "}}"
    )
    await post(raw.encode())
    payload = apns.requests[0].json
    assert payload is not None
    text = decryption.decrypt(
        olm.PkMessage(payload["ephemeral"], payload["mac"], payload["ciphertext"])
    )
    assert text == '{"room_name":"Ünï 😀","event_id":"$e","prio":"high"}'


async def test_gateway_encrypt_ciphertext_mac_mode(make_gateway: Any, apns: ApnsSimulator) -> None:
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    from plugins.matrix import msc3013

    secret = X25519PrivateKey.generate()
    public = msc3013.b64encode(secret.public_key().public_bytes_raw())
    async with make_gateway(ios={"msc3013_mac": "ciphertext"}) as gw:
        body = notification(
            [device(IOS, apns_pushkey()[0], data={"algorithm": ALGO, "public_key": public})]
        )
        assert (await gw.client.post(NOTIFY, json=body)).status == 200
    p = apns.requests[0].json
    assert p is not None
    msc3013.decrypt(secret, p["ephemeral"], p["ciphertext"], p["mac"], mac_mode="ciphertext")
    with pytest.raises(msc3013.Msc3013Error):
        msc3013.decrypt(secret, p["ephemeral"], p["ciphertext"], p["mac"], mac_mode="libolm")


async def test_gateway_encrypt_boolean_counts_only(post: Post, apns: ApnsSimulator) -> None:
    decryption = olm.PkDecryption()
    data = {"algorithm": ALGO, "public_key": decryption.public_key, "counts_only_type": "boolean"}
    body = {
        "notification": {
            "prio": "high",
            "counts": {"unread": 2},
            "devices": [device(IOS, apns_pushkey()[0], data=data)],
        }
    }
    assert (await post(body))[0] == 200
    payload = apns.requests[0].json
    assert payload is not None and payload["aps"] == {"content-available": 1}
    assert apns.requests[0].headers["apns-push-type"] == "background"
    assert _decrypt(decryption, payload) == {"prio": "high", "counts": {"unread": 2}}


async def test_gateway_encrypt_shrinks_plaintext(post: Post, fcm: FcmSimulator) -> None:
    decryption = olm.PkDecryption()
    data = {"algorithm": ALGO, "public_key": decryption.public_key}
    body = notification(
        [device(ANDROID, fcm_pushkey(), data=data)],
        content={"msgtype": "m.text", "body": "x" * 5000},
    )
    assert (await post(body))[0] == 200
    plain = _decrypt(decryption, fcm.requests[0].message["data"])
    assert plain["event_id"] == "$3957tyerfgewrf384"
    assert len(plain.get("content", {}).get("body", "")) <= 1024


@pytest.mark.parametrize(
    "public_key",
    [
        None,
        "short",
        "hSDwCYkwp1R0i33ctD73Wg2/Og0mOBr066SpjqqbTmoA",
        "A" * 43,  # 32 zero bytes: a low-order point, no shared secret (was a 500)
        "4Ot6fDtBuK4WVuP68Z/EatoJjeucMrH9hmIFFl9JuAA",  # an order-8 point
    ],
)
async def test_gateway_encrypt_bad_key_rejected(
    post: Post, apns: ApnsSimulator, fcm: FcmSimulator, public_key: Any
) -> None:
    data: dict[str, Any] = {"algorithm": ALGO}
    if public_key is not None:
        data["public_key"] = public_key
    keys = [apns_pushkey()[0], fcm_pushkey()]
    body = notification([device(IOS, keys[0], data=data), device(ANDROID, keys[1], data=data)])
    assert await post(body) == (200, {"rejected": keys})
    assert not apns.requests and not fcm.requests


async def test_padded_public_key_accepted(post: Post, apns: ApnsSimulator) -> None:
    decryption = olm.PkDecryption()
    padded = decryption.public_key + "="
    body = notification(
        [device(IOS, apns_pushkey()[0], data={"algorithm": ALGO, "public_key": padded})]
    )
    assert (await post(body))[0] == 200
    assert _decrypt(decryption, apns.requests[0].json or {})["event_id"] == "$3957tyerfgewrf384"


async def test_passthrough_mode_leaves_plain_frames(make_gateway: Any, apns: ApnsSimulator) -> None:
    async with make_gateway(ios={"msc3013_mode": "passthrough"}) as gw:
        data = {"algorithm": ALGO, "public_key": olm.PkDecryption().public_key}
        body = notification([device(IOS, apns_pushkey()[0], data=data)])
        assert (await gw.client.post(NOTIFY, json=body)).status == 200
    assert "ciphertext" not in (apns.requests[0].json or {})

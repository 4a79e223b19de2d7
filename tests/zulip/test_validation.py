"""Request validation and payload builders (pure functions)."""

from __future__ import annotations

import json

import pytest

from plugins.zulip.errors import ZulipError
from plugins.zulip.payloads import (
    apns_test_body,
    e2ee_fcm_message,
    fcm_data,
    fcm_test_message,
    legacy_apns_body,
    legacy_fcm_message,
    truncate_remove,
)
from plugins.zulip.validation import (
    INT32,
    check_int_range,
    check_text,
    check_token_id,
    json_field,
    parse_e2ee_notify,
    parse_json,
    parse_registration_plaintext,
    validate_email,
    validate_gcm_options,
    validate_hostname,
    validate_org_id,
)


def _reg(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_registration_plaintext_ok() -> None:
    reg = parse_registration_plaintext(
        _reg(token_kind="apns", token="C0FFEE", timestamp=1, ios_app_id="a.b-c", extra=1)
    )
    assert (reg.token, reg.token_kind, reg.ios_app_id, reg.timestamp) == (
        "C0FFEE",
        "apns",
        "a.b-c",
        1,
    )
    assert "C0FFEE" not in repr(reg)
    fcm = parse_registration_plaintext(_reg(token_kind="fcm", token="x", timestamp=2))
    assert fcm.ios_app_id is None


@pytest.mark.parametrize(
    "plaintext",
    [
        b"\xff\xfe",
        b"[]",
        b"not json",
        _reg(token_kind="apns", token="c0ffee", timestamp=1, ios_app_id="* -- +"),
        _reg(token_kind="xyz", token="c0ffee", timestamp=1),
        _reg(token_kind="apns", token="c0ffee", timestamp=1),
        _reg(token_kind="apns", token="c0ffee", timestamp=1, ios_app_id=None),
        _reg(token_kind="fcm", token="tok", timestamp=1, ios_app_id="a.b"),
        _reg(token_kind="fcm", token="", timestamp=1),
        _reg(token_kind="fcm", token="x" * 4097, timestamp=1),
        _reg(token_kind="apns", token="c0ffeg", timestamp=1, ios_app_id="a"),
        _reg(token_kind="apns", token="c0ffe", timestamp=1, ios_app_id="a"),
        _reg(token_kind="fcm", token="tok", timestamp="1"),
        _reg(token_kind="fcm", token="tok", timestamp=True),
        _reg(token_kind="fcm", token=5, timestamp=1),
    ],
)
def test_registration_plaintext_refused(plaintext: bytes) -> None:
    with pytest.raises(ZulipError) as info:
        parse_registration_plaintext(plaintext)
    assert info.value.msg == "Invalid encrypted_push_registration"
    assert info.value.code == "BAD_REQUEST"


def test_check_token_id() -> None:
    assert check_token_id("+wKIhyAx/Eg=", "c0ffee") == -359574906294109112
    for bad in ("192057", "+wKIhyAx/Eg", "AAAAAAAAAAE="):
        with pytest.raises(ZulipError):
            check_token_id(bad, "c0ffee")


def _apns_req(**over: object) -> dict:
    req = {
        "token_id": "+wKIhyAx/Eg=",
        "http_headers": {"apns_priority": 10, "apns_push_type": "alert"},
        "payload": {"push_key_id": 10, "encrypted_data": "abc", "aps": {"alert": {"title": "x"}}},
    }
    req.update(over)
    return req


def test_parse_e2ee_notify() -> None:
    fcm = {
        "token_id": "iGFeKNj3ngQ=",
        "fcm_priority": "high",
        "payload": {"push_key_id": 4294967295, "encrypted_data": "e"},
    }
    no_aps = _apns_req(payload={"push_key_id": 1, "encrypted_data": "d"})
    notify = parse_e2ee_notify({"realm_uuid": "r", "push_requests": [_apns_req(), fcm, no_aps]})
    apns, fcm_req, default = notify.push_requests
    assert apns.payload == _apns_req()["payload"]  # type: ignore[union-attr]
    assert fcm_req.push_key_id == 4294967295  # type: ignore[union-attr]
    assert default.payload["aps"] == {  # type: ignore[union-attr]
        "mutable-content": 1,
        "alert": {"title": "New notification"},
    }


@pytest.mark.parametrize(
    ("body", "msg"),
    [
        ([], "Malformed JSON"),
        ({"push_requests": []}, "Missing 'realm_uuid' argument"),
        ({"realm_uuid": "r"}, "Missing 'push_requests' argument"),
        (
            {"realm_uuid": "r", "push_requests": [_apns_req(token_id="192057")]},
            "`token_id` is not Base64 encoded",
        ),
        (
            {"realm_uuid": "r", "push_requests": [_apns_req(token_id="%%%%")]},
            "`token_id` is not Base64 encoded",
        ),
        (
            {
                "realm_uuid": "r",
                "push_requests": [
                    _apns_req(http_headers={"apns_priority": 7, "apns_push_type": "alert"})
                ],
            },
            None,
        ),
        (
            {
                "realm_uuid": "r",
                "push_requests": [
                    _apns_req(http_headers={"apns_priority": 10, "apns_push_type": "x"})
                ],
            },
            None,
        ),
        (
            {
                "realm_uuid": "r",
                "push_requests": [_apns_req(payload={"push_key_id": -1, "encrypted_data": "x"})],
            },
            None,
        ),
        (
            {
                "realm_uuid": "r",
                "push_requests": [_apns_req(payload={"push_key_id": 2**32, "encrypted_data": "x"})],
            },
            None,
        ),
        (
            {
                "realm_uuid": "r",
                "push_requests": [_apns_req(payload={"push_key_id": "1", "encrypted_data": "x"})],
            },
            None,
        ),
        ({"realm_uuid": "r", "push_requests": [_apns_req(payload={"push_key_id": 1})]}, None),
        (
            {
                "realm_uuid": "r",
                "push_requests": [
                    _apns_req(payload={"push_key_id": 1, "encrypted_data": "x", "aps": 3})
                ],
            },
            None,
        ),
        (
            {
                "realm_uuid": "r",
                "push_requests": [
                    {
                        "token_id": "AAAAAAAAAAE=",
                        "fcm_priority": "x",
                        "payload": {"push_key_id": 1, "encrypted_data": "x"},
                    }
                ],
            },
            None,
        ),
        ({"realm_uuid": "r", "push_requests": [{"token_id": "AAAAAAAAAAE="}]}, None),
        ({"realm_uuid": "r", "push_requests": [{**_apns_req(), "fcm_priority": "high"}]}, None),
        ({"realm_uuid": "r", "push_requests": "x"}, None),
    ],
)
def test_parse_e2ee_notify_errors(body: object, msg: str | None) -> None:
    with pytest.raises(ZulipError) as info:
        parse_e2ee_notify(body)
    assert info.value.status == 400
    if msg is not None:
        assert info.value.msg == msg


def test_server_fields() -> None:
    assert validate_org_id("6cde5f7a-1f7e-4978-9716-49f69ebfc9fe")
    for bad in (
        "6CDE5F7A-1F7E-4978-9716-49F69EBFC9FE",
        "1234",
        "6cde5f7a-1f7e-1978-9716-49f69ebfc9fe",
    ):
        with pytest.raises(ZulipError, match="Invalid UUID"):
            validate_org_id(bad)
    assert validate_hostname("zulip.example.org:8443")
    with pytest.raises(ZulipError, match="contains invalid components"):
        validate_hostname("zulip.example.org/path")
    with pytest.raises(ZulipError, match="is not a valid hostname"):
        validate_hostname("bad host")
    with pytest.raises(ZulipError) as info:
        validate_email("nope")
    assert info.value.msg.startswith("Invalid server administrator email address: ")
    assert "email_reason" in info.value.data
    validate_email("admin@example.org")


def test_json_field() -> None:
    assert json_field({"a": "2"}, "a", kind=int) == 2
    with pytest.raises(ZulipError) as info:
        json_field({}, "a")
    assert info.value.code == "REQUEST_VARIABLE_MISSING"
    assert info.value.data == {"var_name": "a"}
    with pytest.raises(ZulipError):
        json_field({"a": "{"}, "a")
    with pytest.raises(ZulipError):
        json_field({"a": "true"}, "a", kind=int)


def test_gcm_options() -> None:
    assert validate_gcm_options({}, "message") == "high"
    assert validate_gcm_options({}, "remove") == "normal"
    assert validate_gcm_options({"priority": "normal"}, "message") == "normal"
    with pytest.raises(ZulipError) as info:
        validate_gcm_options({"priority": "x"}, "message")
    assert info.value.msg == "Invalid GCM option to bouncer: priority 'x'"
    with pytest.raises(ZulipError) as info:
        validate_gcm_options({"foo": 1}, "message")
    assert info.value.msg == 'Invalid GCM options to bouncer: {"foo":1}'


def test_payload_builders() -> None:
    assert e2ee_fcm_message(7, "d", "normal") == {
        "data": {"push_key_id": "7", "encrypted_data": "d"},
        "android": {"priority": "normal"},
    }
    assert fcm_data({"a": 1, "b": True, "c": 1.5, "d": None, "e": [1, 2], "f": "s"}) == {
        "a": "1",
        "b": "True",
        "c": "1.5",
        "d": "null",
        "e": "[1,2]",
        "f": "s",
    }
    ids = ",".join(str(i) for i in range(249, 0, -1))
    out = truncate_remove({"event": "remove", "zulip_message_ids": ids})
    assert out["zulip_message_ids"] == ",".join(str(i) for i in range(50, 250))
    assert (
        truncate_remove({"event": "message", "zulip_message_ids": ids})["zulip_message_ids"] == ids
    )
    body = legacy_apns_body({"alert": {"title": "t"}, "badge": 0, "custom": {"zulip": {"x": 1}}})
    assert body == {"zulip": {"x": 1}, "aps": {"alert": {"title": "t"}, "badge": 0}}
    assert legacy_fcm_message({"event": "message", "id": 3}, "high") == {
        "data": {"event": "message", "id": "3"},
        "android": {"priority": "high"},
    }
    apns = apns_test_body({"realm_name": "R", "realm_uri": "https://r"})
    assert apns["aps"]["alert"]["body"] == "This is a test notification from R (https://r)."
    assert apns["zulip"]["event"] == "test"
    fcm = fcm_test_message({"realm_name": "R"}, 123)
    assert fcm["data"]["time"] == "123" and fcm["android"]["priority"] == "high"


def test_parse_json_is_strict() -> None:
    assert parse_json(b'{"a": ["\\u00e9", "\\ud83d\\ude00"]}') == {"a": ["\u00e9", "\U0001f600"]}
    bad = [
        b'"\\ud800"',  # lone high surrogate
        b'"\\udc00x"',  # lone low surrogate
        b'{"\\ud800": 1}',  # in a key
        b'"\xed\xa0\x80"',  # a surrogate encoded as UTF-8
        b"\xff",
        '"x"'.encode("utf-16"),
        b"NaN",
        b"[-Infinity]",
        b"[" * 100_000 + b"]" * 100_000,
    ]
    for raw in bad:
        with pytest.raises(ValueError):
            parse_json(raw)


def test_check_text_is_iterative() -> None:
    deep: list = ["\ud800"]
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ValueError):
        check_text(deep)
    check_text({"ok": [{"\u00e9": "\U0001f600"}]})


def test_check_int_range() -> None:
    assert check_int_range(2**63 - 1, "x") == 2**63 - 1
    assert check_int_range(-(2**31), "x", INT32) == -(2**31)
    for value, msg in ((2**63, "x is too large"), (-(2**63) - 1, "x is too small")):
        with pytest.raises(ZulipError, match=msg):
            check_int_range(value, "x")
    with pytest.raises(ZulipError, match="x is too large"):
        check_int_range(2**31, "x", INT32)

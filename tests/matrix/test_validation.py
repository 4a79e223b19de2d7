"""matrix.md §1.1: every validation row, in order, with Sygnal's exact messages."""

from __future__ import annotations

import json
from typing import Any

import pytest

from plugins.matrix.validation import NotifyError, parse_notify


def body(notification: Any = None, **top: Any) -> bytes:
    return json.dumps({"notification": notification, **top}).encode()


def dev(**fields: Any) -> dict[str, Any]:
    return {"app_id": "com.example.app", "pushkey": "key", **fields}


def error_of(raw: bytes) -> str:
    with pytest.raises(NotifyError) as info:
        parse_notify(raw)
    return str(info.value)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"not json", "Expected JSON request body"),
        (b"\xff\xfe{}", "Expected JSON request body"),
        (b'{"notification": {"devices": [], "x": NaN}}', "Expected JSON request body"),
        (b'{"notification": {"devices": [], "x": Infinity}}', "Expected JSON request body"),
        (b'{"notification": {"devices": [], "x": -Infinity}}', "Expected JSON request body"),
        (b"[1, 2]", "Invalid notification: expecting object in 'notification' key"),
        (b"{}", "Invalid notification: expecting object in 'notification' key"),
        (b'{"notification": []}', "Invalid notification: expecting object in 'notification' key"),
        (b'{"notification": null}', "Invalid notification: expecting object in 'notification' key"),
        (body({}), "Expected list in 'devices' key"),
        (body({"devices": {}}), "Expected list in 'devices' key"),
        (body({"devices": [], "counts": []}), "counts is of invalid type"),
        (body({"devices": [], "counts": None}), "counts is of invalid type"),
        (body({"devices": [], "counts": {"unread": "1"}}), "unread is of invalid type"),
        (body({"devices": [], "counts": {"unread": 1.5}}), "unread is of invalid type"),
        (body({"devices": [], "counts": {"unread": None}}), "unread is of invalid type"),
        (body({"devices": [], "counts": {"missed_calls": "x"}}), "missed_calls is of invalid type"),
        (body({"devices": ["x"]}), "Device with missing or non-string app_id"),
        (body({"devices": [{"pushkey": "k"}]}), "Device with missing or non-string app_id"),
        (
            body({"devices": [{"app_id": 1, "pushkey": "k"}]}),
            "Device with missing or non-string app_id",
        ),
        (body({"devices": [{"app_id": "a"}]}), "Device with missing or non-string pushkey"),
        (
            body({"devices": [{"app_id": "a", "pushkey": None}]}),
            "Device with missing or non-string pushkey",
        ),
        (body({"devices": [dev(pushkey_ts="1")]}), "pushkey_ts is of invalid type"),
        (body({"devices": [dev(data=None)]}), "data is of invalid type"),
        (body({"devices": [dev(data=[])]}), "data is of invalid type"),
        (body({"devices": [dev(tweaks=None)]}), "tweaks is of invalid type"),
        (body({"devices": [dev(tweaks={"sound": 1})]}), "sound is of invalid type"),
        (body({"devices": [dev()], "ciphertext": "a"}), "Invalid encrypted notification"),
        (
            body({"devices": [dev()], "ciphertext": "a", "ephemeral": "b"}),
            "Invalid encrypted notification",
        ),
        (
            body({"devices": [dev()], "ciphertext": "a", "ephemeral": "b", "mac": 1}),
            "Invalid encrypted notification",
        ),
        (body({"devices": [dev()], "is_counts_only": "yes"}), "Invalid encrypted notification"),
        (body({"devices": []}), "No devices in notification"),
    ],
)
def test_each_row(raw: bytes, message: str) -> None:
    assert error_of(raw) == message


def test_order_devices_before_counts() -> None:
    assert error_of(body({"counts": []})) == "Expected list in 'devices' key"


def test_order_counts_before_devices() -> None:
    assert error_of(body({"devices": ["x"], "counts": []})) == "counts is of invalid type"


def test_order_first_bad_device_wins() -> None:
    raw = body({"devices": [{"app_id": "a"}, {"pushkey": "k"}]})
    assert error_of(raw) == "Device with missing or non-string pushkey"


def test_empty_devices_checked_last() -> None:
    raw = body({"devices": [], "ciphertext": "a"})
    assert error_of(raw) == "Invalid encrypted notification"
    with pytest.raises(NotifyError, match="Invalid encrypted notification"):
        parse_notify(raw, defer_encrypted=True)  # no device to defer to: §1.1 order


@pytest.mark.parametrize(
    "fields",
    [{"ciphertext": "a"}, {"ciphertext": "a", "ephemeral": "b", "mac": 1}, {"is_counts_only": 1}],
)
def test_deferred_encrypted_section(fields: dict[str, Any]) -> None:
    """The handler defers the check to the devices' apps (`msc3013_mode: off` ignores it)."""
    n = parse_notify(body({"devices": [dev()], **fields}), defer_encrypted=True)
    assert n.invalid_encrypted and not n.encrypted
    assert (n.ciphertext, n.ephemeral, n.mac, n.is_counts_only) == (None, None, None, None)
    valid = {"ciphertext": "c", "ephemeral": "e", "mac": "m"}
    n = parse_notify(body({"devices": [dev()], **valid}), defer_encrypted=True)
    assert n.encrypted and not n.invalid_encrypted


def test_lenient_fields() -> None:
    n = parse_notify(
        body(
            {
                "devices": [dev(tweaks={"highlight": True}, data={"x": 1})],
                "room_name": 12,
                "sender": None,
                "type": ["x"],
                "content": "text",
                "user_is_target": "yes",
                "id": "ignored",
                "counts": {},
            }
        )
    )
    assert n.room_name is None and n.sender is None and n.type is None
    assert n.content is None and n.user_is_target is False
    assert n.has_counts and n.counts.unread is None
    assert n.devices[0].pushkey_ts == 0 and n.devices[0].sound is None
    assert n.devices[0].data == {"x": 1}


def test_encrypted_fields_parsed() -> None:
    n = parse_notify(
        body(
            {
                "devices": [dev()],
                "ciphertext": "c",
                "ephemeral": "e",
                "mac": "m",
                "is_counts_only": True,
            }
        )
    )
    assert (n.ciphertext, n.ephemeral, n.mac, n.is_counts_only) == ("c", "e", "m", True)
    assert n.encrypted


def test_lone_surrogates_become_replacement_characters() -> None:
    n = parse_notify(
        b'{"notification": {"devices": [{"app_id": "a", "pushkey": "k"}], '
        b'"room_name": "x\\ud800y"}}'
    )
    assert n.room_name == "x\ufffdy"


def test_lone_surrogates_scrubbed_at_any_accepted_depth() -> None:
    # 500 levels parse fine; the scrub used to recurse and raise RecursionError (a 500).
    deep = '{"k\\udc00": ' * 500 + '["\\ud800"]' + "}" * 500
    head = b'{"notification": {"devices": [{"app_id": "a", "pushkey": "k"}], "sender": "\\ud800"'
    raw = head + b', "content": ' + deep.encode() + b"}}"
    n = parse_notify(raw)
    assert n.sender == "\ufffd"
    node: Any = n.content
    for _ in range(499):
        assert list(node) == ["k\ufffd"]
        node = node["k\ufffd"]
    assert node == {"k\ufffd": ["\ufffd"]}


def test_deep_nesting_is_a_400() -> None:
    raw = b'{"notification": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert error_of(raw) == "Expected JSON request body"


def test_repr_hides_pushkey() -> None:
    n = parse_notify(body({"devices": [dev(pushkey="SECRET-PUSHKEY")]}))
    assert "SECRET" not in repr(n) and "SECRET" not in repr(n.devices[0])

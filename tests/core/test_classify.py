"""Every row of the APNs (§2.2) and FCM (§3.2) classification tables in specs/providers.md."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.core.classify import (
    BAD_REQUEST_TYPE,
    FCM_ERROR_TYPE,
    classify_apns,
    classify_fcm,
    parse_fcm_error,
)
from gateway.core.http import parse_retry_after
from gateway.core.push import Outcome

# --- APNs ------------------------------------------------------------------------------

APNS_ROWS = [
    (400, "BadDeviceToken", Outcome.TOKEN_INVALID),
    (400, "DeviceTokenNotForTopic", Outcome.TOKEN_INVALID),
    (400, "TopicDisallowed", Outcome.PERMANENT),
    (400, "BadCollapseId", Outcome.PERMANENT),
    (400, "BadExpirationDate", Outcome.PERMANENT),
    (400, "BadMessageId", Outcome.PERMANENT),
    (400, "BadPriority", Outcome.PERMANENT),
    (400, "BadTopic", Outcome.PERMANENT),
    (400, "DuplicateHeaders", Outcome.PERMANENT),
    (400, "InvalidPushType", Outcome.PERMANENT),
    (400, "MissingDeviceToken", Outcome.PERMANENT),
    (400, "MissingTopic", Outcome.PERMANENT),
    (400, "PayloadEmpty", Outcome.PERMANENT),
    (400, "IdleTimeout", Outcome.TRANSIENT),
    (403, "ExpiredProviderToken", Outcome.AUTH),
    (403, "InvalidProviderToken", Outcome.AUTH),
    (403, "MissingProviderToken", Outcome.AUTH),
    (403, "BadCertificate", Outcome.PERMANENT),
    (403, "BadCertificateEnvironment", Outcome.PERMANENT),
    (403, "Forbidden", Outcome.PERMANENT),
    (404, "BadPath", Outcome.PERMANENT),
    (405, "MethodNotAllowed", Outcome.PERMANENT),
    (410, "Unregistered", Outcome.TOKEN_INVALID),
    (410, "ExpiredToken", Outcome.TOKEN_INVALID),
    (413, "PayloadTooLarge", Outcome.PERMANENT),
    (429, "TooManyRequests", Outcome.THROTTLED),
    (429, "TooManyProviderTokenUpdates", Outcome.THROTTLED),
    (500, "InternalServerError", Outcome.TRANSIENT),
    (503, "ServiceUnavailable", Outcome.TRANSIENT),
    (503, "Shutdown", Outcome.TRANSIENT),
]


def test_apns_ok() -> None:
    attempt = classify_apns(200, apns_id="A")
    assert attempt.outcome is Outcome.OK
    assert attempt.status == 200
    assert attempt.provider_id == "A"


@pytest.mark.parametrize(("status", "reason", "outcome"), APNS_ROWS)
def test_apns_table_row(status: int, reason: str, outcome: Outcome) -> None:
    attempt = classify_apns(status, reason)
    assert attempt.outcome is outcome
    assert attempt.status == status
    assert attempt.reason == reason
    assert attempt.credential_wide is (reason == "TooManyProviderTokenUpdates")


def test_apns_410_keeps_timestamp() -> None:
    attempt = classify_apns(410, "Unregistered", timestamp=1_700_000_000_123)
    assert attempt.outcome is Outcome.TOKEN_INVALID
    assert attempt.token_timestamp == 1_700_000_000_123


def test_apns_timestamp_only_kept_for_token_invalid() -> None:
    assert classify_apns(500, "InternalServerError", timestamp=5).token_timestamp is None


def test_apns_too_many_requests_is_per_token() -> None:
    attempt = classify_apns(429, "TooManyRequests", retry_after=3.0)
    assert attempt.outcome is Outcome.THROTTLED
    assert not attempt.credential_wide
    assert attempt.retry_after == 3.0


def test_apns_retry_after_passed_through() -> None:
    assert classify_apns(503, "ServiceUnavailable", retry_after=7.0).retry_after == 7.0


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (400, Outcome.PERMANENT),
        (403, Outcome.PERMANENT),
        (410, Outcome.TOKEN_INVALID),
        (429, Outcome.THROTTLED),
        (500, Outcome.TRANSIENT),
        (502, Outcome.TRANSIENT),
    ],
)
def test_apns_unknown_reason_falls_back_to_status(status: int, outcome: Outcome) -> None:
    assert classify_apns(status, "SomethingNew").outcome is outcome


@pytest.mark.parametrize("status", [400, 403, 410, 500])
def test_apns_error_without_reason_is_transient(status: int) -> None:
    attempt = classify_apns(status, None)
    assert attempt.outcome is Outcome.TRANSIENT
    assert attempt.detail and "without a reason" in attempt.detail


# --- FCM -------------------------------------------------------------------------------


def fcm_body(
    status: str | None,
    code: str | None = None,
    message: str = "error",
    extra: list[dict[str, Any]] | None = None,
    http: int = 400,
) -> bytes:
    details: list[dict[str, Any]] = []
    if code is not None:
        details.append({"@type": FCM_ERROR_TYPE, "errorCode": code})
    details.extend(extra or [])
    error: dict[str, Any] = {"code": http, "message": message}
    if status is not None:
        error["status"] = status
    if details:
        error["details"] = details
    return json.dumps({"error": error}).encode()


def token_violation(field: str = "message.token") -> dict[str, Any]:
    return {"@type": BAD_REQUEST_TYPE, "fieldViolations": [{"field": field, "description": "x"}]}


def test_fcm_ok_keeps_message_name() -> None:
    attempt = classify_fcm(200, b'{"name": "projects/p/messages/1"}')
    assert attempt.outcome is Outcome.OK
    assert attempt.provider_id == "projects/p/messages/1"


FCM_ROWS = [
    # 400 INVALID_ARGUMENT with a message.token violation → token_invalid
    (
        400,
        fcm_body("INVALID_ARGUMENT", "INVALID_ARGUMENT", "bad token", [token_violation()]),
        Outcome.TOKEN_INVALID,
        "INVALID_ARGUMENT",
    ),
    # ... with a violation on another field → permanent
    (
        400,
        fcm_body(
            "INVALID_ARGUMENT",
            "INVALID_ARGUMENT",
            "The registration token field is fine; ttl is not",
            [token_violation("message.android.ttl")],
        ),
        Outcome.PERMANENT,
        "INVALID_ARGUMENT",
    ),
    # ... without details, the message names the registration token → token_invalid
    (
        400,
        fcm_body(
            "INVALID_ARGUMENT",
            None,
            "The registration token is not a valid FCM registration token",
        ),
        Outcome.TOKEN_INVALID,
        "INVALID_ARGUMENT",
    ),
    # ... FcmError only, message about the token → token_invalid
    (
        400,
        fcm_body(
            "INVALID_ARGUMENT",
            "INVALID_ARGUMENT",
            "The registration token is not a valid FCM registration token",
        ),
        Outcome.TOKEN_INVALID,
        "INVALID_ARGUMENT",
    ),
    # ... without details, another message → permanent
    (
        400,
        fcm_body("INVALID_ARGUMENT", "INVALID_ARGUMENT", "Invalid data payload key: from"),
        Outcome.PERMANENT,
        "INVALID_ARGUMENT",
    ),
    (
        401,
        fcm_body("UNAUTHENTICATED", "THIRD_PARTY_AUTH_ERROR", http=401),
        Outcome.PERMANENT,
        "THIRD_PARTY_AUTH_ERROR",
    ),
    (401, fcm_body("UNAUTHENTICATED", None, http=401), Outcome.AUTH, "UNAUTHENTICATED"),
    (
        403,
        fcm_body("PERMISSION_DENIED", "SENDER_ID_MISMATCH", http=403),
        Outcome.TOKEN_INVALID,
        "SENDER_ID_MISMATCH",
    ),
    (403, fcm_body("PERMISSION_DENIED", None, http=403), Outcome.PERMANENT, "PERMISSION_DENIED"),
    (404, fcm_body("NOT_FOUND", "UNREGISTERED", http=404), Outcome.TOKEN_INVALID, "UNREGISTERED"),
    (
        429,
        fcm_body("RESOURCE_EXHAUSTED", "QUOTA_EXCEEDED", http=429),
        Outcome.THROTTLED,
        "QUOTA_EXCEEDED",
    ),
    (500, fcm_body("INTERNAL", "INTERNAL", http=500), Outcome.TRANSIENT, "INTERNAL"),
    (503, fcm_body("UNAVAILABLE", "UNAVAILABLE", http=503), Outcome.TRANSIENT, "UNAVAILABLE"),
]


@pytest.mark.parametrize(("status", "body", "outcome", "reason"), FCM_ROWS)
def test_fcm_table_row(status: int, body: bytes, outcome: Outcome, reason: str) -> None:
    attempt = classify_fcm(status, body)
    assert attempt.outcome is outcome
    assert attempt.reason == reason
    assert attempt.status == status
    assert attempt.credential_wide is (status == 429)


def test_fcm_error_code_wins_over_status() -> None:
    # canonical NOT_FOUND alone is not a token verdict; the FcmError code is
    assert classify_fcm(404, fcm_body("NOT_FOUND", http=404)).outcome is Outcome.PERMANENT
    body = fcm_body("NOT_FOUND", "UNREGISTERED", http=404)
    assert classify_fcm(404, body).outcome is Outcome.TOKEN_INVALID


def test_fcm_status_string_used_without_code() -> None:
    attempt = classify_fcm(503, fcm_body("UNAVAILABLE", None, http=503))
    assert attempt.outcome is Outcome.TRANSIENT
    assert attempt.reason == "UNAVAILABLE"


def test_fcm_quota_retry_after() -> None:
    body = fcm_body("RESOURCE_EXHAUSTED", "QUOTA_EXCEEDED", http=429)
    assert classify_fcm(429, body, retry_after=30.0).retry_after == 30.0
    assert classify_fcm(429, body).retry_after is None  # the dispatcher applies its backoff


def test_fcm_unavailable_retry_after() -> None:
    body = fcm_body("UNAVAILABLE", "UNAVAILABLE", http=503)
    assert classify_fcm(503, body, retry_after=1.0).retry_after == 1.0


@pytest.mark.parametrize(
    ("status", "outcome", "wide"),
    [
        (400, Outcome.PERMANENT, False),
        (401, Outcome.AUTH, False),
        (403, Outcome.PERMANENT, False),
        (404, Outcome.PERMANENT, False),
        (429, Outcome.THROTTLED, True),
        (500, Outcome.TRANSIENT, False),
        (502, Outcome.TRANSIENT, False),
        (503, Outcome.TRANSIENT, False),
    ],
)
def test_fcm_http_code_fallback(status: int, outcome: Outcome, wide: bool) -> None:
    for body in (b"", b"<html>bad gateway</html>", b'{"unexpected": 1}'):
        attempt = classify_fcm(status, body)
        assert attempt.outcome is outcome
        assert attempt.credential_wide is wide
        assert attempt.reason is None


def test_fcm_detail_scrubs_token() -> None:
    token = "fcm-token-abc123"
    body = fcm_body("INVALID_ARGUMENT", None, f"token {token} is bad, not a registration token")
    attempt = classify_fcm(400, body, token=token)
    assert attempt.detail is not None
    assert token not in attempt.detail


@pytest.mark.parametrize(
    "message",
    [
        # FCM's wording when a payload value is refused: it quotes the value
        'Invalid value at \'message.data[0].value\' (TYPE_STRING), "meet me at 9 \\"sharp\\""',
        "Invalid JSON payload received. Unknown name \"meet me at 9\" at 'message.data'",
        "Invalid value at 'message.android.ttl', \"meet me at 9",  # cut off mid-quote
    ],
)
def test_fcm_detail_leaves_out_quoted_payload_values(message: str) -> None:
    """`detail` is documented safe for logs; FCM's messages quote the refused value, which
    may be notification content. The field path (single quotes) stays: it says what is
    wrong."""
    attempt = classify_fcm(400, fcm_body("INVALID_ARGUMENT", None, message))
    assert attempt.detail is not None
    assert "meet me" not in attempt.detail
    assert "'message." in attempt.detail


def test_parse_fcm_error_tolerates_garbage() -> None:
    assert parse_fcm_error(b"not json") == (None, None, "", [])
    assert parse_fcm_error({"error": {"details": "nope"}}) == (None, None, "", [])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("5", 5.0),
        (b"10", 10.0),
        ("1.5", 1.5),
        ("-3", 0.0),
        ("nan", None),
        ("garbage", None),
        ("Wed, 21 Oct 2015 07:28:00 GMT", 10.0),
        # ignored, never an exception: digits float() refuses or that are not ASCII
        ("\u00b2", None),  # superscript two: str.isdigit() is True
        (b"\xb2", None),
        ("\u0661\u0662", None),  # Arabic-Indic digits: float() reads them
        ("inf", None),
        ("9" * 400, None),  # overflows to inf
        ("Mon, 01 Jan 99999 00:00:00 GMT", None),
    ],
)
def test_parse_retry_after(value: str | bytes | None, expected: float | None) -> None:
    now = 1445412470.0  # 10 s before the date above
    assert parse_retry_after(value, now=now) == expected


@pytest.mark.parametrize(
    "value",
    [
        "Wed, 21 Oct 2015 07:28:00 GMT",  # IMF-fixdate
        "Wednesday, 21-Oct-15 07:28:00 GMT",  # obsolete RFC 850 form
        "Wed Oct 21 07:28:00 2015",  # obsolete asctime form: no zone, and still GMT
    ],
)
def test_parse_retry_after_dates_are_gmt_whatever_the_local_zone(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """RFC 9110 section 5.6.7: every HTTP-date is GMT and a recipient MUST accept all
    three forms. The asctime form carries no zone; read as local time, it made a 10 s
    Retry-After 0 east of Greenwich and hours long west of it."""
    import time

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        assert parse_retry_after(value, now=1445412470.0) == 10.0
    finally:
        monkeypatch.undo()
        time.tzset()

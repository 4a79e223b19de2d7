"""Provider answer → `Attempt`: the classification tables of specs/providers.md §2.2 and §3.2.

Pure functions, no I/O, so every table row can be tested on its own. Details are
safe for logs: they never contain a device token or payload content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from gateway.core.push import Attempt, Outcome, Reason

# --- APNs (§2.2) ---------------------------------------------------------------------

APNS_TOKEN_INVALID = frozenset(
    {"BadDeviceToken", "DeviceTokenNotForTopic", "Unregistered", "ExpiredToken"}
)
# Token-invalid answers about one device that the provider knows (its app uninstalled, its
# token replaced): a wrong APNs environment answers `BadDeviceToken` and a wrong Firebase
# project `SENDER_ID_MISMATCH` instead, so these never trip the mass-invalidation guard's
# start rule (`InvalidationGuard`): a healthy app meets them at every restart.
DEAD_DEVICE_REASONS = frozenset({"Unregistered", "ExpiredToken", "UNREGISTERED"})
# `UnrelatedKeyIdInToken`: the token's key is not the one this connection was bound to by
# its first push; Apple's remedy is a new connection (the client opens one, see
# `APNS_RECONNECT`), so one retry there, as for a stale JWT.
APNS_AUTH = frozenset(
    {
        "ExpiredProviderToken",
        "InvalidProviderToken",
        "MissingProviderToken",
        "UnrelatedKeyIdInToken",
    }
)
APNS_PERMANENT = frozenset(
    {
        "TopicDisallowed",
        "BadCollapseId",
        "BadExpirationDate",
        "BadMessageId",
        "BadPriority",
        "BadTopic",
        "DuplicateHeaders",
        "InvalidPushType",
        "MissingDeviceToken",
        "MissingTopic",
        "PayloadEmpty",
        "BadCertificate",
        "BadCertificateEnvironment",
        "Forbidden",
        # A key restricted to the other environment (sandbox vs production): the
        # operator's to fix. Apple documents the first name; APNs has sent the second.
        "BadEnvironmentKeyIdInToken",
        "BadEnvironmentKeyInToken",
        "BadPath",
        "MethodNotAllowed",
        "PayloadTooLarge",
    }
)
# Permanent answers that say an app's configuration is wrong (its topic, its certificate or
# key and their environment, the service account's permissions, the project, the APNs key
# stored in Firebase): not one push's content or token, so they repeat for every push of
# the app (or of one of its topics) until the operator fixes it. The dispatcher logs when
# they start and when they end (`Dispatcher._config_state`).
CONFIG_REASONS = frozenset(
    {
        "BadTopic",
        "TopicDisallowed",
        "MissingTopic",
        "BadCertificate",
        "BadCertificateEnvironment",
        "Forbidden",
        "BadEnvironmentKeyIdInToken",
        "BadEnvironmentKeyInToken",
        "THIRD_PARTY_AUTH_ERROR",
        "APNS_AUTH_ERROR",
        "PERMISSION_DENIED",
        "NOT_FOUND",  # without an FCM errorCode: a wrong project (UNREGISTERED has its code)
        Reason.CERTIFICATE_EXPIRED,  # not sent by APNs: `ApnsClient.send` ends such pushes
        Reason.CERTIFICATE_REFUSED,  # a TLS certificate alert from APNs (`ApnsClient.send`)
    }
)
# What the operator checks, in the dispatcher's line, for the configuration reasons that
# do not say it themselves.
CONFIG_HINTS: dict[str, str] = {
    Reason.CERTIFICATE_REFUSED: (
        "check the app's certfile: APNs refuses the certificate at the TLS handshake "
        "(revoked, not an APNs push certificate issued by Apple, or another app's)"
    ),
    Reason.CERTIFICATE_EXPIRED: "renew the app's APNs certificate and replace its certfile",
}
# What an operator checks when the provider refuses an app's credential even after the
# one refresh (the dispatcher's log line). APNs rejects a provider token whose `iat` is
# more than an hour old or in the future: a host clock off by that much looks like a
# revoked key, so the clock is named where it can be the cause.
CREDENTIAL_HINTS: dict[str, str] = {
    "ExpiredProviderToken": "check this host's clock (NTP): APNs takes it as over an hour off",
    "InvalidProviderToken": (
        "check the app's key_id and team_id, that the key is not revoked in the Apple "
        "developer account, and this host's clock"
    ),
    "MissingProviderToken": "check the app's keyfile, key_id and team_id",
    "oauth_token_error": (
        "check that the service account and its key still exist and are enabled, and this "
        "host's clock"
    ),
}
CREDENTIAL_HINT = "check the app's credential and this host's clock"
APNS_TRANSIENT = frozenset({"IdleTimeout", "InternalServerError", "ServiceUnavailable", "Shutdown"})
# Answers after which the connection that carried them takes no new request: APNs is
# shutting it down (`Shutdown`), timed it out (`IdleTimeout`), or bound it to another key
# (`UnrelatedKeyIdInToken`). A retry on it would meet the same answer.
APNS_RECONNECT = frozenset({"IdleTimeout", "Shutdown", "UnrelatedKeyIdInToken"})
APNS_THROTTLED_TOKEN = "TooManyRequests"
APNS_THROTTLED_CREDENTIAL = "TooManyProviderTokenUpdates"


# The longest reason a provider documents is 27 characters (`TooManyProviderTokenUpdates`).
# Anything longer is not a provider's reason but whatever answered in its place (a proxy,
# a broken upstream), as long as its body: receipts, the plugins' hooks and `detail` keep
# it cut to this many characters, "..." included (the dispatcher cuts it; classification
# sees it whole). The store's `pushgw_invalid_tokens.reason` is as long.
REASON_MAX = 64


def bounded_reason(reason: str | None) -> str | None:
    """`reason` cut to `REASON_MAX` characters, ending in "..." when cut."""
    if reason is None or len(reason) <= REASON_MAX:
        return reason
    return reason[: REASON_MAX - 3] + "..."


def _by_status(status: int) -> Outcome:
    if status == 410:
        return Outcome.TOKEN_INVALID
    if status == 429:
        return Outcome.THROTTLED
    if status >= 500 or status < 400:
        return Outcome.TRANSIENT
    return Outcome.PERMANENT


def classify_apns(
    status: int,
    reason: str | None = None,
    *,
    timestamp: int | None = None,
    retry_after: float | None = None,
    apns_id: str | None = None,
) -> Attempt:
    """Classify one APNs answer: `:status`, the body's `reason` and `timestamp`, `Retry-After`.

    The reason decides when it is a known one, the status otherwise. An error status
    without a reason (no or unreadable body: not something APNs sends) is `transient`,
    never `token_invalid`, so a broken intermediary cannot wipe registrations.
    """
    if status == 200:
        return Attempt(Outcome.OK, status=200, provider_id=apns_id)
    if not reason:
        return Attempt(
            Outcome.TRANSIENT,
            status=status,
            retry_after=retry_after,
            provider_id=apns_id,
            detail=f"APNs answered {status} without a reason",
        )
    credential_wide = False
    if reason in APNS_TOKEN_INVALID:
        outcome = Outcome.TOKEN_INVALID
    elif reason in APNS_AUTH:
        outcome = Outcome.AUTH
    elif reason in APNS_PERMANENT:
        outcome = Outcome.PERMANENT
    elif reason in APNS_TRANSIENT:
        outcome = Outcome.TRANSIENT
    elif reason == APNS_THROTTLED_TOKEN:
        outcome = Outcome.THROTTLED
    elif reason == APNS_THROTTLED_CREDENTIAL:
        outcome = Outcome.THROTTLED
        credential_wide = True
    else:
        outcome = _by_status(status)
    return Attempt(
        outcome,
        status=status,
        reason=reason,
        retry_after=retry_after,
        credential_wide=credential_wide,
        token_timestamp=timestamp if outcome is Outcome.TOKEN_INVALID else None,
        provider_id=apns_id,
        detail=None
        if outcome is Outcome.TOKEN_INVALID
        else f"APNs {status} {bounded_reason(reason)}",
    )


# --- FCM (§3.2) ----------------------------------------------------------------------

FCM_ERROR_TYPE = "type.googleapis.com/google.firebase.fcm.v1.FcmError"
BAD_REQUEST_TYPE = "type.googleapis.com/google.rpc.BadRequest"
QUOTA_FAILURE_TYPE = "type.googleapis.com/google.rpc.QuotaFailure"
RETRY_INFO_TYPE = "type.googleapis.com/google.rpc.RetryInfo"

# errorCode (or canonical status) → (outcome, credential_wide). INVALID_ARGUMENT is decided
# by `_invalid_argument`; NOT_FOUND without an FCM code is a wrong URL/project, not a token.
_FCM_CODES: dict[str, tuple[Outcome, bool]] = {
    "UNREGISTERED": (Outcome.TOKEN_INVALID, False),
    "SENDER_ID_MISMATCH": (Outcome.TOKEN_INVALID, False),
    "THIRD_PARTY_AUTH_ERROR": (Outcome.PERMANENT, False),
    "APNS_AUTH_ERROR": (Outcome.PERMANENT, False),  # pre-2020 name of THIRD_PARTY_AUTH_ERROR
    "QUOTA_EXCEEDED": (Outcome.THROTTLED, True),
    "RESOURCE_EXHAUSTED": (Outcome.THROTTLED, True),
    "UNAVAILABLE": (Outcome.TRANSIENT, False),
    "INTERNAL": (Outcome.TRANSIENT, False),
    "DEADLINE_EXCEEDED": (Outcome.TRANSIENT, False),
    "UNAUTHENTICATED": (Outcome.AUTH, False),
    "PERMISSION_DENIED": (Outcome.PERMANENT, False),
    "NOT_FOUND": (Outcome.PERMANENT, False),
}
_DETAIL_MAX = 200
# A double-quoted string in an FCM error message, escapes included, or one cut off at the
# end: FCM quotes the value it refused (`Invalid value at 'message.data[0].value'
# (TYPE_STRING), "..."`), which may be notification content. Field paths are in single
# quotes and stay.
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\\?$)')


def _fcm_http(status: int) -> tuple[Outcome, bool]:
    if status == 401:
        return Outcome.AUTH, False
    if status == 429:
        return Outcome.THROTTLED, True
    if status >= 500 or status < 400:
        return Outcome.TRANSIENT, False
    return Outcome.PERMANENT, False


# FCM's QUOTA_EXCEEDED covers three limits (its ErrorCode reference): the project's message
# rate, one device's message rate and one topic's. Only the first is the whole app's; the
# body tells them apart in its message and its `google.rpc.QuotaFailure` violations.
# Words, camelCase and snake_case split: "device" in "DeviceMessagesPerMinute",
# "device_messages" and "Device message rate exceeded.", never in "developer".
_WORD = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])")
_DEVICE_WORDS = frozenset({"device", "devices"})
_VIOLATION_FIELDS = ("subject", "description", "quotaMetric", "quotaId")
# protobuf JSON Duration, as `google.rpc.RetryInfo.retryDelay` carries it: "30s", "1.5s"
_DURATION = re.compile(r"(\d{1,9}(?:\.\d{1,9})?)s")


def _names_a_device(*texts: object) -> bool:
    return any(
        word.lower() in _DEVICE_WORDS
        for text in texts
        if isinstance(text, str)
        for word in _WORD.findall(text)
    )


def _device_quota(message: str, details: list[Any]) -> bool:
    """True when a 429 says it is one device's message rate that was exceeded (FCM: retry
    that push with backoff), False for the project's rate or when the body does not say
    (the safe reading: close the app's gate).

    With `QuotaFailure` violations, every one of them must name a device (in its
    subject, description, quota metric or quota id: a body that also reports another
    limit is the project's); without any, the error message must.
    """
    violations = [
        violation
        for detail in details
        if detail.get("@type") == QUOTA_FAILURE_TYPE and isinstance(detail.get("violations"), list)
        for violation in detail["violations"]
        if isinstance(violation, Mapping)
    ]
    if violations:
        return all(
            _names_a_device(*(violation.get(key) for key in _VIOLATION_FIELDS))
            for violation in violations
        )
    return _names_a_device(message)


def _retry_info(details: list[Any]) -> float | None:
    """Seconds from a `google.rpc.RetryInfo` detail's `retryDelay`, None without one."""
    for detail in details:
        if detail.get("@type") != RETRY_INFO_TYPE:
            continue
        delay = detail.get("retryDelay")
        if isinstance(delay, str) and (match := _DURATION.fullmatch(delay.strip())):
            return float(match.group(1))
        if isinstance(delay, Mapping):  # the proto's own shape: {"seconds": .., "nanos": ..}
            seconds, nanos = delay.get("seconds", 0), delay.get("nanos", 0)
            try:
                value = float(seconds) + float(nanos) / 1e9
            except (TypeError, ValueError):
                continue
            if 0 <= value < 1e9:
                return value
    return None


def _invalid_argument(message: str, details: list[Any]) -> Outcome:
    """INVALID_ARGUMENT names a dead token only through a `message.token` field violation
    (or, without such a detail, a message about the registration token)."""
    bad_requests = [d for d in details if d.get("@type") == BAD_REQUEST_TYPE]
    if bad_requests:
        for detail in bad_requests:
            for violation in detail.get("fieldViolations") or ():
                if isinstance(violation, Mapping) and violation.get("field") == "message.token":
                    return Outcome.TOKEN_INVALID
        return Outcome.PERMANENT
    if "registration token" in message.lower():
        return Outcome.TOKEN_INVALID
    return Outcome.PERMANENT


def parse_fcm_error(
    body: bytes | str | Mapping[str, Any] | None,
) -> tuple[str | None, str | None, str, list[Any]]:
    """(errorCode, status, message, details) of an FCM error body; blanks when unreadable."""
    data: Any = body
    if isinstance(body, (bytes, str)):
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
    error = data.get("error") if isinstance(data, Mapping) else None
    if not isinstance(error, Mapping):
        return None, None, "", []
    raw_details = error.get("details")
    details = (
        [d for d in raw_details if isinstance(d, Mapping)] if isinstance(raw_details, list) else []
    )
    code = next(
        (
            d.get("errorCode")
            for d in details
            if d.get("@type") == FCM_ERROR_TYPE and isinstance(d.get("errorCode"), str)
        ),
        None,
    )
    status = error.get("status")
    message = error.get("message")
    return (
        code,
        status if isinstance(status, str) else None,
        message if isinstance(message, str) else "",
        details,
    )


def classify_fcm(
    status: int,
    body: bytes | str | Mapping[str, Any] | None = None,
    *,
    retry_after: float | None = None,
    token: str | None = None,
) -> Attempt:
    """Classify one FCM HTTP v1 answer: errorCode first, then the canonical status, then HTTP.

    A 429 closes the app's gate (`credential_wide`) unless its body says it was one
    device's message rate (`_device_quota`). Without a `Retry-After` header
    (`retry_after`), a `google.rpc.RetryInfo` detail gives the delay.
    `token` is only used to scrub it from the provider message kept in `detail`.
    """
    if status == 200:
        name = None
        data: Any = body
        if isinstance(body, (bytes, str)):
            try:
                data = json.loads(body) if body else None
            except ValueError:
                data = None
        if isinstance(data, Mapping) and isinstance(data.get("name"), str):
            name = data["name"]
        return Attempt(Outcome.OK, status=200, provider_id=name)

    code, canonical, message, details = parse_fcm_error(body)
    outcome: Outcome | None = None
    credential_wide = False
    for key in (code, canonical):
        if key is None:
            continue
        if key == "INVALID_ARGUMENT":
            outcome = _invalid_argument(message, details)
            break
        if key in _FCM_CODES:
            outcome, credential_wide = _FCM_CODES[key]
            break
    if outcome is None:
        outcome, credential_wide = _fcm_http(status)
    if credential_wide and _device_quota(message, details):
        credential_wide = False  # one device's rate: this push backs off, the app's gate stays open
    if retry_after is None and outcome in (Outcome.THROTTLED, Outcome.TRANSIENT):
        retry_after = _retry_info(details)  # the header wins; Google's detail otherwise

    reason = code or canonical
    if message:
        if token:
            message = message.replace(token, "<token>")
        message = _QUOTED.sub('"..."', message)
        detail = f"FCM {status}: {message[:_DETAIL_MAX]}"
    else:
        detail = f"FCM {status}" + ("" if reason else " without an error body")
    return Attempt(
        outcome,
        status=status,
        reason=reason,
        retry_after=retry_after,
        credential_wide=credential_wide,
        detail=detail,
    )

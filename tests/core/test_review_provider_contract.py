"""Review of the provider contracts: every answer Apple and Google document, classified as
specs/providers.md says, against the simulators and the real clients; what the clients do
with the connection an answer came on; and the simulators' own fidelity."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from gateway.core.apns import ApnsClient
from gateway.core.classify import classify_apns, classify_fcm
from gateway.core.metrics import reason_label
from gateway.core.push import Outcome
from gateway.testing import ApnsResponse, ApnsSimulator
from gateway.testing.apns_sim import APNS_REASON_STATUS
from tests.core.test_apns_client import (  # noqa: F401  (fixtures)
    TOPIC,
    MakeClient,
    make_client,
    push_for,
    send,
    sim,
    token,
)
from tests.core.test_dispatcher import rig_factory  # noqa: F401  (fixture)

# --- APNs: the table is Apple's whole list -----------------------------------------------

# Every reason Apple documents ("Handling notification responses from APNs"), with its
# status and the class specs/providers.md §2.2 gives it; the two key-scoping reasons came
# with team-scoped and environment-scoped keys (2025) and are not in the spec's table yet.
APPLE_REASONS: dict[str, tuple[int, Outcome]] = {
    "BadCollapseId": (400, Outcome.PERMANENT),
    "BadDeviceToken": (400, Outcome.TOKEN_INVALID),
    "BadExpirationDate": (400, Outcome.PERMANENT),
    "BadMessageId": (400, Outcome.PERMANENT),
    "BadPriority": (400, Outcome.PERMANENT),
    "BadTopic": (400, Outcome.PERMANENT),
    "DeviceTokenNotForTopic": (400, Outcome.TOKEN_INVALID),
    "DuplicateHeaders": (400, Outcome.PERMANENT),
    "IdleTimeout": (400, Outcome.TRANSIENT),
    "InvalidPushType": (400, Outcome.PERMANENT),
    "MissingDeviceToken": (400, Outcome.PERMANENT),
    "MissingTopic": (400, Outcome.PERMANENT),
    "PayloadEmpty": (400, Outcome.PERMANENT),
    "TopicDisallowed": (400, Outcome.PERMANENT),
    "BadCertificate": (403, Outcome.PERMANENT),
    "BadCertificateEnvironment": (403, Outcome.PERMANENT),
    "ExpiredProviderToken": (403, Outcome.AUTH),
    "Forbidden": (403, Outcome.PERMANENT),
    "InvalidProviderToken": (403, Outcome.AUTH),
    "MissingProviderToken": (403, Outcome.AUTH),
    # The token's key is not the one the connection was bound to: a new connection.
    "UnrelatedKeyIdInToken": (403, Outcome.AUTH),
    # A key restricted to the other environment: the operator's to fix.
    "BadEnvironmentKeyIdInToken": (403, Outcome.PERMANENT),
    "BadPath": (404, Outcome.PERMANENT),
    "MethodNotAllowed": (405, Outcome.PERMANENT),
    "ExpiredToken": (410, Outcome.TOKEN_INVALID),
    "Unregistered": (410, Outcome.TOKEN_INVALID),
    "PayloadTooLarge": (413, Outcome.PERMANENT),
    "TooManyProviderTokenUpdates": (429, Outcome.THROTTLED),
    "TooManyRequests": (429, Outcome.THROTTLED),
    "InternalServerError": (500, Outcome.TRANSIENT),
    "ServiceUnavailable": (503, Outcome.TRANSIENT),
    "Shutdown": (503, Outcome.TRANSIENT),
}


@pytest.mark.parametrize("reason", sorted(APPLE_REASONS))
def test_every_apple_reason_has_its_class_and_its_own_metric_label(reason: str) -> None:
    """A documented reason counted as `other` hides from the operator exactly the answers
    (a key for the wrong environment) that need them; and `UnrelatedKeyIdInToken` ended
    pushes `permanent` that Apple says go through on a new connection."""
    status, outcome = APPLE_REASONS[reason]
    attempt = classify_apns(status, reason)
    assert attempt.outcome is outcome
    assert reason_label(reason) == reason
    assert APNS_REASON_STATUS[reason] == status  # the simulator can answer it


def test_the_undocumented_spelling_seen_from_apns_is_permanent_with_its_label() -> None:
    attempt = classify_apns(403, "BadEnvironmentKeyInToken")
    assert attempt.outcome is Outcome.PERMANENT
    assert reason_label("BadEnvironmentKeyInToken") == "BadEnvironmentKeyInToken"


@pytest.mark.parametrize("reason", ["BadEnvironmentKeyIdInToken", "UnrelatedKeyIdInToken"])
async def test_key_scoping_answers_never_end_a_token(
    rig_factory: Callable[..., Any],  # noqa: F811
    reason: str,
) -> None:
    rig = await rig_factory(apps={"ios": {}})
    tok = token()
    rig.apns.script(tok, ApnsResponse.error(reason))
    receipt = await rig.dispatcher.send(rig.push("ios", tok))
    assert receipt.outcome in (Outcome.AUTH, Outcome.PERMANENT)
    assert receipt.reason == reason
    assert rig.invalid == []


# --- APNs: answers that need a new connection ---------------------------------------------


def connections_used(simulator: ApnsSimulator, tok: str) -> list[int]:
    return [request.connection_id for request in simulator.requests_for(tok)]


@pytest.mark.parametrize("reason", ["Shutdown", "IdleTimeout", "UnrelatedKeyIdInToken"])
async def test_the_retry_after_a_reconnect_answer_goes_to_a_new_connection(
    rig_factory: Callable[..., Any],  # noqa: F811
    reason: str,
) -> None:
    """Apple: `Shutdown` (its server is going away), `IdleTimeout` and
    `UnrelatedKeyIdInToken` (open a new connection). The retry went to the same
    connection, which gives the same answer again."""
    rig = await rig_factory(apps={"ios": {"max_connections": 1}})
    tok = token()
    rig.apns.script(tok, ApnsResponse.error(reason), ApnsResponse.ok())
    receipt = await rig.dispatcher.send(rig.push("ios", tok))
    assert (receipt.outcome, receipt.attempts) == (Outcome.OK, 2)
    first, second = connections_used(rig.apns, tok)
    assert first != second
    assert rig.apns.connections_opened == 2


async def test_a_retired_connection_still_answers_the_requests_it_carries(
    sim: ApnsSimulator,  # noqa: F811
    make_client: MakeClient,  # noqa: F811
    secrets_seen: set[str],
) -> None:
    """Retiring is graceful: the other streams on the connection get their own answers
    (closing at once would fail them, and their retries could deliver twice)."""
    client: ApnsClient = await make_client(max_connections=1, request_timeout=10.0)
    assert (await send(client, push_for(token()), secrets_seen)).outcome is Outcome.OK
    slow, shut = token(), token()
    sim.script(slow, ApnsResponse.ok(delay=1.0))
    sim.script(shut, ApnsResponse.error("Shutdown"))
    slow_send = asyncio.create_task(send(client, push_for(slow), secrets_seen))
    await sim.wait_for_requests(2)  # the slow one is at the simulator
    shut_attempt = await send(client, push_for(shut), secrets_seen)
    assert (shut_attempt.outcome, shut_attempt.reason) == (Outcome.TRANSIENT, "Shutdown")
    assert (await slow_send).outcome is Outcome.OK
    assert connections_used(sim, slow) == connections_used(sim, shut)
    after = token()
    assert (await send(client, push_for(after), secrets_seen)).outcome is Outcome.OK
    assert connections_used(sim, after) != connections_used(sim, shut)


async def test_other_answers_keep_the_connection(
    sim: ApnsSimulator,  # noqa: F811
    make_client: MakeClient,  # noqa: F811
    secrets_seen: set[str],
) -> None:
    client = await make_client(max_connections=1)
    for reason in ("Unregistered", "TooManyRequests", "InternalServerError", "BadTopic"):
        tok = token()
        sim.script(tok, ApnsResponse.error(reason))
        assert (await send(client, push_for(tok), secrets_seen)).reason == reason
    assert sim.connections_opened == 1


# --- APNs simulator: the topics Apple requires per push type ------------------------------


@pytest.mark.parametrize(
    ("push_type", "suffix"),
    [
        ("voip", ".voip"),
        ("complication", ".complication"),
        ("liveactivity", ".push-type.liveactivity"),
        ("pushtotalk", ".voip-ptt"),
        ("location", ".location-query"),
        ("fileprovider", ".pushkit.fileprovider"),
        ("widgets", ".push-type.widgets"),
    ],
)
async def test_simulator_accepts_the_topic_apple_requires_for_each_push_type(
    make_client: MakeClient,  # noqa: F811
    secrets_seen: set[str],
    sim: ApnsSimulator,  # noqa: F811
    push_type: str,
    suffix: str,
) -> None:
    """With `topics` set, a correctly addressed push-to-talk or location push was
    refused `TopicDisallowed`, as if the app were misconfigured."""
    sim.topics = frozenset({TOPIC})
    client = await make_client()
    push = push_for(token(), {"aps": {}}, push_type=push_type, topic=TOPIC + suffix)
    attempt = await send(client, push, secrets_seen)
    assert attempt.outcome is Outcome.OK, attempt.reason
    assert (await send(client, push_for(token(), topic="com.other.app"), secrets_seen)).reason == (
        "TopicDisallowed"
    )


# --- FCM: answers as Google sends them ----------------------------------------------------


def google_error(status: int, canonical: str, message: str, *details: dict[str, Any]) -> bytes:
    return json.dumps(
        {"error": {"code": status, "message": message, "status": canonical, "details": details}}
    ).encode()


FCM_ERROR = "type.googleapis.com/google.firebase.fcm.v1.FcmError"


def test_fcm_invalid_token_without_a_bad_request_detail_ends_the_token() -> None:
    body = google_error(
        400,
        "INVALID_ARGUMENT",
        "The registration token is not a valid FCM registration token",
        {"@type": FCM_ERROR, "errorCode": "INVALID_ARGUMENT"},
    )
    assert classify_fcm(400, body).outcome is Outcome.TOKEN_INVALID


def test_fcm_invalid_payload_never_ends_the_token() -> None:
    violation = {"field": "message.android.ttl", "description": "Invalid value"}
    body = google_error(
        400,
        "INVALID_ARGUMENT",
        "Invalid value at 'message.android.ttl' (type.googleapis.com/google.protobuf.Duration)",
        {"@type": FCM_ERROR, "errorCode": "INVALID_ARGUMENT"},
        {"@type": "type.googleapis.com/google.rpc.BadRequest", "fieldViolations": [violation]},
    )
    assert classify_fcm(400, body).outcome is Outcome.PERMANENT


def test_fcm_project_quota_without_an_fcm_error_closes_the_gate() -> None:
    """What Google sends for the per-project quota: RESOURCE_EXHAUSTED with an ErrorInfo,
    no FcmError detail."""
    info = {
        "@type": "type.googleapis.com/google.rpc.ErrorInfo",
        "reason": "RATE_LIMIT_EXCEEDED",
        "domain": "googleapis.com",
    }
    body = google_error(429, "RESOURCE_EXHAUSTED", "Quota exceeded for quota metric", info)
    attempt = classify_fcm(429, body, retry_after=30.0)
    assert (attempt.outcome, attempt.credential_wide, attempt.retry_after) == (
        Outcome.THROTTLED,
        True,
        30.0,
    )


def test_fcm_expired_oauth_token_is_auth() -> None:
    info = {
        "@type": "type.googleapis.com/google.rpc.ErrorInfo",
        "reason": "ACCESS_TOKEN_EXPIRED",
        "domain": "googleapis.com",
    }
    body = google_error(401, "UNAUTHENTICATED", "Request had invalid authentication", info)
    assert classify_fcm(401, body).outcome is Outcome.AUTH


def test_fcm_third_party_auth_error_is_permanent_not_a_refresh() -> None:
    body = google_error(
        401,
        "UNAUTHENTICATED",
        "Auth error from APNS or Web Push Service",
        {"@type": FCM_ERROR, "errorCode": "THIRD_PARTY_AUTH_ERROR"},
    )
    assert classify_fcm(401, body).outcome is Outcome.PERMANENT

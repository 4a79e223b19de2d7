"""FCM quotas in a multi-tenant gateway: one device's message-rate limit must not close the
whole app's gate (specs/providers.md §3.2, docs/delivery.md).

FCM answers 429 QUOTA_EXCEEDED for three limits (its ErrorCode reference): the project's
message rate, one device's, one topic's. The project's closes the app's gate for everyone;
a device's is retried with backoff for that push alone. The dispatcher tests run against
the FCM simulator over HTTPS.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from gateway.config import DeliveryConfig, FcmAppConfig
from gateway.context import TokenHasher
from gateway.core.classify import classify_fcm
from gateway.core.dispatcher import Dispatcher, Lane
from gateway.core.fcm import FcmClient
from gateway.core.metrics import Metrics
from gateway.core.push import InvalidToken, Outcome, Push, PushPolicy, Reason, Receipt
from gateway.core.tokens import TokenInvalidation
from gateway.testing.fcm_sim import FcmResponse, FcmSimulator
from gateway.testing.harness import fcm_app_config

# A back-off gate of a minute, as in production; the other delays short.
DELIVERY = {"backoff_base": 0.02, "backoff_cap": 0.1, "throttle_backoff": 60.0}
NOISY = "noisy-phone:APA91b" + "N" * 140
QUIET = "quiet-phone:APA91b" + "Q" * 140
QUOTA_FAILURE = "type.googleapis.com/google.rpc.QuotaFailure"
RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"
FCM_ERROR = "type.googleapis.com/google.firebase.fcm.v1.FcmError"


@dataclass
class Rig:
    """An FCM app `p/android` behind a dispatcher, against the FCM simulator over HTTPS."""

    fcm: FcmSimulator
    dispatcher: Dispatcher
    metrics: Metrics

    def push(self, tok: str, payload: Mapping[str, Any] | None = None, **policy: Any) -> Push:
        message = {"data": {"k": "v"}} if payload is None else payload
        return Push("p", "android", tok, message, policy=PushPolicy(**policy))

    @property
    def lane(self) -> Lane:
        return self.dispatcher._lanes[("p", "android")]

    def gate_until(self) -> float:
        return self.lane.gate_until


@asynccontextmanager
async def fcm_rig(tmp_path: Path, **app: Any) -> AsyncIterator[Rig]:
    """The rig, started; `app` overrides the FCM app's configuration."""
    fcm = FcmSimulator(tls=True)
    await fcm.start()
    metrics = Metrics()

    async def notify(_invalid: InvalidToken) -> None:
        raise AssertionError("no token is invalid here")

    async def sink(_push: Push, _receipt: Receipt) -> None:
        return None

    dispatcher = Dispatcher(
        DeliveryConfig(**DELIVERY),
        metrics,
        TokenInvalidation(None, metrics, notify),
        TokenHasher(b"k"),
        sink,
    )
    config = FcmAppConfig(**fcm_app_config(fcm, tmp_path, ca_file=str(fcm.ca_path), **app))
    dispatcher.add_app("p", "android", FcmClient("android", config))
    await dispatcher.start()
    try:
        yield Rig(fcm, dispatcher, metrics)
    finally:
        await dispatcher.close()
        await fcm.stop()


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with fcm_rig(tmp_path, project_id="shared-project") as started:
        yield started


def no_token_leaked(rig: Rig, caplog: pytest.LogCaptureFixture, *receipts: Receipt) -> None:
    metrics_text = generate_latest(rig.metrics.registry).decode()
    logged = caplog.text + "".join(str(r.args) for r in caplog.records)
    for tok in (NOISY, QUIET):
        assert tok not in metrics_text
        assert tok not in logged
        for receipt in receipts:
            assert tok not in repr(receipt)
            assert tok not in (receipt.detail or "")


# --- through the dispatcher, over HTTPS -------------------------------------------------


async def test_a_device_rate_limit_retries_that_push_and_leaves_the_gate_open(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    rig.fcm.script(NOISY, FcmResponse.quota_exceeded(scope="device"), FcmResponse.ok())
    noisy = await rig.dispatcher.send(rig.push(NOISY, deadline=5.0))
    # retried with the ordinary backoff: a minute's gate would not fit the 5 s deadline
    assert (noisy.outcome, noisy.status, noisy.attempts) == (Outcome.OK, 200, 2)
    assert [r.status for r in rig.fcm.requests_for(NOISY)] == [429, 200]
    assert rig.gate_until() == 0.0

    # another tenant's push goes straight out, with a deadline far shorter than the gate
    quiet = await rig.dispatcher.send(rig.push(QUIET, deadline=0.5))
    assert (quiet.outcome, quiet.reason, quiet.attempts) == (Outcome.OK, None, 1)
    assert len(rig.fcm.requests_for(QUIET)) == 1
    no_token_leaked(rig, caplog, noisy, quiet)


async def test_a_device_rate_limit_out_of_retries_ends_throttled_and_the_gate_stays_open(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    rig.fcm.script(NOISY, FcmResponse.quota_exceeded(scope="device"))
    noisy = await rig.dispatcher.send(rig.push(NOISY, deadline=5.0, max_retries=0))
    assert (noisy.outcome, noisy.reason, noisy.attempts) == (
        Outcome.THROTTLED,
        "QUOTA_EXCEEDED",
        1,
    )
    assert rig.gate_until() == 0.0
    quiet = await rig.dispatcher.send(rig.push(QUIET, deadline=0.5))
    assert (quiet.outcome, quiet.attempts) == (Outcome.OK, 1)
    no_token_leaked(rig, caplog, noisy, quiet)


async def test_a_device_rate_limit_honours_the_retry_info_for_that_push_only(rig: Rig) -> None:
    rig.fcm.script(
        NOISY, FcmResponse.quota_exceeded(scope="device", retry_delay="1s"), FcmResponse.ok()
    )
    noisy = await rig.dispatcher.send(rig.push(NOISY, deadline=5.0))
    assert (noisy.outcome, noisy.attempts) == (Outcome.OK, 2)
    first, second = rig.fcm.requests_for(NOISY)
    assert second.at - first.at >= 1.0  # FCM asked for a second; the backoff alone is 0.1 s
    assert rig.gate_until() == 0.0


@pytest.mark.parametrize("scope", ["project", "topic", None])
async def test_a_project_wide_or_unspecified_quota_still_closes_the_gate(
    rig: Rig, scope: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    rig.fcm.script(NOISY, FcmResponse.quota_exceeded(scope=scope))
    before = time.monotonic()
    noisy = await rig.dispatcher.send(rig.push(NOISY, deadline=1.0))
    # a minute's back-off does not fit the 1 s deadline: one attempt, and the gate shut
    assert (noisy.outcome, noisy.reason, noisy.attempts) == (
        Outcome.THROTTLED,
        "QUOTA_EXCEEDED",
        1,
    )
    assert rig.gate_until() >= before + DELIVERY["throttle_backoff"]
    quiet = await rig.dispatcher.send(rig.push(QUIET, deadline=0.5))
    assert (quiet.outcome, quiet.reason, quiet.attempts) == (
        Outcome.THROTTLED,
        Reason.GATE_CLOSED,
        0,
    )
    assert rig.fcm.requests_for(QUIET) == []
    no_token_leaked(rig, caplog, noisy, quiet)


async def test_a_project_quota_retry_info_sets_the_gate_without_retry_after(rig: Rig) -> None:
    """Google's `RetryInfo` detail says when the project may send again; without it (and
    without `Retry-After`) the gate stays shut `throttle_backoff` (here a minute)."""
    rig.fcm.script(
        NOISY, FcmResponse.quota_exceeded(scope="project", retry_delay="1s"), FcmResponse.ok()
    )
    noisy = await rig.dispatcher.send(rig.push(NOISY, deadline=5.0))
    assert (noisy.outcome, noisy.attempts) == (Outcome.OK, 2)
    first, second = rig.fcm.requests_for(NOISY)
    assert second.at - first.at >= 1.0
    # the gate was closed (for the second asked), not left open
    assert 0.0 < rig.gate_until() <= second.at


# --- the classification, on bodies shaped as Google sends them ---------------------------


def quota_body(message: str, *details: dict[str, Any], fcm_error: bool = True) -> bytes:
    all_details = ([{"@type": FCM_ERROR, "errorCode": "QUOTA_EXCEEDED"}] if fcm_error else []) + [
        *details
    ]
    return json.dumps(
        {
            "error": {
                "code": 429,
                "message": message,
                "status": "RESOURCE_EXHAUSTED",
                "details": all_details,
            }
        }
    ).encode()


def violations(*items: dict[str, Any]) -> dict[str, Any]:
    return {"@type": QUOTA_FAILURE, "violations": list(items)}


@pytest.mark.parametrize(
    ("body", "credential_wide"),
    [
        # the project's message rate, as Google's quota system words it
        (
            quota_body(
                "Quota exceeded for quota metric 'Send requests' and limit 'Send requests per "
                "minute' of service 'fcm.googleapis.com' for consumer 'project_number:1'.",
                fcm_error=False,
            ),
            True,
        ),
        # a QuotaFailure whose subject is the project but whose limit is the device's
        (
            quota_body(
                "Sending limit exceeded for the message target.",
                violations(
                    {"subject": "project:123456", "description": "Message rate exceeded for device"}
                ),
            ),
            False,
        ),
        (
            quota_body(
                "Quota exceeded.",
                violations({"quotaMetric": "fcm.googleapis.com/device_messages"}),
            ),
            False,
        ),
        (
            quota_body("Quota exceeded.", violations({"quotaId": "MessagesPerMinutePerDevice"})),
            False,
        ),
        # the message alone says so
        (quota_body("Device message rate exceeded."), False),
        # one device violation and one project violation: the project's wins
        (
            quota_body(
                "Quota exceeded.",
                violations(
                    {"subject": "device", "description": "Device message rate exceeded."},
                    {"subject": "project", "description": "Message rate exceeded."},
                ),
            ),
            True,
        ),
        # violations that do not name a device outweigh a message that does
        (
            quota_body(
                "Device message rate exceeded.",
                violations({"subject": "project:1", "description": "Message rate exceeded."}),
            ),
            True,
        ),
        # FCM's topic limit and a body that does not say: the safe reading
        (quota_body("Topic quota exceeded."), True),
        (quota_body("Sending limit exceeded for the message target."), True),
        (b"", True),
        (b"<html>Too Many Requests</html>", True),
        # "developer" is not a device
        (quota_body("Quota exceeded for developer project."), True),
    ],
)
def test_quota_scope_is_read_from_the_body(body: bytes, credential_wide: bool) -> None:
    attempt = classify_fcm(429, body)
    assert attempt.outcome is Outcome.THROTTLED
    assert attempt.credential_wide is credential_wide


def test_a_device_named_by_its_token_is_not_repeated_in_the_detail() -> None:
    body = quota_body(
        f"Device message rate exceeded for {NOISY}",
        violations({"subject": f"device:{NOISY}", "description": "Device message rate exceeded"}),
    )
    attempt = classify_fcm(429, body, token=NOISY)
    assert attempt.credential_wide is False
    assert attempt.detail is not None and NOISY not in attempt.detail
    assert NOISY not in repr(attempt.reason)


@pytest.mark.parametrize(
    ("retry_delay", "seconds"),
    [
        ("30s", 30.0),
        ("1.5s", 1.5),
        ({"seconds": "3", "nanos": 500_000_000}, 3.5),
        ({"seconds": 2}, 2.0),
        ("soon", None),
        ("-5s", None),
        ({"seconds": "x"}, None),
        (17, None),
    ],
)
def test_retry_info_gives_the_delay_when_no_retry_after_header(
    retry_delay: Any, seconds: float | None
) -> None:
    body = quota_body(
        "Quota exceeded.", {"@type": RETRY_INFO, "retryDelay": retry_delay}, fcm_error=True
    )
    assert classify_fcm(429, body).retry_after == seconds


def test_the_retry_after_header_wins_over_retry_info() -> None:
    body = quota_body("Quota exceeded.", {"@type": RETRY_INFO, "retryDelay": "30s"})
    assert classify_fcm(429, body, retry_after=2.0).retry_after == 2.0


def test_retry_info_is_not_read_for_a_final_answer() -> None:
    body = json.dumps(
        {
            "error": {
                "code": 404,
                "message": "Requested entity was not found.",
                "status": "NOT_FOUND",
                "details": [
                    {"@type": FCM_ERROR, "errorCode": "UNREGISTERED"},
                    {"@type": RETRY_INFO, "retryDelay": "30s"},
                ],
            }
        }
    ).encode()
    attempt = classify_fcm(404, body)
    assert (attempt.outcome, attempt.retry_after) == (Outcome.TOKEN_INVALID, None)


def test_the_simulator_says_which_limit_was_exceeded() -> None:
    """The presets an operator scripts: each scope's body classifies as documented."""
    cases: list[tuple[Callable[[], FcmResponse], bool]] = [
        (lambda: FcmResponse.quota_exceeded(), True),
        (lambda: FcmResponse.quota_exceeded(scope="project"), True),
        (lambda: FcmResponse.quota_exceeded(scope="device"), False),
        (lambda: FcmResponse.quota_exceeded(scope="topic"), True),
        (lambda: FcmResponse.quota_exceeded(scope=None), True),
    ]
    for make, credential_wide in cases:
        response = make()
        attempt = classify_fcm(response.status, response.error_body())
        assert (attempt.outcome, attempt.reason, attempt.credential_wide) == (
            Outcome.THROTTLED,
            "QUOTA_EXCEEDED",
            credential_wide,
        )

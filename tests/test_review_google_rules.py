"""FCM HTTP v1 as Google defines it (projects.messages, ErrorCode): what the core sends and
how it backs off, from an Android engineer's point of view.

- A v1 message whose field names or `android` values Google's parser refuses (a legacy
  API name such as `time_to_live`, `android.ttl` as a number, an unknown priority) is a
  400 for every push, counted against the project's quota: the core refuses it before
  sending, with a detail that says what to write instead.
- QUOTA_EXCEEDED for one device's message rate: Google asks to slow down to that device
  with exponential backoff. The device's other pushes wait for its back-off (or end at
  once when it outlasts their deadline) instead of each meeting the same 429.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from gateway.core import dispatcher as dispatcher_module
from gateway.core.dispatcher import Dispatcher, Lane
from gateway.core.fcm import FcmClient, message_problem
from gateway.core.push import Outcome, Push, Reason
from gateway.testing.fcm_sim import FcmResponse, make_service_account
from plugins.matrix.payloads import fcm_message
from plugins.zulip.payloads import e2ee_fcm_message, fcm_test_message, legacy_fcm_message
from tests.test_review_fcm_quotas import NOISY, QUIET, Rig, fcm_rig


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with fcm_rig(tmp_path) as started:
        yield started


# --- messages Google's parser refuses ----------------------------------------------------


@pytest.mark.parametrize(
    ("message", "words"),
    [
        ({"data": {"k": "v"}, "time_to_live": 3600}, "android.ttl"),
        ({"data": {"k": "v"}, "priority": "high"}, "android.priority"),
        ({"data": {"k": "v"}, "collapse_key": "chat"}, "android.collapse_key"),
        ({"data": {"k": "v"}, "content_available": True}, "content-available"),
        ({"data": {"k": "v"}, "payload": {}}, "no field 'payload'"),
        ({"android": {"ttl": 3600}}, "duration string"),
        ({"android": {"ttl": "3600"}}, "duration string"),
        ({"android": {"ttl": "-1s"}}, "duration string"),
        ({"android": {"ttl": "2419201s"}}, "4 weeks"),
        ({"android": {"ttl": "1.0000000001s"}}, "duration string"),
        ({"android": {"priority": "urgent"}}, "android.priority"),
        ({"android": {"priority": 10}}, "android.priority"),
        ({"android": {"time_to_live": 60}}, "use ttl"),
        ({"android": {"collapse_key": 5}}, "android.collapse_key must be a string"),
        ({"android": "high"}, "android must be an object"),
    ],
)
def test_a_message_google_refuses_is_refused_before_sending(
    message: dict[str, Any], words: str
) -> None:
    assert message_problem(message) is not None
    refused = FcmClient.validate(None, Push("p", "a", "tok", message))  # type: ignore[arg-type]
    assert refused is not None
    assert (refused.outcome, refused.reason) == (Outcome.PERMANENT, Reason.INVALID_PAYLOAD)
    assert words in (refused.detail or "")


@pytest.mark.parametrize(
    "message",
    [
        {"data": {"k": "v"}, "android": {"ttl": "3.5s", "priority": "high"}},
        {"android": {"ttl": "0s", "priority": "NORMAL", "collapse_key": "chat"}},
        {"android": {"ttl": "2419200s", "direct_boot_ok": True, "restricted_package_name": "a"}},
        {"android": {"collapseKey": "c", "directBootOk": False}, "fcmOptions": {}},
        {"notification": {"title": "t"}, "apns": {"headers": {"apns-priority": "5"}}},
    ],
)
def test_a_valid_v1_message_is_not_refused(message: dict[str, Any]) -> None:
    assert message_problem(message) is None
    assert FcmClient.validate(None, Push("p", "a", "tok", message)) is None  # type: ignore[arg-type]


def test_the_built_in_plugins_messages_pass() -> None:
    built = [
        e2ee_fcm_message(1, "ciphertext", "high"),
        legacy_fcm_message({"event": "message", "zulip_message_id": 1}, "normal"),
        fcm_test_message({"server": "z"}, 0),
        fcm_message({"event_id": "$e"}, fcm_options={}, low_priority=True),
        fcm_message(
            {"event_id": "$e"},
            fcm_options={"android": {"ttl": "60s", "collapse_key": "m"}},
            low_priority=False,
        ),
        {"android": {"priority": "high"}, "data": {"content_available": "true"}},  # marmot
    ]
    assert [message_problem(message) for message in built] == [None] * len(built)


async def test_a_legacy_field_costs_no_request_and_says_where_it_went(rig: Rig) -> None:
    receipt = await rig.dispatcher.send(
        rig.push(NOISY, {"data": {"k": "v"}, "android": {"ttl": 86400}})
    )
    assert (receipt.outcome, receipt.reason, receipt.attempts) == (
        Outcome.PERMANENT,
        Reason.INVALID_PAYLOAD,
        0,
    )
    assert "3600s" in (receipt.detail or "")
    assert rig.fcm.requests == []
    # the same message written the v1 way is accepted by the simulator (Google's rules)
    ok = await rig.dispatcher.send(
        rig.push(NOISY, {"data": {"k": "v"}, "android": {"ttl": "86400s"}})
    )
    assert (ok.outcome, ok.attempts) == (Outcome.OK, 1)


# --- one device's message rate ------------------------------------------------------------


async def test_a_throttled_device_holds_its_other_pushes_not_the_apps(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    rig.fcm.script(NOISY, FcmResponse.quota_exceeded(scope="device", retry_delay="30s"))
    first = await rig.dispatcher.send(rig.push(NOISY, deadline=5.0))
    # 30 s does not fit the deadline: one request, ended throttled
    assert (first.outcome, first.reason, first.attempts) == (
        Outcome.THROTTLED,
        "QUOTA_EXCEEDED",
        1,
    )
    # the next push to that device does not ask FCM again inside the device's back-off
    second = await rig.dispatcher.send(rig.push(NOISY, deadline=5.0))
    assert (second.outcome, second.reason, second.attempts) == (
        Outcome.THROTTLED,
        Reason.GATE_CLOSED,
        0,
    )
    assert len(rig.fcm.requests_for(NOISY)) == 1
    # the app's gate stays open: another device is not held
    assert rig.lane.gate_until == 0.0
    quiet = await rig.dispatcher.send(rig.push(QUIET, deadline=5.0))
    assert (quiet.outcome, quiet.attempts) == (Outcome.OK, 1)
    # the token is a key in memory only: never in logs, metrics or receipts
    exposed = caplog.text + generate_latest(rig.metrics.registry).decode()
    exposed += repr(first) + repr(second)
    assert NOISY not in exposed


async def test_a_device_gate_is_waited_for_then_forgotten(rig: Rig) -> None:
    rig.fcm.script(
        NOISY, FcmResponse.quota_exceeded(scope="device", retry_delay="0.2s"), FcmResponse.ok()
    )
    first = await rig.dispatcher.send(rig.push(NOISY, deadline=5.0, max_retries=0))
    assert (first.outcome, first.attempts) == (Outcome.THROTTLED, 1)
    assert NOISY in rig.lane.device_gates
    # the gate fits this push's deadline: it waits, then goes out
    second = await rig.dispatcher.send(rig.push(NOISY, deadline=5.0))
    assert (second.outcome, second.reason, second.attempts) == (Outcome.OK, None, 1)
    assert [r.status for r in rig.fcm.requests_for(NOISY)] == [429, 200]
    assert rig.lane.device_gates == {}


async def test_a_project_quota_closes_no_device_gate(rig: Rig) -> None:
    rig.fcm.script(NOISY, FcmResponse.quota_exceeded(scope="project"))
    receipt = await rig.dispatcher.send(rig.push(NOISY, deadline=1.0))
    assert (receipt.outcome, receipt.reason) == (Outcome.THROTTLED, "QUOTA_EXCEEDED")
    assert rig.lane.gate_until > 0.0
    assert rig.lane.device_gates == {}


def test_device_gates_are_bounded(rig_free_lane: Lane, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatcher_module, "DEVICE_GATES_MAX", 3)
    for index in range(10):
        Dispatcher._close_device_gate(rig_free_lane, f"t{index}", 1e12)
    assert list(rig_free_lane.device_gates) == ["t7", "t8", "t9"]
    # a device already gated keeps the later of its two ends
    Dispatcher._close_device_gate(rig_free_lane, "t8", 5.0)
    assert rig_free_lane.device_gates["t8"] == 1e12


@pytest.fixture
def rig_free_lane() -> Lane:
    lane = Lane.__new__(Lane)
    lane.device_gates = {}
    return lane


# --- a Matrix app's fcm_options: the base of every message, checked at start-up ----------


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"time_to_live": 3600}, "fcm_options: FCM message field 'time_to_live'"),
        ({"android": {"ttl": 3600}}, "fcm_options: FCM android.ttl must be a duration"),
        ({"android": {"priority": "max"}}, "fcm_options: FCM android.priority"),
        ({"topic": "news"}, "fcm_options: must not set 'topic'"),
    ],
)
def test_a_matrix_apps_fcm_options_google_refuses_fail_at_start_up(
    tmp_path: Path, options: dict[str, Any], words: str
) -> None:
    from pydantic import ValidationError

    from plugins.matrix.config import MatrixAppConfig

    account = tmp_path / "sa.json"
    make_service_account("p1", "https://oauth2.googleapis.com/token", account, key_size=1024)
    app = {
        "type": "gcm",
        "api_version": "v1",
        "project_id": "p1",
        "service_account_file": str(account),
    }
    assert MatrixAppConfig.model_validate({**app, "fcm_options": {"android": {"ttl": "60s"}}})
    with pytest.raises(ValidationError) as refused:
        MatrixAppConfig.model_validate({**app, "fcm_options": options})
    assert words in str(refused.value)

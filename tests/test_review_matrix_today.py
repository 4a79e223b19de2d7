"""Review: today's core changes as a Matrix homeserver meets them (matrix_today).

Through the real `/_matrix/push/v1/notify` endpoint with the simulators:

- the new ends of a push (`invalidation_suspended` by the guard's start rule,
  `certificate_expired`, `certificate_refused`, a throttled device's `throttled` /
  `gate_closed`) answer 502 (the homeserver retries, the pusher is kept), and
  docs/matrix.md's "What the homeserver sees" table now says so for each (it listed
  none of them);
- a `msc3013_fallback_alert` no APNs push can carry is a start-up error: too large, it
  had every encrypted event pushkey rejected (the homeserver deletes the pusher), and a
  YAML `.nan` in it answered the homeserver 500.
"""

from __future__ import annotations

import datetime
import json
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.testing import ApnsSimulator, SimulatorCA
from gateway.testing.apns_sim import ApnsResponse
from gateway.testing.fcm_sim import FcmResponse, FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config, fcm_app_config
from plugins.matrix.config import MatrixConfig
from tests.matrix.conftest import NOTIFY, apns_pushkey, device, fcm_pushkey, notification

DOC = Path(__file__).resolve().parents[1] / "docs" / "matrix.md"
TOPIC = "com.example.app"


def _answer_documented_for(reason: str) -> str:
    """The answer cell of the row of docs/matrix.md's "What the homeserver sees" table
    that names `reason` (in backticks)."""
    section = DOC.read_text("utf-8").split("## What the homeserver sees", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    matching = [row for row in rows if f"`{reason}`" in row.rsplit(" | ", 1)[0]]
    assert len(matching) == 1, f"no single row of the table names `{reason}`"
    return matching[0].rsplit(" | ", 1)[1]


def _ended(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The `outcome reason` of each push the matrix plugin logged as failed."""
    return re.findall(
        r"delivery failed: (\w+ \w+) after", "\n".join(r.getMessage() for r in caplog.records)
    )


async def _post(gw: GatewayHarness, body: dict[str, Any]) -> tuple[int, str]:
    response = await gw.client.post(NOTIFY, data=json.dumps(body).encode())
    return response.status, await response.text()


def _matrix(tmp_path: Path, apps: dict[str, Any]) -> dict[str, Any]:
    return base_config(tmp_path, {"matrix": {"apps": apps, "notify_deadline": 3.0}})


@pytest.fixture
def matrix_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="plugins.matrix")
    return caplog


@pytest.fixture
async def apns_sim() -> AsyncIterator[ApnsSimulator]:
    async with ApnsSimulator() as sim:
        yield sim


# -- (1) the new ends of a push: 502, and the table says so ------------------------------


async def test_guard_start_rule_answers_502_then_rejects_once_released(
    apns_sim: ApnsSimulator, tmp_path: Path, matrix_log: pytest.LogCaptureFixture
) -> None:
    """A wrong environment: every token BadDeviceToken. The 10th in a row before any
    accepted push trips the guard: 502 (pusher kept), not `rejected` (pusher deleted)."""
    app = apns_app_config(apns_sim, tmp_path)
    async with GatewayHarness(_matrix(tmp_path, {"ios": app})) as gw:
        apns_sim.script_all(ApnsResponse.error("BadDeviceToken"))
        keys = [apns_pushkey()[0] for _ in range(10)]
        answers = [await _post(gw, notification([device("ios", key)])) for key in keys]
        assert answers[:9] == [(200, json.dumps({"rejected": [key]})) for key in keys[:9]]
        assert answers[9] == (502, "")
        assert _ended(matrix_log) == ["permanent invalidation_suspended"]

        apns_sim.clear_scripts()  # one push of the app accepted: the guard lets go
        assert await _post(gw, notification([device("ios", apns_pushkey()[0])])) == (
            200,
            json.dumps({"rejected": []}),
        )
        apns_sim.script_all(ApnsResponse.error("BadDeviceToken"))
        retried = await _post(gw, notification([device("ios", keys[9])]))
        assert retried == (200, json.dumps({"rejected": [keys[9]]}))

    assert _answer_documented_for("invalidation_suspended").startswith("502")


async def test_expired_certificate_answers_502_without_a_connection(
    tmp_path: Path, matrix_log: pytest.LogCaptureFixture
) -> None:
    now = datetime.datetime.now(datetime.UTC)
    async with ApnsSimulator(client_certificates=True) as sim:
        certfile = sim.ca.issue_client_certificate(
            TOPIC,
            not_before=now - datetime.timedelta(days=400),
            not_after=now - datetime.timedelta(days=1),
        )
        app = {
            "type": "apns",
            "certfile": str(certfile),
            "topic": TOPIC,
            "host": sim.host,
            "port": sim.port,
            "ca_file": str(sim.ca_path),
            "request_timeout": 2.0,
        }
        async with GatewayHarness(_matrix(tmp_path, {"ios": app})) as gw:
            answer = await _post(gw, notification([device("ios", apns_pushkey()[0])]))
        assert sim.connections_opened == 0
    assert answer == (502, "")
    assert _ended(matrix_log) == ["permanent certificate_expired"]
    assert _answer_documented_for("certificate_expired").startswith("502")


async def test_refused_certificate_answers_502(
    tmp_path: Path, matrix_log: pytest.LogCaptureFixture
) -> None:
    stranger = SimulatorCA(tmp_path / "other-ca")
    try:
        async with ApnsSimulator(client_certificates=True) as sim:
            app = {
                "type": "apns",
                "certfile": str(stranger.issue_client_certificate(TOPIC)),
                "topic": TOPIC,
                "host": sim.host,
                "port": sim.port,
                "ca_file": str(sim.ca_path),
                "request_timeout": 2.0,
            }
            async with GatewayHarness(_matrix(tmp_path, {"ios": app})) as gw:
                answers = [
                    await _post(gw, notification([device("ios", apns_pushkey()[0])]))
                    for _ in range(2)
                ]
            assert sim.requests == []
    finally:
        stranger.cleanup()
    assert answers == [(502, ""), (502, "")]
    assert _ended(matrix_log) == ["permanent certificate_refused"] * 2
    assert _answer_documented_for("certificate_refused").startswith("502")


async def test_throttled_device_answers_502_and_its_gate_sends_nothing(
    tmp_path: Path, matrix_log: pytest.LogCaptureFixture
) -> None:
    async with FcmSimulator() as fcm:
        app = fcm_app_config(fcm, tmp_path)
        async with GatewayHarness(_matrix(tmp_path, {"android": app})) as gw:
            key = fcm_pushkey()
            fcm.script(key, FcmResponse.quota_exceeded(scope="device", retry_delay="60s"))
            first = await _post(gw, notification([device("android", key)]))
            sent = len(fcm.requests)
            fcm.clear_scripts()
            second = await _post(gw, notification([device("android", key)]))
            assert len(fcm.requests) == sent == 1  # the gate's push asked nothing
    assert (first, second) == ((502, ""), (502, ""))
    assert _ended(matrix_log) == ["throttled QUOTA_EXCEEDED", "throttled gate_closed"]
    assert _answer_documented_for("gate_closed").startswith("502")


# -- (2) a fallback alert no push can carry ---------------------------------------------


def _apns_app(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    keyfile = tmp_path / "AuthKey.p8"
    if not keyfile.exists():
        from gateway.testing.apns_sim import generate_apns_auth_key

        generate_apns_auth_key().write_p8(keyfile)
    return {
        "type": "apns",
        "keyfile": str(keyfile),
        "key_id": "K",
        "team_id": "T",
        "topic": TOPIC,
        **extra,
    }


@pytest.mark.parametrize(
    ("alert", "problem"),
    [
        ({"title": "x" * 4100}, "bytes, limit 4096"),
        ({"body": float("nan")}, "not JSON-encodable"),
    ],
)
def test_a_fallback_alert_no_push_can_carry_is_refused_at_start(
    tmp_path: Path, alert: dict[str, Any], problem: str
) -> None:
    with pytest.raises(ValidationError) as raised:
        MatrixConfig.model_validate(
            {"apps": {"ios": _apns_app(tmp_path, msc3013_fallback_alert=alert)}}
        )
    assert "msc3013_fallback_alert" in str(raised.value)
    assert problem in str(raised.value)
    # Never sent with msc3013_mode: off, so not refused there.
    MatrixConfig.model_validate(
        {"apps": {"ios": _apns_app(tmp_path, msc3013_fallback_alert=alert, msc3013_mode="off")}}
    )


async def test_a_fallback_alert_within_bounds_starts_and_is_delivered(
    apns_sim: ApnsSimulator, tmp_path: Path
) -> None:
    """The check refuses no alert a push can carry: one of 3900 bytes starts, and an
    encrypted event too large with it goes out without its ciphertext, not rejected."""
    alert = {"title": "x" * 3900}
    app = apns_app_config(apns_sim, tmp_path, msc3013_fallback_alert=alert)
    async with GatewayHarness(_matrix(tmp_path, {"ios": app})) as gw:
        key = apns_pushkey()[0]
        event = notification(
            [device("ios", key, data={"algorithm": "m.curve25519-aes-sha2"})],
            ciphertext="c" * 400,
            ephemeral="e",
            mac="m",
            counts=...,
        )
        assert await _post(gw, event) == (200, json.dumps({"rejected": []}))
    sent = apns_sim.requests[-1].json
    assert sent is not None and sent["aps"]["alert"] == alert
    assert sent.get("ciphertext_omitted") is True

"""Log volume during a long provider outage: what the on-call reads.

APNs or FCM is down (or refuses the credential) for an hour while hundreds of pushes a
second keep coming. The log must say when the state changes (breaker opened / closed,
credential refused / accepted again), with counts; the per-push detail belongs at DEBUG
and in /metrics. A WARNING per failed push is a flood that fills disks and hides the
line that matters.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from gateway.core.dispatcher import Lane
from gateway.core.fcm import FcmClient
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.fcm_sim import FcmResponse, FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config, fcm_app_config

IOS = "com.example.ios"
ANDROID = "com.example.android"
NOTIFY = "/_matrix/push/v1/notify"
PUSHES = 60  # enough to open the breaker (threshold 5 here) many times over


def _notification(app_id: str, pushkey: str) -> bytes:
    body = {
        "notification": {
            "event_id": "$e",
            "room_id": "!r:example.com",
            "type": "m.room.message",
            "sender": "@a:example.com",
            "prio": "high",
            "content": {"msgtype": "m.text", "body": "hello"},
            "counts": {"unread": 1},
            "devices": [{"app_id": app_id, "pushkey": pushkey}],
        }
    }
    return json.dumps(body).encode()


def _pushkey(app_id: str) -> str:
    if app_id == IOS:
        return base64.b64encode(secrets.token_bytes(32)).decode()
    return f"fcm-{secrets.token_hex(8)}:APA91b" + "x" * 40


@asynccontextmanager
async def _gateway(
    tmp_path: Path, apns: ApnsSimulator, fcm: FcmSimulator, **ios: Any
) -> AsyncIterator[GatewayHarness]:
    apps = {IOS: apns_app_config(apns, tmp_path, **ios), ANDROID: fcm_app_config(fcm, tmp_path)}
    config = base_config(
        tmp_path,
        {"matrix": {"apps": apps, "notify_deadline": 3.0}},
        delivery={
            "backoff_base": 0.005,
            "backoff_cap": 0.01,
            "max_retries": 2,
            "circuit_breaker": {"failure_threshold": 5, "reset_after": 30.0},
        },
    )
    async with GatewayHarness(config) as gw:
        yield gw


async def _notify(
    gw: GatewayHarness, app_id: str, count: int, register_secret: Callable[[str], None]
) -> list[int]:
    """`count` Synapse-shaped requests (one device each), ten at a time."""
    statuses: list[int] = []

    async def one() -> int:
        key = _pushkey(app_id)
        register_secret(key)
        response = await gw.client.post(NOTIFY, data=_notification(app_id, key))
        await response.read()
        return response.status

    for _ in range(0, count, 10):
        statuses += await asyncio.gather(*(one() for _ in range(10)))
    return statuses


def _lane(gw: GatewayHarness, app_id: str) -> Lane:
    return gw.context("matrix").dispatcher._lanes[("matrix", app_id)]


def _ours(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    """The gateway's and the plugins' own lines at `level` or above."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(("gateway", "plugins")) and r.levelno >= level
    ]


@pytest.fixture
async def sims() -> AsyncIterator[tuple[ApnsSimulator, FcmSimulator]]:
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        yield apns, fcm


# --- the breaker: one line when it opens, one when it closes --------------------------------


@pytest.mark.parametrize("app_id", [IOS, ANDROID])
async def test_a_provider_outage_is_logged_when_the_breaker_opens_and_closes_not_per_push(
    app_id: str,
    tmp_path: Path,
    sims: tuple[ApnsSimulator, FcmSimulator],
    caplog: pytest.LogCaptureFixture,
    register_secret: Callable[[str], None],
) -> None:
    """Every push of an outage was a matrix WARNING (`delivery failed`), and the core said
    nothing at all: for Zulip and Marmot, which log no per-push line, an hour-long outage
    left no trace in the log. Now: the breaker's opening, with the failures that opened it
    and the last reason, and its closing, with how many pushes failed fast meanwhile."""
    apns, fcm = sims
    if app_id == IOS:
        apns.script_all(ApnsResponse.error("ServiceUnavailable"))
    else:
        fcm.script_all(FcmResponse.unavailable())
    async with _gateway(tmp_path, apns, fcm) as gw:
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            statuses = await _notify(gw, app_id, PUSHES, register_secret)
        assert set(statuses) == {502}
        warnings = _ours(caplog)
        assert len(warnings) <= 3, warnings  # not one per push
        [opened] = [m for m in warnings if "circuit breaker opened" in m]
        assert app_id in opened and "5 consecutive transient failures" in opened
        reason = "ServiceUnavailable" if app_id == IOS else "UNAVAILABLE"
        assert reason in opened

        # The provider is back; the trial is due.
        apns.clear_scripts()
        fcm.clear_scripts()
        lane = _lane(gw, app_id)
        assert lane.breaker.opened_at is not None
        lane.breaker.opened_at -= lane.breaker.reset_after
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            assert await _notify_one(gw, app_id, register_secret) == 200  # the trial
            assert await _notify(gw, app_id, 10, register_secret) == [200] * 10
        [closed] = [m for m in _ours(caplog, logging.INFO) if "circuit breaker closed" in m]
        assert app_id in closed
        # the count /metrics shows for the same pushes
        shed = await (await gw.client.get("/metrics")).text()
        [line] = [
            ln
            for ln in shed.splitlines()
            if ln.startswith("pushgw_pushes_shed_total")
            and f'app="{app_id}"' in ln
            and "circuit_open" in ln
        ]
        assert f"{int(float(line.split()[-1]))} push(es) failed fast" in closed


# --- the credential: one line when refused, one when accepted again -------------------------


async def test_a_refused_apns_credential_is_one_line_when_it_starts_and_one_when_it_ends(
    tmp_path: Path,
    sims: tuple[ApnsSimulator, FcmSimulator],
    caplog: pytest.LogCaptureFixture,
    register_secret: Callable[[str], None],
) -> None:
    """A revoked signing key (403 InvalidProviderToken on every push): no line from the
    core, a WARNING per push from matrix, nothing at all from Zulip or Marmot."""
    apns, fcm = sims
    apns.script_all(ApnsResponse.error("InvalidProviderToken"))
    async with _gateway(tmp_path, apns, fcm) as gw:
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            assert set(await _notify(gw, IOS, PUSHES, register_secret)) == {502}
        warnings = _ours(caplog)
        assert len(warnings) <= 3, warnings
        [refused] = [m for m in warnings if "refuses the credential" in m]
        assert IOS in refused and "InvalidProviderToken" in refused

        apns.clear_scripts()  # the operator installed a valid key
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            assert await _notify(gw, IOS, 10, register_secret) == [200] * 10
        [accepted] = [m for m in _ours(caplog, logging.INFO) if "credential accepted" in m]
        assert IOS in accepted and f"{PUSHES} push(es)" in accepted


async def test_an_oauth_endpoint_refusing_the_service_account_is_not_a_warning_per_push(
    tmp_path: Path,
    sims: tuple[ApnsSimulator, FcmSimulator],
    caplog: pytest.LogCaptureFixture,
    register_secret: Callable[[str], None],
) -> None:
    """The service account's key was deleted: Google refuses every token request
    (invalid_grant). `OAuth token refresh failed` was logged once per push (200 pushes,
    200 WARNINGs), though requests are made at most every 2 s. Now: the first failure,
    then silence at WARNING, then one line when a token is fetched again, counting."""
    apns, fcm = sims
    async with _gateway(tmp_path, apns, fcm) as gw:
        fcm.revoke_tokens()
        refuse = lambda assertion: ("Invalid grant: account not found.", None)  # noqa: E731
        fcm._verify_assertion = refuse  # type: ignore[method-assign]
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            assert set(await _notify(gw, ANDROID, PUSHES, register_secret)) == {502}
        oauth = [m for m in _ours(caplog) if "OAuth" in m]
        assert len(oauth) == 1, oauth
        assert ANDROID in oauth[0] and "RefreshError" in oauth[0]
        assert len(_ours(caplog)) <= 3, _ours(caplog)

        del fcm._verify_assertion  # the operator restored the key
        client = _lane(gw, ANDROID).client
        assert isinstance(client, FcmClient)
        client._fetch_retry_at = 0.0  # the 2 s pause between token requests is over
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            assert await _notify(gw, ANDROID, 10, register_secret) == [200] * 10
        [again] = [m for m in _ours(caplog, logging.INFO) if "OAuth token fetched again" in m]
        assert ANDROID in again and "failed token request(s)" in again


async def test_fcm_refusing_fresh_tokens_does_not_cost_a_token_request_per_push(
    tmp_path: Path,
    sims: tuple[ApnsSimulator, FcmSimulator],
    caplog: pytest.LogCaptureFixture,
    register_secret: Callable[[str], None],
) -> None:
    """FCM answers 401 even to a token just fetched (the credential, not the token, is
    refused): each push's retry fetched a new token, one request to Google's token
    endpoint and one INFO line per push, at the push rate."""
    apns, fcm = sims
    fcm.script_all(FcmResponse.unauthenticated())
    async with _gateway(tmp_path, apns, fcm) as gw:
        issued = fcm.tokens_issued
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            for _ in range(20):  # one at a time: each had its own fetch
                assert await _notify_one(gw, ANDROID, register_secret) == 502
        assert fcm.tokens_issued - issued <= 2
        fetched = [m for m in _ours(caplog, logging.INFO) if "OAuth token fetched" in m]
        assert len(fetched) <= 2, fetched


async def _notify_one(
    gw: GatewayHarness, app_id: str, register_secret: Callable[[str], None]
) -> int:
    key = _pushkey(app_id)
    register_secret(key)
    response = await gw.client.post(NOTIFY, data=_notification(app_id, key))
    await response.read()
    return response.status


# --- matrix: repeated identical failures summarised -----------------------------------------


async def test_matrix_repeated_delivery_failures_are_summarised_with_their_count(
    tmp_path: Path,
    sims: tuple[ApnsSimulator, FcmSimulator],
    caplog: pytest.LogCaptureFixture,
    register_secret: Callable[[str], None],
) -> None:
    """The first failure of an app is a WARNING as before; the same failure again is
    DEBUG; the next WARNING after a minute says how many were not logged meanwhile.
    Nothing is lost: every failed device is still a DEBUG line."""
    apns, fcm = sims
    apns.script_all(ApnsResponse.error("ServiceUnavailable"))
    async with _gateway(tmp_path, apns, fcm) as gw:
        frontend = gw.context("matrix").state["frontend"]
        now = [1000.0]
        frontend.repeats.clock = lambda: now[0]
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="plugins.matrix"):
            await _notify(gw, IOS, 20, register_secret)
            now[0] += 61.0
            assert await _notify_one(gw, IOS, register_secret) == 502
        failed = [
            r for r in caplog.records if r.name == "plugins.matrix" and "delivery failed" in r.msg
        ]
        assert len(failed) == 21  # every device, at some level
        warned = [r.getMessage() for r in failed if r.levelno == logging.WARNING]
        assert len(warned) == 2
        assert "not logged" not in warned[0]
        assert "19 more like it not logged" in warned[1]


async def test_matrix_requests_dropped_at_the_inflight_limit_are_summarised(
    tmp_path: Path,
    sims: tuple[ApnsSimulator, FcmSimulator],
    caplog: pytest.LogCaptureFixture,
    register_secret: Callable[[str], None],
) -> None:
    """A provider that stops answering fills an app's `inflight_request_limit`: every
    request after that was a WARNING of its own; the Sygnal drop counter has them all."""
    apns, fcm = sims
    apns.script_all(ApnsResponse.ok(delay=0.5))  # the one request in flight holds its slot
    async with _gateway(tmp_path, apns, fcm, inflight_request_limit=1) as gw:
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="plugins.matrix"):
            statuses = await _notify(gw, IOS, 10, register_secret)
        assert statuses.count(502) == 9
        dropped = [r for r in caplog.records if "inflight_request_limit reached" in r.msg]
        assert len(dropped) == 9  # every one, at some level
        assert [r.levelno for r in dropped].count(logging.WARNING) == 1
        text = await (await gw.client.get("/metrics")).text()
        assert f'sygnal_inflight_request_limit_drop_total{{pushkin="{IOS}"}} 9.0' in text

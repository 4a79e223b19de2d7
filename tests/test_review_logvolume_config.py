"""Log volume of configuration mistakes that repeat: what the on-call reads.

A configuration mistake (a registration naming an app the gateway does not serve, an
APNs topic the key may not push to, the APNs key in Firebase that Apple refuses, a Zulip
server at its `server_in_flight` bound) repeats for every push until someone fixes it.
The log must say it once when it starts (and, where it can end without a restart, once
when it ends), with counts; not one WARNING per push or per request, which at hundreds
of pushes a second fills disks and hides the line that matters. Nothing new may be
logged per push at WARNING when every push succeeds.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from gateway.core.dispatcher import Dispatcher
from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.fcm_sim import FcmResponse, FcmSimulator
from gateway.testing.harness import GatewayHarness
from plugins.zulip.bouncer import Bouncer
from plugins.zulip.crypto import token_id_of
from tests.marmot.gw import marmot_gateway
from tests.marmot.helpers import V_MARMOT, apns_device, chunk_for, content_of, our_wrap
from tests.marmot.scripted_relay import ScriptedRelay
from tests.zulip.conftest import (
    IOS_APP_ID,
    Env,
    ZulipServer,
    apns_token,
    fcm_token,
    zulip_config,
)

ELSEWHERE = "org.example.elsewhere"  # well formed, but no configured app serves it
REQUESTS = 20


def _ours(caplog: pytest.LogCaptureFixture, level: int = logging.WARNING) -> list[str]:
    """The gateway's and the plugins' own lines at `level` or above."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith(("gateway", "plugins")) and r.levelno >= level
    ]


def _bouncer(env: Env) -> Bouncer:
    bouncer = env.context.state["bouncer"]
    assert isinstance(bouncer, Bouncer)
    return bouncer


def _dispatcher(env: Env) -> Dispatcher:
    dispatcher = env.context.dispatcher
    assert isinstance(dispatcher, Dispatcher)
    return dispatcher


@pytest.fixture
async def sims() -> AsyncIterator[tuple[ApnsSimulator, FcmSimulator]]:
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        yield apns, fcm


@asynccontextmanager
async def _env(
    tmp_path: Path, sims: tuple[ApnsSimulator, FcmSimulator], **overrides: Any
) -> AsyncIterator[Env]:
    apns, fcm = sims
    config = zulip_config(apns, fcm, tmp_path, **overrides)
    async with GatewayHarness(config) as harness:
        yield Env(harness, apns, fcm)


@pytest.fixture
async def env(tmp_path: Path, sims: tuple[ApnsSimulator, FcmSimulator]) -> AsyncIterator[Env]:
    async with _env(tmp_path, sims) as running:
        yield running


async def _register(server: ZulipServer, token: str, kind: int, ios_app_id: str | None) -> None:
    data = {"token": token, "token_kind": str(kind), "user_id": "1"}
    if ios_app_id is not None:
        data["ios_app_id"] = ios_app_id
    status, body = await server.form("push/register", data)
    assert status == 200, body


async def _notify(server: ZulipServer, times: int = REQUESTS) -> None:
    body = {
        "user_id": 1,
        "apns_payload": {"alert": {"title": "t"}},
        "gcm_payload": {"event": "message"},
        "gcm_options": {},
    }
    for _ in range(times):
        status, answer = await server.json("push/notify", body)
        assert status == 200, answer


def _fcm_request(token: str, n: int) -> dict[str, Any]:
    data = base64.b64encode(n.to_bytes(4, "big") + b"\x00" * 44).decode()
    return {
        "token_id": token_id_of(token),
        "fcm_priority": "high",
        "payload": {"push_key_id": 20, "encrypted_data": data},
    }


# --- (1) a registration naming an app nobody configured ------------------------------------


async def test_zulip_unconfigured_ios_app_id_is_one_warning_not_one_per_push(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """Registration accepts any well-formed ios_app_id; a device of an app this gateway
    does not serve was a WARNING on every push to it, for as long as it stays registered.
    Now the first push logs it (naming the ios_app_id: not a secret, the operator's clue),
    the repeats go to DEBUG. A second unserved ios_app_id gets its own line."""
    server, _ = await env.ready_server()
    token = apns_token()
    await _register(server, token, 1, ELSEWHERE)
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        await _notify(server)
        warnings = [w for w in _ours(caplog) if "no APNs app" in w]
        assert len(warnings) == 1, warnings
        assert ELSEWHERE in warnings[0]
        assert token not in " ".join(r.getMessage() for r in caplog.records)
        other = "org.example.third"
        await _register(server, apns_token(), 1, other)
        await _notify(server, 3)
    warnings = [w for w in _ours(caplog) if "no APNs app" in w]
    assert len(warnings) == 2, warnings
    assert other in warnings[1]
    assert env.apns.requests == []  # still not sent: only the log changed


async def test_zulip_unconfigured_ios_app_id_is_recalled_with_the_pushes_skipped_since(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """The information kept: once the interval passed, the next line says how many pushes
    were not sent since the last one."""
    server, _ = await env.ready_server()
    await _register(server, apns_token(), 1, ELSEWHERE)
    now = [1000.0]
    _bouncer(env).repeats.clock = lambda: now[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        await _notify(server, 5)
        now[0] += 3600.0
        await _notify(server, 1)
    warnings = [w for w in _ours(caplog) if "no APNs app" in w]
    assert len(warnings) == 2, warnings
    assert "4 more" in warnings[1], warnings


async def test_zulip_without_an_fcm_app_is_one_warning_not_one_per_push(
    tmp_path: Path, sims: tuple[ApnsSimulator, FcmSimulator], caplog: pytest.LogCaptureFixture
) -> None:
    apns, fcm = sims
    config = zulip_config(apns, fcm, tmp_path)
    del config["plugins"]["zulip"]["apps"]["android"]
    async with GatewayHarness(config) as harness:
        server = ZulipServer(harness.client)
        await server.register()
        await _register(server, fcm_token(), 2, None)
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            await _notify(server)
    warnings = [w for w in _ours(caplog) if "no FCM app" in w]
    assert len(warnings) == 1, warnings


# --- (2) a server at its server_in_flight bound ----------------------------------------------


async def test_zulip_server_in_flight_bound_is_summarised_not_one_warning_per_request(
    tmp_path: Path, sims: tuple[ApnsSimulator, FcmSimulator], caplog: pytest.LogCaptureFixture
) -> None:
    """A server naming one device in five push requests per notify, with a bound of one
    send in flight: each notify starts one and leaves four (deterministically: they are
    started in one go). That was a WARNING per request for as long as the server kept it
    up; now the first, then at most one line per interval with the counts."""
    async with _env(tmp_path, sims, server_in_flight=1) as env:
        server, realm = await env.ready_server()
        token = fcm_token()
        status, body = await server.e2ee_register(realm, token, "fcm", ios_app_id=None)
        assert status == 200, body
        now = [1000.0]
        _bouncer(env).repeats.clock = lambda: now[0]
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            for n in range(REQUESTS):
                requests = [_fcm_request(token, n * 5 + i) for i in range(5)]
                status, body = await server.json(
                    "push/e2ee/notify", {"realm_uuid": realm, "push_requests": requests}
                )
                assert status == 200, body
                assert body["android_successfully_sent_count"] == 1, body
            warnings = [w for w in _ours(caplog) if "server_in_flight" in w]
            assert len(warnings) == 1, warnings
            assert warnings[0].startswith("zulip: 4 pushes"), warnings
            now[0] += 3600.0
            requests = [_fcm_request(token, 1000 + i) for i in range(5)]
            status, body = await server.json(
                "push/e2ee/notify", {"realm_uuid": realm, "push_requests": requests}
            )
            assert status == 200, body
        warnings = [w for w in _ours(caplog) if "server_in_flight" in w]
        assert len(warnings) == 2, warnings
        # The 19 requests since the first line, four pushes each, are in the next one.
        assert "76 more pushes in 19 requests" in warnings[1], warnings


# --- (3) permanent configuration failures: the core logs the state --------------------------

CONFIG_FAILURES = {
    "BadTopic": ("ios", lambda: ApnsResponse.error("BadTopic")),
    "TopicDisallowed": ("ios", lambda: ApnsResponse.error("TopicDisallowed")),
    "BadCertificateEnvironment": ("ios", lambda: ApnsResponse.error("BadCertificateEnvironment")),
    "THIRD_PARTY_AUTH_ERROR": ("android", FcmResponse.third_party_auth_error),
}


async def _devices(env: Env, app: str, count: int) -> ZulipServer:
    server, _ = await env.ready_server()
    for _ in range(count):
        if app == "ios":
            await _register(server, apns_token(), 1, IOS_APP_ID)
        else:
            await _register(server, fcm_token(), 2, None)
    return server


def _script_all(env: Env, app: str, response: Any) -> None:
    if app == "ios":
        env.apns.script_all(response)
    else:
        env.fcm.script_all(response)


def _clear(env: Env, app: str) -> None:
    if app == "ios":
        env.apns.clear_scripts()
    else:
        env.fcm.clear_scripts()


@pytest.mark.parametrize("reason", list(CONFIG_FAILURES))
async def test_a_permanent_configuration_failure_is_one_line_when_it_starts_and_one_when_it_ends(
    reason: str, env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """Zulip logs nothing per push (its answer counts what was sent) and the core logged
    nothing for `permanent`: an app whose every push Apple refuses for its topic, or whose
    APNs key in Firebase is wrong, left no trace in the log at all, only in /metrics.
    Now one line when the app starts failing for that reason, and, once its pushes are
    accepted again (with no such failure for `config_quiet` seconds), one saying so with
    the count of pushes that failed meanwhile."""
    app, response = CONFIG_FAILURES[reason]
    server = await _devices(env, app, 10)
    _script_all(env, app, response())
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        await _notify(server, 3)  # 30 pushes, each refused
        warnings = _ours(caplog)
        assert len(warnings) == 1, warnings
        assert reason in warnings[0] and f"app {app} " in warnings[0], warnings
        _dispatcher(env).config_quiet = 0.0
        _clear(env, app)
        await _notify(server, 1)
        await _notify(server, 2)  # accepted: nothing more to say
    warnings = _ours(caplog)
    assert len(warnings) == 2, warnings
    assert f"app {app} " in warnings[1] and "30 push(es)" in warnings[1], warnings
    assert reason in warnings[1], warnings


async def test_a_configuration_failure_of_some_pushes_of_an_app_does_not_flap(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """One FCM app serves Android and iOS devices; the APNs key stored in Firebase is
    wrong, so only the iOS devices' pushes fail (THIRD_PARTY_AUTH_ERROR), the others are
    accepted. A state that ended at the next accepted push would be two lines per failed
    push; it ends only after `config_quiet` seconds without the failure."""
    server = await _devices(env, "android", 4)
    refused = fcm_token()
    await _register(server, refused, 2, None)
    env.fcm.script(refused, *[FcmResponse.third_party_auth_error()] * REQUESTS)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        await _notify(server)
    warnings = _ours(caplog)
    assert len(warnings) == 1, warnings
    assert "THIRD_PARTY_AUTH_ERROR" in warnings[0]


async def test_marmot_configuration_failure_is_logged_once_by_the_core(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Marmot counts `pushgw_marmot_config_errors_total` and logs nothing per push: a
    TopicDisallowed on every wake-up was invisible in the log."""
    async with (
        ScriptedRelay() as relay,
        marmot_gateway(tmp_path, [relay.url], wait_live=False, publish_inbox_list=False) as gw,
    ):
        sub = (await relay.expect("REQ"))[1]
        await relay.send(["EOSE", sub])
        await gw.service.wait_live()
        gw.apns.script_all(ApnsResponse.error("TopicDisallowed"))
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            for _ in range(REQUESTS):
                wrap = our_wrap(gw.key, content_of([chunk_for(gw.key, apns_device())]), [V_MARMOT])
                await relay.send(f'["EVENT","{sub}",{wrap}]')
            await gw.apns.wait_for_requests(REQUESTS, 20)
            await gw.service.idle()
            deadline = time.monotonic() + 10
            while gw.service.pushes_finished < REQUESTS and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # polling for the receipts, not standing in for them
        assert gw.service.pushes_finished == REQUESTS
        assert gw.metric("pushgw_marmot_config_errors_total", reason="TopicDisallowed") == REQUESTS
    warnings = [w for w in _ours(caplog) if "TopicDisallowed" in w]
    assert len(warnings) == 1, warnings
    assert "app ios " in warnings[0]


# --- the happy path ---------------------------------------------------------------------------


async def test_zulip_happy_path_logs_no_warning(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    server, realm = await env.ready_server()
    for _ in range(3):
        await _register(server, apns_token(), 1, IOS_APP_ID)
        await _register(server, fcm_token(), 2, None)
    token = fcm_token()
    status, body = await server.e2ee_register(realm, token, "fcm", ios_app_id=None)
    assert status == 200, body
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        await _notify(server, 5)
        status, body = await server.json(
            "push/e2ee/notify", {"realm_uuid": realm, "push_requests": [_fcm_request(token, 1)]}
        )
        assert status == 200, body
    assert len(env.apns.requests) == 15 and len(env.fcm.requests) == 16
    assert _ours(caplog) == []

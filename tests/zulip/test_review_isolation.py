"""Tenant isolation of the Zulip push bouncer: what one registered server (with its own
valid credentials) can do to another server's registrations and deliveries."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy import select

from gateway.api import InvalidToken, ProviderKind
from gateway.testing import ApnsResponse, ApnsSimulator, FcmResponse, FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config
from plugins.zulip.crypto import token_id_of
from plugins.zulip.plugin import pushgw_token_invalid
from plugins.zulip.tables import e2ee_devices, legacy_devices
from tests.zulip.conftest import IOS_APP_ID, Env, apns_token, fcm_token, zulip_config

OTHER_APP_ID = "org.example.zulip.beta"


@pytest_asyncio.fixture
async def two_apps_env(
    tmp_path: Path, sims: tuple[ApnsSimulator, FcmSimulator]
) -> AsyncIterator[Env]:
    """The bouncer serving two iOS builds (two bundle ids, as a multi-tenant operator
    serving a production and a beta app, or two branded forks, does)."""
    apns, fcm = sims
    config = zulip_config(apns, fcm, tmp_path)
    config["plugins"]["zulip"]["apps"]["ios-beta"] = apns_app_config(
        apns, tmp_path, topic=OTHER_APP_ID
    )
    async with GatewayHarness(config) as harness:
        yield Env(harness, apns, fcm)


async def _token_of_b_registered_by_a_for_its_app(env: Env) -> tuple[Any, Any, str, str]:
    """Server B's user registered their phone's token for the production app, end-to-end
    encrypted and legacy; server A registered the same token under the other bundle id
    it serves. Returns (server A, server B, B's realm, the token)."""
    server_a, _ = await env.ready_server()
    server_b, realm_b = await env.ready_server()
    token = apns_token()
    status, body = await server_b.e2ee_register(realm_b, token, "apns", ios_app_id=IOS_APP_ID)
    assert status == 200, body
    status, body = await server_b.legacy_register(token, 1, user_id=7)  # IOS_APP_ID
    assert status == 200, body
    status, body = await server_a.form(
        "push/register",
        {"token": token, "token_kind": "1", "user_id": "1", "ios_app_id": OTHER_APP_ID},
    )
    assert status == 200, body
    return server_a, server_b, realm_b, token


async def _assert_only_bs_registrations_left(env: Env) -> None:
    """B's two registrations of the token stand; A's (the other app's) is gone."""
    async with env.engine.connect() as conn:
        e2ee = (await conn.execute(select(e2ee_devices.c.expired_at))).all()
        legacy = (await conn.execute(select(legacy_devices.c.ios_app_id))).all()
    assert [r.expired_at for r in e2ee] == [None]
    assert [r.ios_app_id for r in legacy] == [IOS_APP_ID]


def _e2ee_apns_request(token: str) -> dict[str, Any]:
    return {
        "token_id": token_id_of(token),
        "http_headers": {"apns_priority": 10, "apns_push_type": "alert"},
        "payload": {
            "push_key_id": 10,
            "encrypted_data": base64.b64encode(b"\x00" * 48).decode(),
            "aps": {"mutable-content": 1, "alert": {"title": "New notification"}},
        },
    }


async def test_token_not_for_another_topic_spares_other_servers_registrations(
    two_apps_env: Env,
) -> None:
    # Server B's user registered their phone's token T for the production app, both
    # end-to-end encrypted and legacy. Server A (a tenant that learned T, e.g. as a legacy
    # registration of the same phone) registers T under the *other* bundle id it serves.
    # APNs answers DeviceTokenNotForTopic: T does not belong to that topic. That says
    # nothing about T under B's topic, so B's registrations must survive.
    env = two_apps_env
    server_a, server_b, realm_b, token = await _token_of_b_registered_by_a_for_its_app(env)

    env.apns.script(token, ApnsResponse.error("DeviceTokenNotForTopic"))
    status, body = await server_a.json(
        "push/notify",
        {"user_id": 1, "apns_payload": {"alert": "x"}, "apple_devices": [token]},
    )
    assert status == 200, body
    assert body["total_apple_devices"] == 1
    [request] = env.apns.requests_for(token)
    assert request.headers["apns-topic"] == OTHER_APP_ID
    # A's own registration is gone: the token is not for the topic it named.
    assert body["deleted_devices"]["apple_devices"] == [token]

    await _assert_only_bs_registrations_left(env)

    env.apns.clear_scripts()
    status, body = await server_b.json(
        "push/e2ee/notify",
        {"realm_uuid": realm_b, "push_requests": [_e2ee_apns_request(token)]},
    )
    assert status == 200, body
    assert (body["apple_successfully_sent_count"], body["delete_token_ids"]) == (1, [])
    status, body = await server_b.json(
        "push/notify",
        {"user_id": 7, "apns_payload": {"alert": "x"}, "apple_devices": [token]},
    )
    assert status == 200, body
    assert body["total_apple_devices"] == 1
    assert body["deleted_devices"]["apple_devices"] == []


@pytest.mark.parametrize("reason", ["Unregistered", "BadDeviceToken"])
async def test_dead_token_is_still_forgotten_for_every_server_of_its_topic(
    two_apps_env: Env, reason: str
) -> None:
    # The scoping above must not weaken §6: a token dead for a topic goes for every
    # server that registered it for that topic.
    env = two_apps_env
    server_a, _ = await env.ready_server()
    server_b, realm_b = await env.ready_server()
    token = apns_token()
    status, body = await server_b.e2ee_register(realm_b, token, "apns", ios_app_id=IOS_APP_ID)
    assert status == 200, body
    await server_b.legacy_register(token, 1, user_id=7)
    await server_a.legacy_register(token.lower(), 1, user_id=1)
    env.apns.script(token.lower(), ApnsResponse.error(reason))
    status, body = await server_a.json(
        "push/notify", {"user_id": 1, "apns_payload": {"alert": "x"}}
    )
    assert status == 200, body
    async with env.engine.connect() as conn:
        e2ee = (await conn.execute(select(e2ee_devices.c.expired_at))).all()
        legacy = (await conn.execute(select(legacy_devices.c.id))).all()
    assert len(e2ee) == 1 and e2ee[0].expired_at is not None
    assert legacy == []


@pytest_asyncio.fixture
async def small_lane_env(
    tmp_path: Path, sims: tuple[ApnsSimulator, FcmSimulator]
) -> AsyncIterator[Env]:
    """A lane of 10 pushes, each server allowed 4 sends in flight."""
    apns, fcm = sims
    config = zulip_config(apns, fcm, tmp_path, notify_deadline=1.0, server_in_flight=4)
    config["plugins"]["zulip"]["apps"]["android"]["request_timeout"] = 60.0
    config["delivery"]["queue_size"] = 10
    async with GatewayHarness(config) as harness:
        yield Env(harness, apns, fcm)


def _e2ee_fcm_request(token: str, n: int) -> dict[str, Any]:
    data = base64.b64encode(n.to_bytes(4, "big") + b"\x00" * 44).decode()
    return {
        "token_id": token_id_of(token),
        "fcm_priority": "high",
        "payload": {"push_key_id": 20, "encrypted_data": data},
    }


async def test_one_server_cannot_fill_the_shared_lane(small_lane_env: Env) -> None:
    # Every Zulip server's pushes share the plugin's FCM lane. Server A registers one
    # token and names it in 30 push requests of one notify, each with different
    # encrypted_data (so duplicate suppression does not apply); its provider answers
    # slowly. Without a per-server bound A's sends fill the lane's queue and server B's
    # push is shed (`queue_full`): B's user gets nothing.
    env = small_lane_env
    server_a, realm_a = await env.ready_server()
    server_b, realm_b = await env.ready_server()
    slow, victim = fcm_token(), fcm_token()
    assert (await server_a.e2ee_register(realm_a, slow, "fcm", ios_app_id=None))[0] == 200
    assert (await server_b.e2ee_register(realm_b, victim, "fcm", ios_app_id=None))[0] == 200
    env.fcm.script(slow, FcmResponse.ok(delay=30.0))
    flood = [_e2ee_fcm_request(slow, n) for n in range(30)]
    status, body = await server_a.json(
        "push/e2ee/notify", {"realm_uuid": realm_a, "push_requests": flood}
    )
    assert status == 200, body
    assert body["android_successfully_sent_count"] == 0  # still in flight
    # A's sends are still running (30 s answers); B's push must find room in the lane.
    status, body = await server_b.json(
        "push/e2ee/notify",
        {"realm_uuid": realm_b, "push_requests": [_e2ee_fcm_request(victim, 0)]},
    )
    assert status == 200, body
    assert body["android_successfully_sent_count"] == 1, body
    assert len(env.fcm.requests_for(victim)) == 1
    assert len(env.fcm.requests_for(slow)) <= 4


async def test_retired_token_of_one_app_spares_other_apps_registrations(
    two_apps_env: Env,
) -> None:
    # The same attack through the operator's dead-token pipeline: A's refused pushes are
    # receipts of app `ios-beta`, the Spark job lists the token as dead for that app, and
    # `pushgw tokens retire` feeds it to the hook by hash. B's registrations of the token
    # for the production app must stay; A's for the beta app go.
    env = two_apps_env
    *_, token = await _token_of_b_registered_by_a_for_its_app(env)
    await pushgw_token_invalid(
        env.context,
        InvalidToken(
            plugin="zulip",
            app_id="ios-beta",
            token_hash=env.context.token_hash(token),
            token=None,
            provider=ProviderKind.APNS,
            reason="DeviceTokenNotForTopic",
        ),
    )
    await _assert_only_bs_registrations_left(env)

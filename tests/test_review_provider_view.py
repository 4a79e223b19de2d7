"""Provider-view review: what Apple and Google see of pushgw's pushes.

Each test drives real pushes end to end (a running gateway; the HTTP/2+TLS APNs and
the FCM simulators of `gateway/testing`) and reads the requests the simulators
recorded, as the provider would: headers, FCM message fields and bodies. The promise
is that providers learn no more than each protocol sends (specs/*.md, the provider
payload sections), and nothing the gateway itself knows: how many other pushes it
sends, and to whom.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest_asyncio

from gateway.testing.apns_sim import ApnsResponse, ApnsSimulator
from gateway.testing.fcm_sim import FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config, fcm_app_config
from tests.marmot.gw import marmot_gateway
from tests.marmot.helpers import (
    V_MARMOT,
    apns_device,
    chunk_for,
    content_of,
    fcm_device,
    our_wrap,
)
from tests.marmot.scripted_relay import ScriptedRelay
from tests.matrix.conftest import NOTIFY, apns_pushkey, device, fcm_pushkey, notification

IOS = "com.example.ios"
ANDROID = "com.example.android"


def sequence_of(apns_id: str) -> int:
    """The low 48 bits of an `apns-id`, where a counter would show."""
    return int(apns_id.replace("-", "")[-12:], 16)


def assert_unlinkable(first: str, second: str, pushes_between: int) -> None:
    """Two `apns-id`s Apple saw tell it nothing about the pushes sent between them."""
    for value in (first, second):
        parsed = uuid.UUID(value)
        assert str(parsed) == value and parsed.version == 4
    # A shared per-process prefix linked every push of the gateway to the others...
    assert first.replace("-", "")[:20] != second.replace("-", "")[:20]
    # ...and a counter in the rest said how many went out in between.
    assert sequence_of(second) - sequence_of(first) != pushes_between + 1


@pytest_asyncio.fixture
async def sims() -> AsyncIterator[tuple[ApnsSimulator, FcmSimulator]]:
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        yield apns, fcm


def matrix_config(sims: tuple[ApnsSimulator, FcmSimulator], directory: Path) -> dict[str, Any]:
    apns, fcm = sims
    apps = {IOS: apns_app_config(apns, directory), ANDROID: fcm_app_config(fcm, directory)}
    return base_config(directory, {"matrix": {"apps": apps, "notify_deadline": 5.0}})


async def notify(gw: GatewayHarness, body: dict[str, Any]) -> None:
    response = await gw.client.post(NOTIFY, data=json.dumps(body).encode())
    assert response.status == 200, await response.text()
    assert await response.json() == {"rejected": []}


async def test_marmot_apns_ids_do_not_count_a_groups_android_members(tmp_path: Path) -> None:
    """One trigger wakes an iPhone, three Android phones, then another iPhone. Apple sees
    the two APNs pushes only; with ids from one per-process prefix and a counter, the
    gap between them told Apple that three other pushes (the group's Android members)
    went out in between. transponder sends no `apns-id` at all (Apple makes one)."""
    iphone, iphone2 = apns_device(), apns_device()
    androids = [fcm_device() for _ in range(3)]
    async with (
        ScriptedRelay() as relay,
        marmot_gateway(tmp_path, [relay.url], wait_live=False, publish_inbox_list=False) as gw,
    ):
        req = await relay.expect("REQ")
        await relay.send(["EOSE", req[1]])
        await gw.service.wait_live()
        chunks = [chunk_for(gw.key, d) for d in (iphone, *androids, iphone2)]
        wrap = json.loads(our_wrap(gw.key, content_of(chunks), [V_MARMOT]))
        await relay.send(["EVENT", req[1], wrap])
        await gw.apns.wait_for_requests(2, 10)
        await gw.fcm.wait_for_requests(3, 10)
        await gw.service.idle()
        (first,) = gw.apns.requests_for(iphone.token)
        (second,) = gw.apns.requests_for(iphone2.token)
        # What a wake-up shows Apple and Google: the silent push, nothing else (§9).
        for request in (first, second):
            assert request.json == {"aps": {"content-available": 1}}
            assert request.headers["apns-push-type"] == "background"
            assert request.headers["apns-priority"] == "5"
            assert not {"apns-collapse-id", "apns-expiration"} & set(request.headers)
        for request in gw.fcm.requests:
            assert request.message == {
                "token": request.token,
                "android": {"priority": "high"},
                "data": {"content_available": "true"},
            }
    assert_unlinkable(first.headers["apns-id"], second.headers["apns-id"], len(androids))


async def test_matrix_apns_ids_do_not_count_pushes_to_google(
    tmp_path: Path, sims: tuple[ApnsSimulator, FcmSimulator]
) -> None:
    """The same for any protocol: Apple must not learn the gateway's FCM volume (or its
    other apps' pushes) from the ids of its own."""
    apns, fcm = sims
    between = 5
    ios_key, hex_token = apns_pushkey()
    async with GatewayHarness(matrix_config(sims, tmp_path)) as gw:
        await notify(gw, notification([device(IOS, ios_key)]))
        for _ in range(between):
            await notify(gw, notification([device(ANDROID, fcm_pushkey())]))
        await notify(gw, notification([device(IOS, ios_key)]))
    first, second = apns.requests_for(hex_token)
    assert fcm.request_count == between
    assert_unlinkable(first.headers["apns-id"], second.headers["apns-id"], between)


async def test_a_retried_push_keeps_its_apns_id(
    tmp_path: Path, sims: tuple[ApnsSimulator, FcmSimulator]
) -> None:
    """Random ids per push, not per request: a retry of one push (here after a 503) is
    the same notification to Apple and carries the same `apns-id` (providers.md §2.1)."""
    apns, _ = sims
    ios_key, hex_token = apns_pushkey()
    apns.script(hex_token, ApnsResponse.error("ServiceUnavailable"), ApnsResponse.ok())
    async with GatewayHarness(matrix_config(sims, tmp_path)) as gw:
        await notify(gw, notification([device(IOS, ios_key)]))
        await notify(gw, notification([device(IOS, ios_key)]))
    failed, retried, next_push = apns.requests_for(hex_token)
    assert failed.status == 503 and retried.status == 200 and next_push.status == 200
    assert failed.headers["apns-id"] == retried.headers["apns-id"]
    assert next_push.headers["apns-id"] != retried.headers["apns-id"]

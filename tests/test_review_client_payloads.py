"""Review: what reaches Apple and Google (and so the phone), per plugin and kind of push.

Every test drives the real simulators (APNs over TLS/HTTP2, FCM over HTTP) and asserts
on the exact request they recorded: headers and body.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.config import ApnsAppConfig
from gateway.core.apns import ApnsClient
from gateway.core.push import ApnsOptions, Outcome, Push
from gateway.testing import ApnsSimulator, FcmSimulator, generate_apns_auth_key
from tests.matrix.conftest import NOTIFY, apns, apns_pushkey, device, fcm, notification
from tests.matrix.conftest import make_gateway as make_gateway
from tests.testing.test_fcm_sim import bearer, fcm_error_code, session
from tests.testing.test_fcm_sim import send as fcm_send

__all__ = ["apns", "bearer", "fcm", "make_gateway", "session"]  # fixtures used here

TOPIC = "com.example.app"
MakeClient = Callable[..., Awaitable[ApnsClient]]


@pytest.fixture
async def make_client(
    apns: ApnsSimulator, tmp_path: Path, register_secret: Callable[[str], None]
) -> AsyncIterator[MakeClient]:
    """An `ApnsClient` (token auth) pointed at the APNs simulator."""
    clients: list[ApnsClient] = []

    async def make(**overrides: Any) -> ApnsClient:
        key = generate_apns_auth_key()
        keyfile = key.write_p8(tmp_path / f"AuthKey_{key.key_id}.p8")
        apns.add_jwt_key(key.key_id, key.team_id, key.public_key)
        settings: dict[str, Any] = {
            "keyfile": keyfile,
            "key_id": key.key_id,
            "team_id": key.team_id,
            "topic": TOPIC,
            "host": apns.host,
            "port": apns.port,
            "ca_file": apns.ca_path,
            "request_timeout": 2.0,
            **overrides,
        }
        client = ApnsClient("ios", ApnsAppConfig(**settings))
        await client.start()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def _post(gw: Any, body: dict[str, Any]) -> tuple[int, Any]:
    response = await gw.client.post(NOTIFY, data=json.dumps(body).encode())
    text = await response.text()
    return response.status, (json.loads(text) if response.status == 200 else text)


# --- APNs background pushes: apns-priority must be 5 ------------------------------------


@pytest.mark.parametrize(
    ("push_type", "priority", "payload"),
    [
        ("background", None, {"aps": {"content-available": 1}}),
        ("background", 10, {"aps": {"content-available": 1}}),
        # No push-type header: APNs infers `background` from a content-available-only aps.
        (None, None, {"aps": {"content-available": 1}, "x": "y"}),
        (None, 10, {"aps": {"content-available": 1}}),
    ],
)
async def test_background_push_goes_out_with_priority_5(
    apns: ApnsSimulator,
    make_client: MakeClient,
    register_secret: Callable[[str], None],
    push_type: str | None,
    priority: int | None,
    payload: dict[str, Any],
) -> None:
    """Apple: priority 10 is an error for a background (content-available-only) push;
    an omitted header means 10. The app is then never woken."""
    client = await make_client()
    token = "cd" * 32
    register_secret(token)
    push = Push(
        "test",
        "ios",
        token,
        payload,
        apns=ApnsOptions(push_type=push_type, priority=priority),
    )
    assert client.validate(push) is None
    assert (await client.send(push)).outcome is Outcome.OK
    (request,) = apns.requests
    assert request.headers.get("apns-priority") == "5"


async def test_alert_and_explicit_low_priorities_are_left_alone(
    apns: ApnsSimulator, make_client: MakeClient, register_secret: Callable[[str], None]
) -> None:
    client = await make_client()
    token = "ab" * 32
    register_secret(token)
    cases: list[tuple[ApnsOptions, dict[str, Any], str | None]] = [
        (ApnsOptions(push_type="alert"), {"aps": {"alert": "x", "content-available": 1}}, None),
        (ApnsOptions(push_type="background", priority=1), {"aps": {"content-available": 1}}, "1"),
        (ApnsOptions(push_type=None), {"aps": {"content-available": 1, "badge": 2}}, None),
        (ApnsOptions(push_type=None, priority=10), {"aps": {"alert": "x"}}, "10"),
    ]
    for options, payload, expected in cases:
        push = Push("test", "ios", token, payload, apns=options)
        assert (await client.send(push)).outcome is Outcome.OK
        assert apns.requests[-1].headers.get("apns-priority") == expected


async def test_matrix_background_app_sends_priority_5_for_high_prio_events(
    make_gateway: Callable[..., Any], apns: ApnsSimulator, tmp_path: Path
) -> None:
    """A Sygnal app configured with `push_type: background` (silent wake-ups for the
    client's own fetch): Synapse marks most events `prio: high`, which became
    `apns-priority: 10` on a background push."""
    async with make_gateway(ios={"push_type": "background"}) as gw:
        pushkey, hex_token = apns_pushkey()
        dev = device(
            "com.example.ios",
            pushkey,
            data={"default_payload": {"aps": {"content-available": 1}}},
        )
        body = notification([dev], type=..., content=..., sender=..., sender_display_name=...)
        status, answer = await _post(gw, body)
        assert (status, answer) == (200, {"rejected": []})
        (request,) = apns.requests
        assert request.token == hex_token
        assert request.headers["apns-push-type"] == "background"
        assert request.headers["apns-priority"] == "5"
        assert request.json is not None and request.json["aps"] == {"content-available": 1}


# --- FCM simulator: android.ttl as Google parses it ------------------------------------


@pytest.mark.parametrize(
    ("ttl", "accepted"),
    [
        ("3.5s", True),
        ("0s", True),
        ("3.123456789s", True),  # nine fractional digits: the most a Duration has
        ("2419200s", True),
        ("3.1234567891s", False),  # ten: FCM answers INVALID_ARGUMENT
        ("3.s", False),
        ("3.5", False),
    ],
)
async def test_fcm_simulator_ttl_follows_protobuf_duration(
    fcm_simulator: FcmSimulator,
    bearer: str,
    session: aiohttp.ClientSession,
    ttl: str,
    accepted: bool,
) -> None:
    """A simulator that accepts a TTL Google refuses hides a plugin's broken
    `android.ttl` until production (protobuf JSON Duration: up to 9 fractional digits)."""
    message = {"token": "t", "android": {"ttl": ttl}}
    status, body, _ = await fcm_send(session, fcm_simulator, message, bearer)
    if accepted:
        assert status == 200
    else:
        assert status == 400
        assert fcm_error_code(body) == "INVALID_ARGUMENT"

"""Review: what each plugin sends to APNs for an app's push type and topic, as iOS needs it.

Apple's rules checked here ("Sending notification requests to APNs"):

- a push type with a topic of its own (`voip`: `<bundle id>.voip`, `complication`, ...)
  is the only type that topic takes: PushKit tokens answer `InvalidPushType` to an
  `alert` or `background` push (reported by every APNs library: sideshow/apns2#149,
  PyAPNs2#87, apnotic#87, a2#94);
- a `background` push must use priority 5 (or 1): "using priority 10 is an error", and
  an omitted `apns-priority` means 10.

The simulator now refuses both, as Apple does, and the Matrix plugin's MSC3013 frames
follow the app's VoIP topic. Everything goes through the real simulator (HTTP/2 + TLS).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.config import ApnsAppConfig
from gateway.core.push import ApnsOptions, Outcome, Push
from gateway.testing import ApnsSimulator, generate_apns_auth_key
from tests.apns_clients import MakeClient, started_clients
from tests.matrix.conftest import NOTIFY, apns_pushkey, device, fcm, notification
from tests.matrix.conftest import make_gateway as make_gateway
from tests.testing.test_apns_sim import RawH2Client

__all__ = ["fcm", "make_gateway"]  # fixtures used here

TOPIC = "com.example.app"
VOIP_TOPIC = TOPIC + ".voip"
IOS = "com.example.ios"
ANDROID = "com.example.android"
FRAME = {"ciphertext": "Q2lwaGVyIHRleHQ+/w", "ephemeral": "RXBoZW1lcmFsIGtleQ", "mac": "TWFjIQ"}


@pytest.fixture
async def apns() -> AsyncIterator[ApnsSimulator]:
    async with ApnsSimulator() as sim:
        yield sim


@pytest.fixture
async def make_client(apns: ApnsSimulator, tmp_path: Path) -> AsyncIterator[MakeClient]:
    async with started_clients(apns, tmp_path) as make:
        yield make


def _token(register_secret: Callable[[str], None]) -> str:
    token = apns_pushkey()[1]
    register_secret(token)
    return token


# --- the simulator refuses what Apple refuses --------------------------------------------


@pytest.mark.parametrize("push_type", ["alert", "background"])
async def test_simulator_refuses_other_push_types_on_a_voip_topic(
    apns: ApnsSimulator,
    make_client: MakeClient,
    register_secret: Callable[[str], None],
    push_type: str,
) -> None:
    client = await make_client()
    token = _token(register_secret)
    payload = {"aps": {"content-available": 1}}
    wrong = Push("test", "ios", token, payload, apns=ApnsOptions(push_type, topic=VOIP_TOPIC))
    attempt = await client.send(wrong)
    assert (attempt.outcome, attempt.status, attempt.reason) == (
        Outcome.PERMANENT,
        400,
        "InvalidPushType",
    )
    # The VoIP topic takes voip pushes, and pushes without the header (Sygnal's).
    for kind in ("voip", None):
        push = Push("test", "ios", token, payload, apns=ApnsOptions(kind, topic=VOIP_TOPIC))
        assert (await client.send(push)).outcome is Outcome.OK
        assert apns.requests[-1].headers.get("apns-push-type") == kind
    # The same push type on the bundle's own topic is fine.
    plain = Push("test", "ios", token, payload, apns=ApnsOptions(push_type, topic=TOPIC))
    assert (await client.send(plain)).outcome is Outcome.OK


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"apns-push-type": "background", "apns-priority": "10"}, 400),
        ({"apns-push-type": "background"}, 400),  # no header: priority 10
        ({"apns-push-type": "background", "apns-priority": "5"}, 200),
        ({"apns-push-type": "background", "apns-priority": "1"}, 200),
        ({"apns-push-type": "alert", "apns-priority": "10"}, 200),
    ],
)
async def test_simulator_refuses_a_background_push_at_priority_10(
    apns: ApnsSimulator,
    register_secret: Callable[[str], None],
    headers: dict[str, str],
    status: int,
) -> None:
    client = await RawH2Client.connect(apns)
    try:
        result = await client.request(
            token=_token(register_secret),
            body=b'{"aps":{"content-available":1}}',
            headers={"apns-topic": TOPIC, **headers},
        )
    finally:
        await client.close()
    assert result.status == status
    if status != 200:
        assert result.json == {"reason": "BadPriority"}


# --- Matrix MSC3013 frames on a VoIP app ---------------------------------------------------


def _frame(devices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"notification": {**FRAME, **extra, "devices": devices}}


async def _post(gw: Any, body: dict[str, Any]) -> tuple[int, Any]:
    response = await gw.client.post(NOTIFY, data=json.dumps(body).encode())
    text = await response.text()
    return response.status, (json.loads(text) if response.status == 200 else text)


@pytest.mark.parametrize(
    "ios",
    [
        {"topic": VOIP_TOPIC, "push_type": "voip"},
        # A VoIP Services certificate's topic, Sygnal's default of no push type.
        {"topic": VOIP_TOPIC},
    ],
)
async def test_matrix_msc3013_frames_to_a_voip_app_go_as_voip(
    make_gateway: Callable[..., Any],
    apns: ApnsSimulator,
    register_secret: Callable[[str], None],
    ios: dict[str, Any],
) -> None:
    """An encrypted counts-only frame went out `apns-push-type: background` (and, without
    a configured push type, an event frame as `alert`) to the app's PushKit tokens:
    APNs answers InvalidPushType, the homeserver got 502 and retried for ever."""
    async with make_gateway(ios=ios) as gw:
        pushkey, hex_token = apns_pushkey()
        register_secret(hex_token)
        dev = device(IOS, pushkey, data={"algorithm": "com.famedly.curve25519-aes-sha2"})
        frames = [
            _frame([dev], is_counts_only=True),
            _frame([dev]),  # an event
            _frame([dev], counts={"unread": 3}),
        ]
        for body in frames:
            assert await _post(gw, body) == (200, {"rejected": []})
        assert [r.status for r in apns.requests] == [200, 200, 200]
        assert [r.headers["apns-topic"] for r in apns.requests] == [VOIP_TOPIC] * 3
        assert [r.headers["apns-push-type"] for r in apns.requests] == ["voip"] * 3
        boolean = apns.requests[0]
        assert boolean.json is not None
        assert boolean.json["aps"] == {"content-available": 1}
        assert {k: boolean.json[k] for k in FRAME} == FRAME


async def test_matrix_counts_only_frame_stays_background_on_an_alert_app(
    make_gateway: Callable[..., Any], apns: ApnsSimulator, register_secret: Callable[[str], None]
) -> None:
    async with make_gateway(ios={"push_type": "alert"}) as gw:
        pushkey, hex_token = apns_pushkey()
        register_secret(hex_token)
        body = _frame([device(IOS, pushkey)], is_counts_only=True)
        assert await _post(gw, body) == (200, {"rejected": []})
        (request,) = apns.requests
        assert (request.headers["apns-push-type"], request.headers["apns-priority"]) == (
            "background",
            "5",
        )


async def test_matrix_plain_notification_to_a_voip_topic_keeps_sygnals_headers(
    make_gateway: Callable[..., Any], apns: ApnsSimulator, register_secret: Callable[[str], None]
) -> None:
    """The Sygnal path is unchanged: no push type configured, no header (APNs takes it)."""
    async with make_gateway(ios={"topic": VOIP_TOPIC}) as gw:
        pushkey, hex_token = apns_pushkey()
        register_secret(hex_token)
        body = notification([device(IOS, pushkey)])
        assert await _post(gw, body) == (200, {"rejected": []})
        (request,) = apns.requests
        assert "apns-push-type" not in request.headers
        assert request.headers["apns-topic"] == VOIP_TOPIC


# --- the app's push type is checked when the configuration loads -------------------------


def _apns_settings(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    key = generate_apns_auth_key()
    return {
        "keyfile": key.write_p8(tmp_path / f"AuthKey_{key.key_id}.p8"),
        "key_id": key.key_id,
        "team_id": key.team_id,
        "topic": TOPIC,
        **overrides,
    }


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"push_type": "backgroud"}, "must be one of alert, background"),
        ({"push_type": "VOIP"}, "must be one of"),
        ({"push_type": "background", "topic": VOIP_TOPIC}, "InvalidPushType"),
        ({"push_type": "alert", "topic": TOPIC + ".complication"}, "set push_type complication"),
    ],
)
def test_a_push_type_apns_refuses_fails_the_config(
    tmp_path: Path, overrides: dict[str, Any], words: str
) -> None:
    """A typo, or a type the topic cannot take, passed check-config and then failed every
    push of the app with InvalidPushType."""
    with pytest.raises(ValidationError) as info:
        ApnsAppConfig(**_apns_settings(tmp_path, **overrides))
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "bound"),
    [
        ({}, None),
        ({"push_type": "alert"}, None),
        ({"push_type": "background"}, None),
        ({"push_type": "voip", "topic": VOIP_TOPIC}, "voip"),
        ({"topic": VOIP_TOPIC}, "voip"),
        ({"topic": TOPIC + ".voip-ptt"}, "pushtotalk"),
        ({"push_type": "widgets", "topic": TOPIC + ".push-type.widgets"}, "widgets"),
        ({"push_type": "mdm"}, None),
    ],
)
def test_bound_push_type(tmp_path: Path, overrides: dict[str, Any], bound: str | None) -> None:
    assert ApnsAppConfig(**_apns_settings(tmp_path, **overrides)).bound_push_type == bound


async def test_matrix_app_with_a_push_type_its_topic_refuses_fails_to_start(
    make_gateway: Callable[..., Any],
) -> None:
    with pytest.raises(Exception, match="InvalidPushType") as info:
        async with make_gateway(ios={"topic": VOIP_TOPIC, "push_type": "alert"}):
            pass
    assert IOS in str(info.value)

"""APNs rules as Apple states them, from an iOS engineer's seat.

Apple ("Sending notification requests to APNs"): a push type with a topic of its own
(`voip`, `complication`, `fileprovider`, `liveactivity`, `location`, `pushtotalk`,
`widgets`) must go to `<bundle id><suffix>` (`.voip`, `.complication`, ...). Sent to the
bundle id itself, APNs answers `DeviceTokenNotForTopic`: a token-invalid answer, so the
gateway ended a good registration for a sender's mistake. The core refuses such a push
before Apple sees it, the config refuses such an app, the simulator answers as Apple
does, and Marmot (which sends only `background`/`alert`) refuses a topic that takes
neither.
"""

from __future__ import annotations

import secrets
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from gateway.config import ApnsAppConfig
from gateway.core.apns import ApnsClient
from gateway.core.push import ApnsOptions, Outcome, Push, Reason
from gateway.testing import ApnsSimulator, generate_apns_auth_key
from plugins.marmot.config import MarmotConfig
from plugins.marmot.keys import ServerKey

TOPIC = "com.example.app"
OWN_TOPICS = [
    ("voip", ".voip"),
    ("complication", ".complication"),
    ("fileprovider", ".pushkit.fileprovider"),
    ("liveactivity", ".push-type.liveactivity"),
    ("location", ".location-query"),
    ("pushtotalk", ".voip-ptt"),
    ("widgets", ".push-type.widgets"),
]


def _token() -> str:
    return secrets.token_hex(32)


def _settings(tmp_path: Path, sim: ApnsSimulator | None = None, **overrides: Any) -> dict[str, Any]:
    key = generate_apns_auth_key()
    if sim is not None:
        sim.add_jwt_key(key.key_id, key.team_id, key.public_key)
    settings: dict[str, Any] = {
        "keyfile": key.write_p8(tmp_path / f"AuthKey_{key.key_id}.p8"),
        "key_id": key.key_id,
        "team_id": key.team_id,
        "topic": TOPIC,
    }
    if sim is not None:
        settings.update(host=sim.host, port=sim.port, ca_file=sim.ca_path, request_timeout=5.0)
    settings.update(overrides)
    return settings


@pytest.fixture
async def sim() -> AsyncIterator[ApnsSimulator]:
    async with ApnsSimulator() as simulator:
        yield simulator


@pytest.fixture
async def client(sim: ApnsSimulator, tmp_path: Path) -> AsyncIterator[ApnsClient]:
    apns = ApnsClient("ios", ApnsAppConfig(**_settings(tmp_path, sim)))
    await apns.start()
    yield apns
    await apns.close()


# --- the core refuses, before Apple, what Apple would take as a dead token --------------


@pytest.mark.parametrize(("push_type", "suffix"), OWN_TOPICS)
async def test_push_type_with_its_own_topic_to_the_bundle_id_is_refused_locally(
    client: ApnsClient, sim: ApnsSimulator, push_type: str, suffix: str
) -> None:
    token = _token()
    wrong = Push("test", "ios", token, {"aps": {}}, apns=ApnsOptions(push_type, priority=10))
    refusal = client.validate(wrong)
    assert refusal is not None
    assert (refusal.outcome, refusal.reason) == (Outcome.PERMANENT, Reason.INVALID_PAYLOAD)
    assert refusal.detail is not None and suffix in refusal.detail and token not in refusal.detail
    attempt = await client.send(wrong)
    assert attempt.outcome is Outcome.PERMANENT  # never token_invalid: the token is kept
    assert sim.requests == []  # Apple never saw it

    right = Push(
        "test", "ios", token, {"aps": {}}, apns=ApnsOptions(push_type, topic=TOPIC + suffix)
    )
    assert client.validate(right) is None
    assert (await client.send(right)).outcome is Outcome.OK
    assert sim.requests[-1].headers["apns-topic"] == TOPIC + suffix


async def test_a_bundle_id_that_merely_ends_like_a_suffix_still_takes_alerts(
    sim: ApnsSimulator, tmp_path: Path
) -> None:
    """Only the one direction is refused locally: `com.acme.voip` may be an app's own
    bundle id, to which Apple takes `alert` pushes."""
    apns = ApnsClient("ios", ApnsAppConfig(**_settings(tmp_path, sim, topic="com.acme.voip")))
    push = Push("test", "ios", _token(), {"aps": {"alert": "hi"}}, apns=ApnsOptions("alert"))
    assert apns.validate(push) is None


# --- the simulator answers as Apple does ----------------------------------------------


@pytest.mark.parametrize(("push_type", "suffix"), [OWN_TOPICS[0], OWN_TOPICS[3]])
async def test_simulator_answers_device_token_not_for_topic(
    sim: ApnsSimulator, push_type: str, suffix: str
) -> None:
    context = ssl.create_default_context(cafile=str(sim.ca_path))
    headers = {"apns-push-type": push_type, "apns-priority": "10"}
    async with httpx.AsyncClient(http2=True, verify=context) as http:
        url = f"{sim.url}/3/device/{_token()}"
        wrong = await http.post(url, content=b'{"aps":{}}', headers=headers | {"apns-topic": TOPIC})
        right = await http.post(
            url, content=b'{"aps":{}}', headers=headers | {"apns-topic": TOPIC + suffix}
        )
    assert (wrong.status_code, wrong.json()) == (400, {"reason": "DeviceTokenNotForTopic"})
    assert right.status_code == 200


# --- configuration --------------------------------------------------------------------


@pytest.mark.parametrize(("push_type", "suffix"), OWN_TOPICS)
def test_app_push_type_needs_its_topic(tmp_path: Path, push_type: str, suffix: str) -> None:
    with pytest.raises(ValidationError) as info:
        ApnsAppConfig(**_settings(tmp_path, push_type=push_type))
    assert f"set topic {TOPIC}{suffix}" in str(info.value)
    ok = ApnsAppConfig(**_settings(tmp_path, push_type=push_type, topic=TOPIC + suffix))
    assert ok.bound_push_type == push_type


def _marmot(app: dict[str, Any]) -> dict[str, Any]:
    return {
        "server_secret_key": ServerKey.generate().secret.hex(),
        "inbox_relays": ["wss://relay.example.org"],
        "apps": {"ios": {"type": "apns", "certfile": __file__, **app}},
        "apns": {"app": "ios"},
    }


@pytest.mark.parametrize(
    "app",
    [{"topic": TOPIC + ".voip"}, {"push_type": "voip"}, {"topic": TOPIC + ".voip-ptt"}],
)
def test_marmot_refuses_an_app_that_takes_no_background_push(app: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as info:
        MarmotConfig.model_validate(_marmot(app))
    assert "Marmot sends background or alert pushes" in str(info.value)
    assert MarmotConfig.model_validate(_marmot({"topic": TOPIC})).apns.app == "ios"

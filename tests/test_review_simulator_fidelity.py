"""Review: the provider simulators answer as Apple and Google do (simulator_fidelity seat).

- APNs: a provider token signed in the future is `InvalidProviderToken`; with
  `token_update_interval`, a key's token replaced too often is 429
  `TooManyProviderTokenUpdates`; a device token of the other environment (sandbox vs
  production) is `BadDeviceToken`.
- FCM: a token of another project is `SENDER_ID_MISMATCH`; a 401 about the access token
  has Google's `WWW-Authenticate` header and `ErrorInfo` reason, and the product's client
  gets past an access token that Google expired before the client expected.
"""

from __future__ import annotations

import asyncio
import datetime
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jwt as pyjwt
import pytest

from gateway.config import ApnsAppConfig, FcmAppConfig
from gateway.core.apns import ApnsClient, share_provider_tokens
from gateway.core.fcm import FcmClient
from gateway.core.push import ApnsOptions, Outcome, Push
from gateway.testing import (
    ApnsAuthKey,
    ApnsSimulator,
    FcmSimulator,
    SimulatorCA,
    generate_apns_auth_key,
    make_service_account,
)
from tests.testing.test_apns_sim import OTHER, TOKEN, RawH2Client, sign

PROJECT = "fidelity-project"
TOPIC = "com.example.app"
ERROR_INFO = "type.googleapis.com/google.rpc.ErrorInfo"
_DAY = datetime.timedelta(days=1)


class Clock:
    def __init__(self) -> None:
        self.now = float(int(time.time()))

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def key() -> ApnsAuthKey:
    return generate_apns_auth_key()


async def reason_for(client: RawH2Client, jwt: str | None, token: str = TOKEN) -> str | None:
    headers = {"apns-topic": TOPIC}
    if jwt is not None:
        headers["authorization"] = f"bearer {jwt}"
    result = await client.request(token, headers=headers)
    if result.status == 200:
        return None
    reason: str = result.json["reason"]
    return f"{result.status} {reason}"


# -- APNs: provider tokens ----------------------------------------------------------------


async def test_apns_jwt_issued_in_the_future_is_invalid_provider_token(key: ApnsAuthKey) -> None:
    clock = Clock()
    async with ApnsSimulator(jwt_keys={key.key_id: (key.team_id, key)}, clock=clock) as sim:
        client = await RawH2Client.connect(sim)
        try:
            now = int(clock.now)
            # a signer whose clock is an hour fast: Apple refuses the token
            assert await reason_for(client, sign(key, iat=now + 3600)) == (
                "403 InvalidProviderToken"
            )
            # a few seconds of skew is tolerated (`jwt_max_future`, 60 s by default)
            assert await reason_for(client, sign(key, iat=now + 30)) is None
            # the same future token becomes good once the simulator's clock catches up
            ahead = sign(key, iat=now + 600)
            assert await reason_for(client, ahead) == "403 InvalidProviderToken"
            clock.now += 600
            assert await reason_for(client, ahead) is None
        finally:
            await client.close()


async def test_apns_too_many_provider_token_updates(key: ApnsAuthKey) -> None:
    clock = Clock()
    other_key = generate_apns_auth_key(team_id=key.team_id)
    async with ApnsSimulator(
        jwt_keys={key.key_id: (key.team_id, key), other_key.key_id: (key.team_id, other_key)},
        clock=clock,
        token_update_interval=1200,
    ) as sim:
        client = await RawH2Client.connect(sim)
        try:
            now = int(clock.now)
            first = sign(key, iat=now)
            assert await reason_for(client, first) is None
            assert await reason_for(client, first) is None  # reuse is what Apple wants
            clock.now += 60
            second = sign(key, iat=now + 60)
            assert await reason_for(client, second) == "429 TooManyProviderTokenUpdates"
            assert await reason_for(client, first) is None  # the adopted token stays good
            # another key's token is its own: not an update of the first key's
            assert await reason_for(client, sign(other_key, iat=now + 60)) is None
            clock.now = now + 1200
            assert await reason_for(client, second) is None  # 20 minutes on: adopted
            assert await reason_for(client, first) is None  # still within its hour
        finally:
            await client.close()


async def test_apns_token_updates_are_unlimited_by_default(key: ApnsAuthKey) -> None:
    async with ApnsSimulator(jwt_keys={key.key_id: (key.team_id, key)}) as sim:
        client = await RawH2Client.connect(sim)
        try:
            now = int(time.time())
            for offset in range(3):
                assert await reason_for(client, sign(key, iat=now - offset)) is None
        finally:
            await client.close()


async def apns_client(
    sim: ApnsSimulator, key: ApnsAuthKey, tmp_path: Path, app_id: str, **overrides: Any
) -> ApnsClient:
    keyfile = key.write_p8(tmp_path / f"AuthKey_{key.key_id}.p8")
    settings: dict[str, Any] = {
        "keyfile": keyfile,
        "key_id": key.key_id,
        "team_id": key.team_id,
        "topic": TOPIC,
        "host": sim.host,
        "port": sim.port,
        "ca_file": sim.ca_path,
        "request_timeout": 2.0,
        **overrides,
    }
    return ApnsClient(app_id, ApnsAppConfig(**settings))


def apns_push(token: str, app_id: str) -> Push:
    return Push(
        plugin="test",
        app_id=app_id,
        token=token,
        payload={"aps": {"alert": "hi"}},
        apns=ApnsOptions(),
    )


async def test_product_apps_sharing_a_key_send_one_provider_token(
    key: ApnsAuthKey, tmp_path: Path
) -> None:
    """Two apps on one team key: the gateway signs one token for both, so an APNs that
    counts token updates answers both; without sharing, the second app's own token is
    refused, which is what the simulator now shows."""
    async with ApnsSimulator(token_update_interval=1200) as sim:
        sim.add_jwt_key(key.key_id, key.team_id, key)
        shared = [await apns_client(sim, key, tmp_path, name) for name in ("ios", "ios-beta")]
        share_provider_tokens(shared)
        apart = await apns_client(sim, key, tmp_path, "ios-apart")
        clients = [*shared, apart]
        for client in clients:
            await client.start()
        try:
            for client in shared:
                attempt = await client.send(apns_push(TOKEN, client.app_id))
                assert attempt.outcome is Outcome.OK, attempt
            attempt = await apart.send(apns_push(TOKEN, apart.app_id))
            assert (attempt.outcome, attempt.reason) == (
                Outcome.THROTTLED,
                "TooManyProviderTokenUpdates",
            )
            assert attempt.credential_wide
        finally:
            for client in clients:
                await client.close()


# -- APNs: environments --------------------------------------------------------------------


async def test_apns_token_of_the_other_environment_is_bad_device_token() -> None:
    async with ApnsSimulator() as sim:  # environment read from :authority
        sim.add_device(TOKEN, "sandbox")
        sim.add_device(OTHER, "production")
        client = await RawH2Client.connect(sim)  # sends `:authority: api.push.apple.com`
        try:
            assert await reason_for(client, None, TOKEN) == "400 BadDeviceToken"
            assert await reason_for(client, None, OTHER) is None
            assert await reason_for(client, None, "ef" * 32) is None  # never registered
        finally:
            await client.close()
    async with ApnsSimulator(environment="sandbox") as sim:
        sim.add_device(TOKEN, "sandbox")
        sim.add_device(OTHER, "production")
        client = await RawH2Client.connect(sim)
        try:
            assert await reason_for(client, None, TOKEN) is None
            assert await reason_for(client, None, OTHER) == "400 BadDeviceToken"
        finally:
            await client.close()
    with pytest.raises(ValueError, match="environment"):
        ApnsSimulator(environment="development")  # type: ignore[arg-type]


async def test_product_marks_a_production_token_sent_to_sandbox_invalid(
    key: ApnsAuthKey, tmp_path: Path
) -> None:
    async with ApnsSimulator(environment="sandbox") as sim:
        sim.add_jwt_key(key.key_id, key.team_id, key)
        sim.add_device(TOKEN, "production")
        sim.add_device(OTHER, "sandbox")
        client = await apns_client(sim, key, tmp_path, "ios", environment="sandbox")
        await client.start()
        try:
            attempt = await client.send(apns_push(TOKEN, "ios"))
            assert (attempt.outcome, attempt.reason) == (Outcome.TOKEN_INVALID, "BadDeviceToken")
            attempt = await client.send(apns_push(OTHER, "ios"))
            assert attempt.outcome is Outcome.OK
        finally:
            await client.close()


# -- FCM -----------------------------------------------------------------------------------


@pytest.fixture
async def fcm() -> AsyncIterator[tuple[FcmSimulator, Clock]]:
    clock = Clock()
    async with FcmSimulator(clock=clock) as sim:
        yield sim, clock


async def fcm_client(sim: FcmSimulator, tmp_path: Path, project: str = PROJECT) -> FcmClient:
    path = tmp_path / f"sa-{project}.json"
    info = make_service_account(project, sim.token_uri, path)
    sim.add_service_account(info)
    config = FcmAppConfig(
        service_account_file=path, send_url=sim.send_url_template, request_timeout=2.0
    )
    client = FcmClient(f"android-{project}", config)
    await client.start()
    return client


def fcm_push(token: str) -> Push:
    return Push(plugin="test", app_id="android", token=token, payload={"data": {"k": "v"}})


async def test_fcm_token_of_another_project_is_sender_id_mismatch(
    fcm: tuple[FcmSimulator, Clock], tmp_path: Path
) -> None:
    sim, _ = fcm
    sim.add_device("token-of-other", "other-project")
    sim.add_device("token-of-ours", PROJECT)
    client = await fcm_client(sim, tmp_path)
    try:
        attempt = await client.send(fcm_push("token-of-other"))
        assert (attempt.outcome, attempt.status, attempt.reason) == (
            Outcome.TOKEN_INVALID,
            403,
            "SENDER_ID_MISMATCH",
        )
        assert (await client.send(fcm_push("token-of-ours"))).outcome is Outcome.OK
        assert (await client.send(fcm_push("never-registered"))).outcome is Outcome.OK
    finally:
        await client.close()
    assert [r.error_code for r in sim.requests] == ["SENDER_ID_MISMATCH", None, None]


async def test_fcm_401_bodies_and_headers_are_googles(fcm: tuple[FcmSimulator, Clock]) -> None:
    sim, clock = fcm
    url = sim.send_url(PROJECT)
    message = {"message": {"token": "t", "data": {"k": "v"}}}
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=message) as resp:
            missing = (resp.status, resp.headers.get("WWW-Authenticate"), await resp.json())
        async with session.post(url, json=message, headers={"Authorization": "Bearer x"}) as resp:
            unknown = (resp.status, resp.headers.get("WWW-Authenticate"), await resp.json())
        async with session.post(
            sim.token_uri,
            data={"grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer", "assertion": ""},
        ) as resp:
            assert resp.status == 400
        # a token the simulator issued, then let expire
        info = make_service_account(PROJECT, sim.token_uri)
        sim.add_service_account(info)
        grant = _assertion(info, clock.now)
        async with session.post(
            sim.token_uri,
            data={"grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer", "assertion": grant},
        ) as resp:
            access = (await resp.json())["access_token"]
        clock.now += sim.token_lifetime + 1
        auth = {"Authorization": f"Bearer {access}"}
        async with session.post(url, json=message, headers=auth) as resp:
            expired = (resp.status, resp.headers.get("WWW-Authenticate"), await resp.json())

    realm = 'Bearer realm="https://accounts.google.com/"'
    assert missing[0] == 401
    assert missing[1] == realm
    assert missing[2]["error"]["message"].startswith("Request is missing required authentication")
    assert missing[2]["error"]["details"][0]["reason"] == "CREDENTIALS_MISSING"
    assert unknown[:2] == (401, realm + ', error="invalid_token"')
    assert "details" not in unknown[2]["error"]
    assert expired[:2] == (401, realm + ', error="invalid_token"')
    detail = expired[2]["error"]["details"][0]
    assert (detail["@type"], detail["reason"], detail["domain"]) == (
        ERROR_INFO,
        "ACCESS_TOKEN_EXPIRED",
        "googleapis.com",
    )
    assert expired[2]["error"]["status"] == "UNAUTHENTICATED"


def _assertion(info: dict[str, str], now: float) -> str:
    claims = {
        "iss": info["client_email"],
        "scope": "https://www.googleapis.com/auth/firebase.messaging",
        "aud": "https://oauth2.googleapis.com/token",
        "iat": int(now),
        "exp": int(now) + 3600,
    }
    return pyjwt.encode(
        claims, info["private_key"], algorithm="RS256", headers={"kid": info["private_key_id"]}
    )


async def test_product_gets_past_an_access_token_google_expired_early(tmp_path: Path) -> None:
    """Google ended the access token before the client expected (its clock runs ahead of
    this host's): one 401 ACCESS_TOKEN_EXPIRED, the refresh the dispatcher asks for on
    AUTH, and the push goes through with a new token."""
    clock = Clock()
    async with FcmSimulator(clock=clock, token_lifetime=600) as sim:
        client = await fcm_client(sim, tmp_path)
        try:
            assert (await client.send(fcm_push("t1"))).outcome is Outcome.OK
            issued = sim.tokens_issued
            clock.now += 601  # Google's clock: the token is over; ours says 599 s are left
            attempt = await client.send(fcm_push("t2"))
            assert (attempt.outcome, attempt.status) == (Outcome.AUTH, 401)
            await client.refresh_credentials()
            assert sim.tokens_issued == issued + 1
            attempt = await client.send(fcm_push("t2"))
            assert attempt.outcome is Outcome.OK, attempt
        finally:
            await client.close()
        assert sim.requests[1].status == 401


# -- APNs: certificate auth ---------------------------------------------------------------


async def cert_client(sim: ApnsSimulator, certfile: Path) -> ApnsClient:
    config = ApnsAppConfig(
        certfile=certfile,
        topic=TOPIC,
        host=sim.host,
        port=sim.port,
        ca_file=sim.ca_path,
        request_timeout=2.0,
    )
    client = ApnsClient("ios", config)
    await client.start()
    return client


async def first_bytes(sim: ApnsSimulator, certfile: Path) -> bytes:
    """What the server sends first to a TLS client presenting `certfile` (b"" when the
    connection ends without data; a TLS 1.3 server refuses the client's certificate
    after the client's side of the handshake is done)."""
    context = ssl.create_default_context(cafile=str(sim.ca_path))
    context.load_cert_chain(str(certfile))
    reader, writer = await asyncio.open_connection(
        sim.host, sim.port, ssl=context, server_hostname="api.push.apple.com"
    )
    try:
        return await asyncio.wait_for(reader.read(1 << 16), 5)
    except (ssl.SSLError, ConnectionError):
        return b""
    finally:
        writer.close()


async def test_apns_client_certificates_are_verified_at_the_handshake(tmp_path: Path) -> None:
    """Apple refuses an expired push certificate, or one it did not issue, at the TLS
    handshake; with `client_certificates` the simulator does too, and a connection with
    neither a certificate nor a provider token is `MissingProviderToken`."""
    now = datetime.datetime.now(datetime.UTC)
    async with ApnsSimulator(client_certificates=True) as sim:
        valid = sim.ca.issue_client_certificate(TOPIC)
        expired = sim.ca.issue_client_certificate(
            TOPIC, not_before=now - datetime.timedelta(days=400), not_after=now - _DAY
        )
        stranger = SimulatorCA(tmp_path / "other-ca")
        foreign = stranger.issue_client_certificate(TOPIC)

        client = await cert_client(sim, valid)
        try:
            assert (await client.send(apns_push(TOKEN, "ios"))).outcome is Outcome.OK
        finally:
            await client.close()
        assert "authorization" not in sim.requests[-1].headers

        opened = sim.connections_opened
        assert await first_bytes(sim, valid)  # the server's SETTINGS: the handshake passed
        assert sim.connections_opened == opened + 1
        for refused in (expired, foreign):
            assert await first_bytes(sim, refused) == b""  # TLS alert, then closed
        assert sim.connections_opened == opened + 1  # no HTTP/2 connection for either
        stranger.cleanup()

        raw = await RawH2Client.connect(sim)  # no certificate, no JWT
        try:
            assert await reason_for(raw, None) == "403 MissingProviderToken"
        finally:
            await raw.close()

"""The FCM simulator, driven by aiohttp and Google's own auth / Firebase libraries."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import firebase_admin
import google.auth.credentials
import google.auth.exceptions
import google.auth.transport.requests
import pytest
from firebase_admin import credentials, messaging
from google.oauth2 import service_account

from gateway.testing import FcmResponse, FcmSimulator, make_service_account
from gateway.testing.fcm_sim import FCM_ERROR_TYPE

PROJECT = "pushgw-test"  # the project of the plugin's fcm_service_account fixture
FCM_SCOPE = "https://www.googleapis.com/auth/firebase.messaging"


async def google_token(info: dict[str, str]) -> str:
    """Mint an access token with google-auth (off the loop: it uses requests)."""
    creds = service_account.Credentials.from_service_account_info(info, scopes=[FCM_SCOPE])
    await asyncio.to_thread(creds.refresh, google.auth.transport.requests.Request())
    assert isinstance(creds.token, str)
    return creds.token


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def bearer(fcm_service_account: dict[str, str]) -> str:
    return await google_token(fcm_service_account)


async def send(
    session: aiohttp.ClientSession,
    sim: FcmSimulator,
    message: dict[str, Any],
    bearer: str | None,
    project: str = PROJECT,
) -> tuple[int, dict[str, Any], aiohttp.ClientResponse]:
    headers = {"Authorization": f"Bearer {bearer}"} if bearer is not None else {}
    async with session.post(
        sim.send_url(project), json={"message": message}, headers=headers
    ) as resp:
        return resp.status, await resp.json(), resp


def fcm_error_code(body: dict[str, Any]) -> str | None:
    for detail in body["error"].get("details", []):
        if detail["@type"] == FCM_ERROR_TYPE:
            return str(detail["errorCode"])
    return None


def token_violation(body: dict[str, Any]) -> bool:
    return any(
        violation.get("field") == "message.token"
        for detail in body["error"].get("details", [])
        for violation in detail.get("fieldViolations", [])
    )


# -- OAuth -------------------------------------------------------------------------------


async def test_google_auth_mints_token_and_send_succeeds(
    fcm_simulator: FcmSimulator,
    fcm_service_account: dict[str, str],
    session: aiohttp.ClientSession,
) -> None:
    creds = service_account.Credentials.from_service_account_info(
        fcm_service_account, scopes=[FCM_SCOPE]
    )
    await asyncio.to_thread(creds.refresh, google.auth.transport.requests.Request())
    assert creds.token is not None and creds.token.startswith("ya29.")
    assert creds.expiry is not None
    assert fcm_simulator.tokens_issued == 1

    status, body, _ = await send(
        session, fcm_simulator, {"token": "tok-1", "data": {"k": "v"}}, creds.token
    )
    assert status == 200
    assert body == {"name": f"projects/{PROJECT}/messages/1"}
    [seen] = await fcm_simulator.wait_for_requests(1)
    assert (seen.project_id, seen.token, seen.status) == (PROJECT, "tok-1", 200)
    assert seen.message["data"] == {"k": "v"}
    assert seen.headers["Authorization"] == f"Bearer {creds.token}"
    assert fcm_simulator.tokens_issued == 1  # sending does not mint tokens


@pytest.mark.filterwarnings("ignore:Message.token is deprecated:DeprecationWarning")
async def test_firebase_admin_certificate_and_sdk_send(
    fcm_simulator: FcmSimulator,
    fcm_service_account: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SDK's own path, redirected as specs/providers.md §4.2 says."""
    # google-auth >= 2.5x starts a background "Regional Access Boundary" lookup at
    # iamcredentials.googleapis.com on the first authorized request; keep tests local.
    monkeypatch.setattr(
        google.auth.credentials.CredentialsWithRegionalAccessBoundary,
        "_is_regional_access_boundary_lookup_required",
        lambda self: False,
    )
    path = tmp_path / "sa.json"
    path.write_text(json.dumps(fcm_service_account))
    cred = credentials.Certificate(str(path))
    assert cred.project_id == PROJECT
    monkeypatch.setattr(
        messaging._MessagingService,
        "FCM_URL",
        fcm_simulator.send_url_template.replace("{project_id}", "{0}"),
    )
    app = firebase_admin.initialize_app(cred, name=f"sim-{uuid.uuid4()}")
    try:
        fcm_simulator.script("gone", FcmResponse.unregistered())
        name = await asyncio.to_thread(
            messaging.send, messaging.Message(token="tok-1", data={"a": "b"}), app=app
        )
        assert name == f"projects/{PROJECT}/messages/1"
        with pytest.raises(messaging.UnregisteredError):
            await asyncio.to_thread(messaging.send, messaging.Message(token="gone"), app=app)
        assert fcm_simulator.tokens_issued == 1
        assert [r.status for r in fcm_simulator.requests] == [200, 404]
    finally:
        # delete_app closes the SDK's async httpx client with asyncio.run(): not on our loop.
        await asyncio.to_thread(firebase_admin.delete_app, app)


async def test_bad_assertion_signature_is_refused(
    fcm_simulator: FcmSimulator, fcm_service_account: dict[str, str]
) -> None:
    forged = make_service_account(
        PROJECT, fcm_simulator.token_uri, client_email=fcm_service_account["client_email"]
    )
    forged["private_key_id"] = fcm_service_account["private_key_id"]
    with pytest.raises(google.auth.exceptions.RefreshError, match="invalid_grant"):
        await google_token(forged)
    stranger = make_service_account(PROJECT, fcm_simulator.token_uri, client_email="x@y.z")
    with pytest.raises(google.auth.exceptions.RefreshError, match="invalid_grant"):
        await google_token(stranger)
    assert fcm_simulator.tokens_issued == 0


async def test_any_well_formed_assertion_when_no_account_registered(
    fcm_simulator: FcmSimulator, session: aiohttp.ClientSession
) -> None:
    info = make_service_account("other", fcm_simulator.token_uri)
    token = await google_token(info)
    assert fcm_simulator.tokens_issued == 1
    status, _, _ = await send(session, fcm_simulator, {"token": "t"}, token, project="other")
    assert status == 200
    async with session.post(
        fcm_simulator.token_uri, data={"grant_type": "password", "assertion": "x"}
    ) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"] == "unsupported_grant_type"
    async with session.post(
        fcm_simulator.token_uri,
        data={"grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer", "assertion": "a.b"},
    ) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"] == "invalid_grant"


async def test_401_then_refresh_then_valid(
    fcm_simulator: FcmSimulator,
    fcm_service_account: dict[str, str],
    session: aiohttp.ClientSession,
) -> None:
    status, body, _ = await send(session, fcm_simulator, {"token": "t"}, "ya29.unknown")
    assert status == 401
    assert body["error"]["status"] == "UNAUTHENTICATED"
    assert "details" not in body["error"]  # no FcmError: an OAuth problem, refresh once
    status, _, _ = await send(session, fcm_simulator, {"token": "t"}, None)
    assert status == 401

    first = await google_token(fcm_service_account)
    assert (await send(session, fcm_simulator, {"token": "t"}, first))[0] == 200
    fcm_simulator.revoke_tokens()
    assert (await send(session, fcm_simulator, {"token": "t"}, first))[0] == 401
    second = await google_token(fcm_service_account)
    assert second != first
    assert (await send(session, fcm_simulator, {"token": "t"}, second))[0] == 200
    assert fcm_simulator.tokens_issued == 2
    assert [r.status for r in fcm_simulator.requests] == [401, 401, 200, 401, 200]


async def test_token_expiry_follows_clock(session: aiohttp.ClientSession) -> None:
    now = [1_800_000_000.0]
    async with FcmSimulator(clock=lambda: now[0], token_lifetime=60) as sim:
        async with session.post(
            sim.token_uri,
            data={
                "grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer",
                "assertion": _unsigned_assertion(now[0]),
            },
        ) as resp:
            grant = await resp.json()
        assert grant["expires_in"] == 60 and grant["token_type"] == "Bearer"
        assert (await send(session, sim, {"token": "t"}, grant["access_token"]))[0] == 200
        now[0] += 61
        assert (await send(session, sim, {"token": "t"}, grant["access_token"]))[0] == 401


def _unsigned_assertion(now: float, scope: str | None = FCM_SCOPE) -> str:
    import base64

    def part(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    claims: dict[str, Any] = {"iss": "a@b.c", "iat": int(now), "exp": int(now) + 3600}
    if scope is not None:
        claims["scope"] = scope
    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2ln"


async def test_token_of_another_project_is_permission_denied(
    fcm_simulator: FcmSimulator, bearer: str, session: aiohttp.ClientSession
) -> None:
    status, body, _ = await send(session, fcm_simulator, {"token": "t"}, bearer, "elsewhere")
    assert (status, body["error"]["status"]) == (403, "PERMISSION_DENIED")
    assert fcm_error_code(body) is None


# -- scripted errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "status", "canonical", "code", "names_token"),
    [
        (FcmResponse.unregistered(), 404, "NOT_FOUND", "UNREGISTERED", False),
        (FcmResponse.invalid_token(), 400, "INVALID_ARGUMENT", "INVALID_ARGUMENT", True),
        (FcmResponse.invalid_argument(), 400, "INVALID_ARGUMENT", "INVALID_ARGUMENT", False),
        (FcmResponse.sender_id_mismatch(), 403, "PERMISSION_DENIED", "SENDER_ID_MISMATCH", False),
        (FcmResponse.permission_denied(), 403, "PERMISSION_DENIED", None, False),
        (
            FcmResponse.third_party_auth_error(),
            401,
            "UNAUTHENTICATED",
            "THIRD_PARTY_AUTH_ERROR",
            False,
        ),
        (FcmResponse.unauthenticated(), 401, "UNAUTHENTICATED", None, False),
        (FcmResponse.quota_exceeded(), 429, "RESOURCE_EXHAUSTED", "QUOTA_EXCEEDED", False),
        (FcmResponse.unavailable(), 503, "UNAVAILABLE", "UNAVAILABLE", False),
        (FcmResponse.internal(), 500, "INTERNAL", "INTERNAL", False),
    ],
)
async def test_scripted_error_envelopes(
    fcm_simulator: FcmSimulator,
    bearer: str,
    session: aiohttp.ClientSession,
    response: FcmResponse,
    status: int,
    canonical: str,
    code: str | None,
    names_token: bool,
) -> None:
    fcm_simulator.script("tok", response)
    got_status, body, resp = await send(session, fcm_simulator, {"token": "tok"}, bearer)
    assert got_status == status
    assert body["error"]["code"] == status
    assert body["error"]["status"] == canonical
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert fcm_error_code(body) == code
    assert token_violation(body) is names_token
    assert "Retry-After" not in resp.headers
    [seen] = fcm_simulator.requests
    assert (seen.status, seen.error_code) == (status, code)


async def test_quota_failure_detail_and_retry_after(
    fcm_simulator: FcmSimulator, bearer: str, session: aiohttp.ClientSession
) -> None:
    fcm_simulator.script("a", FcmResponse.quota_exceeded(retry_after=30))
    fcm_simulator.script("b", FcmResponse.unavailable(retry_after=1))
    status, body, resp = await send(session, fcm_simulator, {"token": "a"}, bearer)
    assert (status, resp.headers["Retry-After"]) == (429, "30")
    types = [d["@type"] for d in body["error"]["details"]]
    assert "type.googleapis.com/google.rpc.QuotaFailure" in types
    status, _, resp = await send(session, fcm_simulator, {"token": "b"}, bearer)
    assert (status, resp.headers["Retry-After"]) == (503, "1")


async def test_script_order_and_script_all(
    fcm_simulator: FcmSimulator, bearer: str, session: aiohttp.ClientSession
) -> None:
    fcm_simulator.script("t", FcmResponse.unavailable(), FcmResponse.ok())
    statuses = [(await send(session, fcm_simulator, {"token": "t"}, bearer))[0] for _ in range(3)]
    assert statuses == [503, 200, 200]

    fcm_simulator.script_all(FcmResponse.quota_exceeded(), FcmResponse.ok())
    assert (await send(session, fcm_simulator, {"token": "x"}, bearer))[0] == 429
    assert (await send(session, fcm_simulator, {"token": "y"}, bearer))[0] == 200
    fcm_simulator.script_all(FcmResponse.quota_exceeded(), project_id="elsewhere")
    fcm_simulator.script_all()
    assert (await send(session, fcm_simulator, {"token": "x"}, bearer))[0] == 200


async def test_drop_closes_without_answer(
    fcm_simulator: FcmSimulator, bearer: str, session: aiohttp.ClientSession
) -> None:
    fcm_simulator.script("t", FcmResponse.drop())
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await send(session, fcm_simulator, {"token": "t"}, bearer)
    [seen] = await fcm_simulator.wait_for_requests(1)
    assert seen.fault == "drop"
    assert (await send(session, fcm_simulator, {"token": "ok"}, bearer))[0] == 200


async def test_delay_does_not_block_other_sends(
    fcm_simulator: FcmSimulator, bearer: str, session: aiohttp.ClientSession
) -> None:
    fcm_simulator.script("slow", FcmResponse.ok(delay=0.3))
    slow = asyncio.ensure_future(send(session, fcm_simulator, {"token": "slow"}, bearer))
    await fcm_simulator.wait_for_requests(1)
    fast = asyncio.ensure_future(send(session, fcm_simulator, {"token": "fast"}, bearer))
    done, _ = await asyncio.wait({slow, fast}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    assert done == {fast}
    assert (await slow)[0] == 200


# -- validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message",
    [
        {"token": "t", "data": {"from": "x"}},
        {"token": "t", "data": {"message_type": "x"}},
        {"token": "t", "data": {"google.c.a": "x"}},
        {"token": "t", "data": {"gcm.n.e": "x"}},
        {"token": "t", "data": {"n": 3}},
        {"token": "t", "data": {"n": None}},
        {"token": "t", "data": ["x"]},
        {"token": "t", "data": {"k": "x" * 4090}},
        {"token": "t", "android": {"ttl": "3600"}},
        {"token": "t", "android": {"ttl": "2419201s"}},
        {"token": "t", "android": {"ttl": 60}},
        {"token": "t", "android": {"priority": "urgent"}},
        {"token": "t", "topic": "news"},
        {"data": {"k": "v"}},
    ],
)
async def test_invalid_messages_are_invalid_argument_not_token(
    fcm_simulator: FcmSimulator,
    bearer: str,
    session: aiohttp.ClientSession,
    message: dict[str, Any],
) -> None:
    status, body, _ = await send(session, fcm_simulator, message, bearer)
    assert status == 400
    assert body["error"]["status"] == "INVALID_ARGUMENT"
    assert fcm_error_code(body) == "INVALID_ARGUMENT"
    assert not token_violation(body)


async def test_empty_token_names_the_token_field(
    fcm_simulator: FcmSimulator, bearer: str, session: aiohttp.ClientSession
) -> None:
    status, body, _ = await send(session, fcm_simulator, {"token": ""}, bearer)
    assert status == 400
    assert token_violation(body)


async def test_data_size_limit_and_valid_fields(
    fcm_simulator: FcmSimulator, bearer: str, session: aiohttp.ClientSession
) -> None:
    def data_of(size: int) -> dict[str, str]:
        overhead = len('{"k":""}')
        return {"k": "x" * (size - overhead)}

    assert len(json.dumps(data_of(4096), separators=(",", ":"))) == 4096
    ok = {
        "token": "t",
        "data": data_of(4096),
        "android": {"ttl": "1.5s", "priority": "high", "collapse_key": "c"},
    }
    assert (await send(session, fcm_simulator, ok, bearer))[0] == 200
    too_big = {"token": "t", "data": data_of(4097)}
    assert (await send(session, fcm_simulator, too_big, bearer))[0] == 400
    assert (await send(session, fcm_simulator, {"topic": "news"}, bearer))[0] == 200


async def test_malformed_body(
    fcm_simulator: FcmSimulator, bearer: str, session: aiohttp.ClientSession
) -> None:
    async with session.post(
        fcm_simulator.send_url(PROJECT),
        data=b"{nope",
        headers={"Authorization": f"Bearer {bearer}"},
    ) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["status"] == "INVALID_ARGUMENT"


async def test_wait_for_requests_times_out(fcm_simulator: FcmSimulator) -> None:
    with pytest.raises(TimeoutError, match="0 of 2"):
        await fcm_simulator.wait_for_requests(2, timeout=0.05)


# -- TLS ---------------------------------------------------------------------------------


async def test_tls_mode(session: aiohttp.ClientSession, tmp_path: Path) -> None:
    async with FcmSimulator(tls=True) as sim:
        assert sim.url.startswith("https://") and sim.ca_path is not None
        info = make_service_account("tls-proj", sim.token_uri, path=tmp_path / "sa.json")
        assert json.loads((tmp_path / "sa.json").read_text()) == info
        sim.add_service_account(info)
        ctx = ssl.create_default_context(cafile=str(sim.ca_path))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as tls:
            token = await _token_with(tls, sim, info)
            status, body, _ = await send(tls, sim, {"token": "t"}, token, "tls-proj")
        assert (status, body["name"]) == (200, "projects/tls-proj/messages/1")


async def _token_with(
    session: aiohttp.ClientSession, sim: FcmSimulator, info: dict[str, str]
) -> str:
    creds = service_account.Credentials.from_service_account_info(info, scopes=[FCM_SCOPE])
    assertion = creds._make_authorization_grant_assertion()
    async with session.post(
        sim.token_uri,
        data={
            "grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer",
            "assertion": assertion if isinstance(assertion, str) else assertion.decode(),
        },
    ) as resp:
        assert resp.status == 200
        return str((await resp.json())["access_token"])


# -- what Google refuses, the simulator refuses ------------------------------------------


async def test_assertion_without_scope_is_refused(
    fcm_simulator: FcmSimulator, fcm_service_account: dict[str, str]
) -> None:
    """Google's token endpoint answers 400 `invalid_scope` to a JWT-bearer grant whose
    assertion names no scope (specs/providers.md §3.1: the scope is firebase.messaging);
    issuing a token anyway would hide a gateway that forgot it."""
    creds = service_account.Credentials.from_service_account_info(fcm_service_account)
    with pytest.raises(google.auth.exceptions.RefreshError, match="invalid_scope"):
        await asyncio.to_thread(creds.refresh, google.auth.transport.requests.Request())
    assert fcm_simulator.tokens_issued == 0


async def test_assertion_without_scope_is_refused_with_no_account_registered(
    fcm_simulator: FcmSimulator, session: aiohttp.ClientSession
) -> None:
    assertion = _unsigned_assertion(time.time(), scope=None)
    async with session.post(
        fcm_simulator.token_uri,
        data={"grant_type": "urn:ietf:params:oauth:grant-type:jwt-bearer", "assertion": assertion},
    ) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"] == "invalid_scope"
    assert fcm_simulator.tokens_issued == 0


@pytest.mark.parametrize(
    ("message", "name", "where"),
    [
        ({"token": "t", "priority": "high"}, "priority", "message"),  # legacy API's place
        ({"token": "t", "andriod": {}}, "andriod", "message"),
        ({"token": "t", "android": {"time_to_live": 60}}, "time_to_live", "message.android"),
    ],
)
async def test_unknown_message_fields_are_refused(
    fcm_simulator: FcmSimulator,
    bearer: str,
    session: aiohttp.ClientSession,
    message: dict[str, Any],
    name: str,
    where: str,
) -> None:
    """FCM parses the message into its protobuf and refuses names it does not know:
    a field in the wrong place (or misspelt) is a 400 there, not a silent success."""
    status, body, _ = await send(session, fcm_simulator, message, bearer)
    assert status == 400
    error = body["error"]
    expected = (
        f"Invalid JSON payload received. Unknown name \"{name}\" at '{where}': Cannot find field."
    )
    assert (error["status"], error["message"]) == ("INVALID_ARGUMENT", expected)
    [violation] = error["details"][0]["fieldViolations"]
    assert violation == {"field": where, "description": expected}
    assert not token_violation(body)


async def test_every_documented_message_field_is_accepted(
    fcm_simulator: FcmSimulator, bearer: str, session: aiohttp.ClientSession
) -> None:
    message = {
        "token": "t",
        "name": "",
        "data": {"k": "v"},
        "notification": {"title": "t"},
        "android": {
            "collapse_key": "c",
            "priority": "high",
            "ttl": "60s",
            "restricted_package_name": "com.example",
            "data": {"k": "v"},
            "notification": {"title": "t"},
            "fcm_options": {"analytics_label": "l"},
            "direct_boot_ok": True,
            "collapseKey": "c",  # proto3 JSON names are accepted too
            "directBootOk": True,
        },
        "apns": {"headers": {"apns-priority": "10"}},
        "webpush": {"headers": {}},
        "fcm_options": {"analytics_label": "l"},
        "fcmOptions": {"analyticsLabel": "l"},
    }
    assert (await send(session, fcm_simulator, message, bearer))[0] == 200

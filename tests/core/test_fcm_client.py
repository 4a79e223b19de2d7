"""FcmClient against the FCM simulator (gateway.testing)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import FcmAppConfig
from gateway.core.fcm import FcmClient
from gateway.core.push import Attempt, Outcome, Push, PushPolicy, Reason
from gateway.testing import FcmResponse, FcmSimulator, make_service_account
from tests.core.conftest import logged_text, nested

PROJECT = "pushgw-test"
MakeClient = Callable[..., Awaitable[FcmClient]]


def token() -> str:
    return "fcm-" + secrets.token_urlsafe(24)


def push_for(tok: str, payload: dict[str, Any] | None = None, **policy: Any) -> Push:
    return Push(
        plugin="test",
        app_id="android",
        token=tok,
        payload=payload if payload is not None else {"data": {"k": "v"}},
        policy=PushPolicy(**policy),
    )


def data_of_size(size: int) -> dict[str, str]:
    base = len(json.dumps({"x": ""}, separators=(",", ":")).encode())
    return {"x": "a" * (size - base)}


@pytest.fixture(autouse=True)
def no_credentials_in_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    yield
    text = logged_text(caplog)
    assert "ya29." not in text  # the simulator's access-token prefix
    assert "PRIVATE KEY" not in text


@pytest.fixture
async def sim() -> AsyncIterator[FcmSimulator]:
    async with FcmSimulator() as simulator:
        yield simulator


def remember_token(client: FcmClient, secrets_seen: set[str]) -> None:
    if client._headers is not None:
        secrets_seen.add(client._headers["Authorization"].split()[1])


@pytest.fixture
async def make_client(
    sim: FcmSimulator, tmp_path: Path, secrets_seen: set[str]
) -> AsyncIterator[MakeClient]:
    clients: list[FcmClient] = []

    async def make(
        *, simulator: FcmSimulator | None = None, start: bool = True, **overrides: Any
    ) -> FcmClient:
        target = simulator or sim
        path = tmp_path / f"sa-{len(clients)}.json"
        info = make_service_account(PROJECT, target.token_uri, path)
        target.add_service_account(info)
        settings: dict[str, Any] = {
            "service_account_file": path,
            "send_url": target.send_url_template,
            "request_timeout": 2.0,
            **overrides,
        }
        client = FcmClient("android", FcmAppConfig(**settings))
        clients.append(client)
        if start:
            await client.start()
            remember_token(client, secrets_seen)
        return client

    yield make
    for client in clients:
        await client.close()


async def send(client: FcmClient, push: Push, secrets_seen: set[str]) -> Attempt:
    secrets_seen.add(push.token)
    assert client.validate(push) is None
    attempt = await client.send(push)
    remember_token(client, secrets_seen)
    return attempt


# --- success and OAuth ------------------------------------------------------------------


async def test_success_and_token_reuse(
    sim: FcmSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client()
    assert client.ready()
    assert client.project_id == PROJECT
    tokens = [token() for _ in range(20)]
    payload = {"data": {"k": "vé"}, "android": {"priority": "high", "ttl": "60s"}}
    results = await asyncio.gather(
        *(send(client, push_for(t, payload), secrets_seen) for t in tokens)
    )
    assert {r.outcome for r in results} == {Outcome.OK}
    assert all(
        r.provider_id and r.provider_id.startswith(f"projects/{PROJECT}/messages/") for r in results
    )
    assert sim.tokens_issued == 1
    assert client.token_fetches == 1
    request = sim.requests[0]
    assert request.project_id == PROJECT
    assert request.message == {**payload, "token": request.token}
    assert request.headers["Authorization"].startswith("Bearer ")
    assert {r.token for r in sim.requests} == set(tokens)


async def test_project_id_from_service_account(
    sim: FcmSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client(project_id=None)
    assert client.project_id == PROJECT
    assert client.send_url == sim.send_url(PROJECT)


async def test_401_is_auth_and_refresh_fetches_once(
    sim: FcmSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client()
    sim.revoke_tokens()
    tok = token()
    results = await asyncio.gather(*(send(client, push_for(tok), secrets_seen) for _ in range(5)))
    assert {(r.outcome, r.reason, r.status) for r in results} == {
        (Outcome.AUTH, "UNAUTHENTICATED", 401)
    }
    # every failed send's retry path calls refresh_credentials: one fetch in total
    await asyncio.gather(*(client.refresh_credentials() for _ in range(5)))
    await client.refresh_credentials()
    assert sim.tokens_issued == 2
    assert (await send(client, push_for(tok), secrets_seen)).outcome is Outcome.OK


async def test_refresh_credentials_without_failure_forces_a_fetch(
    sim: FcmSimulator, make_client: MakeClient
) -> None:
    client = await make_client()
    await client.refresh_credentials()
    assert sim.tokens_issued == 2


async def test_background_refresh_ahead_of_expiry(
    sim: FcmSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client()
    client._refresh_at = 0.0  # inside the refresh-ahead window, token still valid
    results = await asyncio.gather(
        *(send(client, push_for(token()), secrets_seen) for _ in range(10))
    )
    assert {r.outcome for r in results} == {Outcome.OK}
    assert client._background is not None
    await client._background
    assert sim.tokens_issued == 2  # one background refresh for all ten sends
    assert time.monotonic() < client._refresh_at


async def test_expired_token_is_fetched_once_for_concurrent_sends(
    sim: FcmSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client(start=False)
    await client.start()
    client._refresh_at = client._expires_at = 0.0
    results = await asyncio.gather(
        *(send(client, push_for(token()), secrets_seen) for _ in range(10))
    )
    assert {r.outcome for r in results} == {Outcome.OK}
    assert sim.tokens_issued == 2


async def test_short_lived_tokens_refresh_before_expiry(
    sim: FcmSimulator, make_client: MakeClient
) -> None:
    sim.token_lifetime = 120
    client = await make_client()
    lifetime = client._expires_at - time.monotonic()
    ahead = client._refresh_at - time.monotonic()
    assert 100 < lifetime <= 120
    assert 50 < ahead <= 60  # half the lifetime when shorter than 2 x 5 min


async def test_token_uri_override(
    sim: FcmSimulator, tmp_path: Path, secrets_seen: set[str]
) -> None:
    path = tmp_path / "sa.json"
    info = make_service_account(PROJECT, "http://127.0.0.1:9/never-used", path)
    sim.add_service_account(info)
    config = FcmAppConfig(
        service_account_file=path, send_url=sim.send_url_template, token_uri=sim.token_uri
    )
    client = FcmClient("android", config)
    await client.start()
    try:
        remember_token(client, secrets_seen)
        assert client.token_uri == sim.token_uri
        assert (await send(client, push_for(token()), secrets_seen)).outcome is Outcome.OK
    finally:
        await client.close()
    assert sim.tokens_issued == 1


async def test_token_endpoint_down(tmp_path: Path, secrets_seen: set[str]) -> None:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "sa.json"
    make_service_account(PROJECT, f"http://127.0.0.1:{port}/token", path)
    client = FcmClient(
        "android",
        FcmAppConfig(service_account_file=path, send_url=f"http://127.0.0.1:{port}/{{project_id}}"),
    )
    await client.start()  # logs, does not raise
    try:
        assert not client.ready()
        attempt = await send(client, push_for(token()), secrets_seen)
        assert attempt.outcome in (Outcome.TRANSIENT, Outcome.AUTH)
        assert attempt.reason in (Reason.CONNECTION_ERROR, "oauth_token_error")
        await client.refresh_credentials()  # logs, never raises
    finally:
        await client.close()


async def test_https_simulator_with_ca_file(
    make_client: MakeClient, secrets_seen: set[str]
) -> None:
    async with FcmSimulator(tls=True) as tls_sim:
        assert tls_sim.ca_path is not None
        client = await make_client(simulator=tls_sim, ca_file=tls_sim.ca_path)
        assert client.ready()
        assert (await send(client, push_for(token()), secrets_seen)).outcome is Outcome.OK
        await client.close()


# --- error classes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "outcome", "reason", "wide", "retry_after"),
    [
        (FcmResponse.unregistered(), Outcome.TOKEN_INVALID, "UNREGISTERED", False, None),
        (FcmResponse.invalid_token(), Outcome.TOKEN_INVALID, "INVALID_ARGUMENT", False, None),
        (
            FcmResponse.invalid_argument("bad ttl", field="message.android.ttl"),
            Outcome.PERMANENT,
            "INVALID_ARGUMENT",
            False,
            None,
        ),
        (FcmResponse.invalid_argument(), Outcome.PERMANENT, "INVALID_ARGUMENT", False, None),
        (
            FcmResponse.sender_id_mismatch(),
            Outcome.TOKEN_INVALID,
            "SENDER_ID_MISMATCH",
            False,
            None,
        ),
        (FcmResponse.permission_denied(), Outcome.PERMANENT, "PERMISSION_DENIED", False, None),
        (
            FcmResponse.third_party_auth_error(),
            Outcome.PERMANENT,
            "THIRD_PARTY_AUTH_ERROR",
            False,
            None,
        ),
        (FcmResponse.unauthenticated(), Outcome.AUTH, "UNAUTHENTICATED", False, None),
        (
            FcmResponse.quota_exceeded(retry_after=30),
            Outcome.THROTTLED,
            "QUOTA_EXCEEDED",
            True,
            30.0,
        ),
        (FcmResponse.quota_exceeded(), Outcome.THROTTLED, "QUOTA_EXCEEDED", True, None),
        (FcmResponse.unavailable(retry_after=1), Outcome.TRANSIENT, "UNAVAILABLE", False, 1.0),
        (FcmResponse.internal(), Outcome.TRANSIENT, "INTERNAL", False, None),
        (FcmResponse.drop(), Outcome.TRANSIENT, Reason.CONNECTION_ERROR, False, None),
    ],
)
async def test_error_classes(
    sim: FcmSimulator,
    make_client: MakeClient,
    secrets_seen: set[str],
    response: FcmResponse,
    outcome: Outcome,
    reason: str,
    wide: bool,
    retry_after: float | None,
) -> None:
    client = await make_client()
    tok = token()
    sim.script(tok, response)
    attempt = await send(client, push_for(tok), secrets_seen)
    assert attempt.outcome is outcome
    assert attempt.reason == reason
    assert attempt.credential_wide is wide
    assert attempt.retry_after == retry_after
    assert attempt.detail is None or tok not in attempt.detail


async def test_timeout_is_transient(
    sim: FcmSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client(request_timeout=0.3)
    tok = token()
    sim.script(tok, FcmResponse.ok(delay=2.0))
    attempt = await send(client, push_for(tok), secrets_seen)
    # ended by the timeout: waited for, the simulator's answer would have been OK
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.TIMEOUT)


async def test_connection_refused_is_transient(
    make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client()
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client.send_url = f"http://127.0.0.1:{port}/v1/projects/{PROJECT}/messages:send"
    attempt = await send(client, push_for(token()), secrets_seen)
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.CONNECTION_ERROR)


# --- validation ---------------------------------------------------------------------------


async def test_data_size_limit(
    sim: FcmSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client()
    tok = token()
    exact = push_for(tok, {"data": data_of_size(4096)})
    assert (await send(client, exact, secrets_seen)).outcome is Outcome.OK
    over = push_for(tok, {"data": data_of_size(4097)})
    refusal = client.validate(over)
    assert refusal is not None
    assert (refusal.outcome, refusal.reason) == (Outcome.PERMANENT, Reason.PAYLOAD_TOO_LARGE)
    small_limit = push_for(tok, {"data": data_of_size(600)}, max_payload_bytes=512)
    assert client.validate(small_limit) is not None
    assert len(sim.requests) == 1


@pytest.mark.parametrize(
    ("value", "encoded_bytes"),
    [
        ("\x01", 6),  # escaped as \u0001
        ("\u00e9", 2),
        ("\U0001f600", 4),
        ('"', 2),
    ],
)
async def test_data_size_counts_encoded_bytes(
    make_client: MakeClient, value: str, encoded_bytes: int
) -> None:
    """The limit applies to the compact UTF-8 JSON of `data`, not to its characters."""
    client = await make_client()
    overhead = len('{"k":""}')
    fits = (4096 - overhead) // encoded_bytes
    assert client.validate(push_for(token(), {"data": {"k": value * fits}})) is None
    refusal = client.validate(push_for(token(), {"data": {"k": value * (fits + 1)}}))
    assert refusal is not None and refusal.reason == Reason.PAYLOAD_TOO_LARGE


@pytest.mark.parametrize(
    "payload",
    [
        {"data": {"n": 1}},
        {"data": {"flag": True}},
        {"data": {"nested": {"a": "b"}}},
        {"data": {"from": "x"}},
        {"data": {"message_type": "x"}},
        {"data": {"google.c.a": "x"}},
        {"data": {"gcm.notification": "x"}},
        {"data": {"Google_x": "x"}},
        {"data": ["not", "a", "map"]},
        {"topic": "news"},
        {"token": "other"},
    ],
)
async def test_invalid_payloads_refused(make_client: MakeClient, payload: dict[str, Any]) -> None:
    client = await make_client(start=False)
    refusal = client.validate(push_for(token(), payload))
    assert refusal is not None
    assert (refusal.outcome, refusal.reason) == (Outcome.PERMANENT, Reason.INVALID_PAYLOAD)


@pytest.mark.parametrize("value", [float("nan"), nested(100_000)])  # deep: beyond the stack
async def test_unencodable_message_refused_without_a_request(
    make_client: MakeClient, sim: FcmSimulator, value: object
) -> None:
    # JSON encodability is checked where the body is encoded (once per send)
    client = await make_client()
    attempt = await client.send(push_for(token(), {"android": {"x": value}}))
    assert (attempt.outcome, attempt.reason) == (Outcome.PERMANENT, Reason.INVALID_PAYLOAD)
    assert attempt.status is None
    assert sim.requests == []


async def test_send_before_start_is_transient(make_client: MakeClient) -> None:
    client = await make_client(start=False)
    assert not client.ready()
    assert (await client.send(push_for(token()))).outcome is Outcome.TRANSIENT


async def test_a_large_data_map_with_a_lone_surrogate_is_refused_not_raised(
    make_client: MakeClient,
) -> None:
    """`json.loads` turns an escaped `"\\ud800"` from a plugin's ingress into a lone
    surrogate, which has no UTF-8 encoding: a data map large enough to be measured must
    be refused `invalid_payload`, not raise UnicodeEncodeError out of `validate()` (the
    dispatcher calls it unguarded: the caller got an exception instead of a receipt)."""
    client = await make_client(start=False)
    refusal = client.validate(push_for(token(), {"data": {"k": "\ud800" + "a" * 1000}}))
    assert refusal is not None
    assert (refusal.outcome, refusal.reason) == (Outcome.PERMANENT, Reason.INVALID_PAYLOAD)

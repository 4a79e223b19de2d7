"""Review: outbound trust. Every provider and relay connection verifies its server's
certificate and host name, refuses before any credential is sent, says why, and speaks
HTTP/2 to APNs only when the server negotiated it (ALPN h2)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection, serve

from gateway.config import ApnsAppConfig, FcmAppConfig
from gateway.config.apps import CredentialError
from gateway.core.apns import ApnsClient
from gateway.core.fcm import FcmClient
from gateway.core.http import ssl_context
from gateway.core.push import ApnsOptions, Outcome, Push, Reason
from gateway.testing import (
    ApnsSimulator,
    FcmSimulator,
    generate_apns_auth_key,
    make_service_account,
)
from gateway.testing.certs import SimulatorCA
from plugins.marmot.keys import ServerKey
from plugins.marmot.relay import RelayClient, RelaySettings, RelayState
from tests.core.conftest import logged_text


@pytest.fixture(autouse=True)
def no_env_trust_store(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only what a test configures is trusted.
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    monkeypatch.delenv("https_proxy", raising=False)


def apns_push() -> Push:
    return Push(
        plugin="t",
        app_id="ios",
        token=secrets.token_hex(32),
        payload={"aps": {"alert": "x"}},
        apns=ApnsOptions(),
    )


async def apns_client(
    tmp_path: Path, host: str, port: int, ca_file: Path | None, sim: ApnsSimulator | None = None
) -> ApnsClient:
    key = generate_apns_auth_key()
    keyfile = key.write_p8(tmp_path / f"AuthKey_{key.key_id}.p8")
    if sim is not None:
        sim.add_jwt_key(key.key_id, key.team_id, key.public_key)
    config = ApnsAppConfig(
        keyfile=keyfile,
        key_id=key.key_id,
        team_id=key.team_id,
        topic="com.example.app",
        host=host,
        port=port,
        ca_file=ca_file,
        request_timeout=1.0,
    )
    client = ApnsClient("ios", config)
    await client.start()
    return client


# --- APNs ----------------------------------------------------------------------------------


async def test_apns_refuses_a_certificate_it_does_not_trust(tmp_path: Path) -> None:
    async with ApnsSimulator() as sim:
        client = await apns_client(tmp_path, sim.host, sim.port, None, sim)
        try:
            attempt = await client.send(apns_push())
        finally:
            await client.close()
        assert attempt.outcome is Outcome.TRANSIENT
        assert attempt.reason == Reason.CONNECTION_ERROR
        assert attempt.detail is not None and "CERTIFICATE_VERIFY_FAILED" in attempt.detail
        assert sim.requests == [] and sim.jwts_seen == 0  # nothing after the handshake


async def test_apns_refuses_a_trusted_certificate_for_another_host(tmp_path: Path) -> None:
    async with ApnsSimulator(hostnames=["other.example"]) as sim:
        client = await apns_client(tmp_path, "localhost", sim.port, sim.ca_path, sim)
        try:
            attempt = await client.send(apns_push())
        finally:
            await client.close()
        assert attempt.outcome is Outcome.TRANSIENT
        assert attempt.detail is not None and "Hostname mismatch" in attempt.detail
        assert sim.requests == [] and sim.jwts_seen == 0


async def test_apns_negotiates_h2_over_verified_tls_12_or_later(tmp_path: Path) -> None:
    async with ApnsSimulator() as sim:
        client = await apns_client(tmp_path, sim.host, sim.port, sim.ca_path, sim)
        try:
            assert (await client.send(apns_push())).outcome is Outcome.OK
            assert client._pool is not None
            (connection,) = client._pool.connections
            assert connection.transport is not None
            tls = connection.transport.get_extra_info("ssl_object")
            assert tls.selected_alpn_protocol() == "h2"
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
            context = client._pool.ssl_context
            assert context is not None
            assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname
            assert context.minimum_version >= ssl.TLSVersion.TLSv1_2
        finally:
            await client.close()


class _Http11Server(asyncio.Protocol):
    """A trusted TLS server that speaks HTTP/1.1 only and keeps the connection open."""

    def __init__(self, received: bytearray, lost: asyncio.Event) -> None:
        self.received = received
        self.lost = lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received += data
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()


@pytest.mark.parametrize("server_alpn", [None, ["http/1.1"]])
async def test_apns_refuses_a_server_that_does_not_negotiate_h2(
    tmp_path: Path, server_alpn: list[str] | None
) -> None:
    ca = SimulatorCA(tmp_path / "ca")
    received = bytearray()
    lost = asyncio.Event()
    server = await asyncio.get_running_loop().create_server(
        lambda: _Http11Server(received, lost),
        "127.0.0.1",
        0,
        ssl=ca.server_context(["localhost"], alpn=server_alpn),
    )
    try:
        port = server.sockets[0].getsockname()[1]
        client = await apns_client(tmp_path, "localhost", port, ca.ca_path)
        assert client.provider_token is not None
        jwt = client.provider_token.get_header()[len("bearer ") :]
        try:
            attempt = await client.send(apns_push())
        finally:
            await client.close()
        async with asyncio.timeout(10):
            await lost.wait()
    finally:
        server.close()
    assert attempt.outcome is Outcome.TRANSIENT
    assert attempt.reason == Reason.CONNECTION_ERROR  # not a 1 s timeout of a hung send
    assert attempt.detail is not None and "did not negotiate HTTP/2" in attempt.detail
    assert jwt.encode() not in bytes(received)  # no provider token to a server not speaking h2


# --- FCM -----------------------------------------------------------------------------------


def fcm_client(
    tmp_path: Path, token_sim: FcmSimulator, send_url: str, ca: Path | None
) -> FcmClient:
    path = tmp_path / "sa.json"
    if not path.exists():  # one account per test: the simulator keys accounts by e-mail
        token_sim.add_service_account(make_service_account("p", token_sim.token_uri, path))
    config = FcmAppConfig(
        service_account_file=path, send_url=send_url, ca_file=ca, request_timeout=2.0
    )
    return FcmClient("android", config)


def fcm_push() -> Push:
    return Push(plugin="t", app_id="android", token="fcm-tok", payload={"data": {"k": "v"}})


async def test_fcm_token_endpoint_with_untrusted_certificate_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with FcmSimulator(tls=True) as sim:
        client = fcm_client(tmp_path, sim, sim.send_url_template, None)
        try:
            await client.start()
            attempt = await client.send(fcm_push())
        finally:
            await client.close()
        assert attempt.outcome is Outcome.TRANSIENT
        # Was "OAuth token request failed (TransportError)", as for any outage.
        assert attempt.detail is not None and "certificate verify failed" in attempt.detail
        assert "certificate verify failed" in logged_text(caplog)
        assert sim.token_requests == 0 and sim.requests == []  # no signed assertion sent


async def test_fcm_send_endpoint_with_untrusted_certificate_gets_no_bearer_token(
    tmp_path: Path,
) -> None:
    async with FcmSimulator(tls=True) as tokens, FcmSimulator(tls=True) as stranger:
        client = fcm_client(tmp_path, tokens, stranger.send_url_template, tokens.ca_path)
        trusted = fcm_client(tmp_path, tokens, tokens.send_url_template, tokens.ca_path)
        try:
            await client.start()
            await trusted.start()
            attempt = await client.send(fcm_push())
            assert (await trusted.send(fcm_push())).outcome is Outcome.OK
        finally:
            await client.close()
            await trusted.close()
        assert attempt.outcome is Outcome.TRANSIENT
        assert attempt.reason == Reason.CONNECTION_ERROR
        assert attempt.detail is not None and "CERTIFICATE_VERIFY_FAILED" in attempt.detail
        assert stranger.requests == [] and stranger.token_requests == 0


def test_shared_client_context_verifies() -> None:
    context = ssl_context(None, alpn=["h2"])
    assert context.verify_mode is ssl.CERT_REQUIRED and context.check_hostname
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2


# --- credentials ---------------------------------------------------------------------------


def test_credentials_stay_out_of_reprs_and_errors(tmp_path: Path) -> None:
    key = generate_apns_auth_key()
    keyfile = key.write_p8(tmp_path / "AuthKey.p8")
    pem = keyfile.read_text()
    body = "".join(pem.splitlines()[1:-1])[:40]
    apns = ApnsAppConfig(keyfile=keyfile, key_id=key.key_id, team_id=key.team_id, topic="t")
    client = ApnsClient("ios", apns)
    assert client.provider_token is not None
    texts = [repr(apns), str(apns), repr(client), repr(client.provider_token)]
    sa_path = tmp_path / "sa.json"
    info: dict[str, Any] = make_service_account("p", "https://oauth2.example/token", sa_path)
    fcm = FcmAppConfig(service_account_file=sa_path)
    texts += [repr(fcm), repr(fcm.service_account()), repr(FcmClient("a", fcm).__dict__)]
    # A key that does not load: the error names the key, never its material.
    bad = tmp_path / "bad.p8"
    bad.write_text(pem.replace(body[10:30], "A" * 20))
    with pytest.raises(CredentialError) as caught:
        ApnsAppConfig(keyfile=bad, key_id="k", team_id="t", topic="t").signing_key()
    texts.append(str(caught.value))
    for text in texts:
        assert body not in text and "PRIVATE KEY" not in text
        assert info["private_key"].splitlines()[1] not in text


# --- Marmot relays (websockets) ------------------------------------------------------------


class _Sink:
    def __init__(self) -> None:
        self.states: list[RelayState] = []
        self.changed = asyncio.Event()

    def on_state(self, relay: RelayClient, old: RelayState, new: RelayState) -> None:
        self.states.append(new)
        self.changed.set()

    def __getattr__(self, name: str) -> Any:
        return lambda *args: None


@pytest.fixture
async def wss_relay(tmp_path: Path) -> AsyncIterator[tuple[str, Path, list[str]]]:
    ca = SimulatorCA(tmp_path / "relay-ca")
    seen: list[str] = []

    async def handler(ws: ServerConnection) -> None:
        async for message in ws:
            seen.append(str(message))

    async with serve(handler, "127.0.0.1", 0, ssl=ca.server_context(["localhost"])) as server:
        port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        yield f"wss://localhost:{port}", ca.ca_path, seen


async def _run_until(relay: RelayClient, sink: _Sink, state: RelayState) -> None:
    relay.start()
    try:
        async with asyncio.timeout(10):
            while state not in sink.states:
                sink.changed.clear()
                await sink.changed.wait()
    finally:
        await relay.stop()


async def test_marmot_relay_refuses_untrusted_certificate(
    wss_relay: tuple[str, Path, list[str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, _, seen = wss_relay
    sink = _Sink()
    relay = RelayClient(url, ServerKey.generate(), sink, RelaySettings())  # type: ignore[arg-type]
    await _run_until(relay, sink, RelayState.BACKOFF)
    assert RelayState.SUBSCRIBED not in sink.states and seen == []
    assert "SSLCertVerificationError" in logged_text(caplog)


async def test_marmot_relay_trusts_the_operators_ca(
    wss_relay: tuple[str, Path, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, ca_path, _ = wss_relay
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_path))  # the operator's trust store
    sink = _Sink()
    relay = RelayClient(url, ServerKey.generate(), sink, RelaySettings())  # type: ignore[arg-type]
    await _run_until(relay, sink, RelayState.SUBSCRIBED)


# --- FCM endpoints in plain http:// ------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "url", "warned"),
    [
        ("send_url", "http://fcm.example.net/v1/projects/{project_id}/messages:send", True),
        ("token_uri", "http://oauth.example.net/token", True),
        ("send_url", "http://127.0.0.1:4080/v1/projects/{project_id}/messages:send", False),
        ("send_url", "http://[::1]:4080/{project_id}", False),
        ("token_uri", "http://localhost:4080/token", False),
        ("send_url", "https://fcm.example.net/v1/projects/{project_id}/messages:send", False),
    ],
)
def test_fcm_endpoint_in_cleartext_to_another_machine_is_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, field: str, url: str, warned: bool
) -> None:
    """The bearer token (and the signed assertion that gets one) would cross the network
    readable; a loopback simulator or proxy is fine, as config/local.yaml uses."""
    account = tmp_path / "sa.json"
    account.write_text("{}")
    with caplog.at_level(logging.WARNING, logger="gateway.config"):
        FcmAppConfig.model_validate({"service_account_file": str(account), field: url})
    warnings = [r.getMessage() for r in caplog.records if r.name == "gateway.config"]
    assert bool(warnings) is warned, warnings
    if warned:
        assert warnings[0].startswith(f"{field} is plain http:// to ")

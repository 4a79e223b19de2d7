"""ApnsClient against the APNs simulator (gateway.testing)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import ApnsAppConfig
from gateway.core.apns import (
    IDLE_SECONDS,
    MAX_TOKEN_LENGTH,
    ApnsClient,
    _ApnsProtocol,
    _StreamSlots,
)
from gateway.core.push import ApnsOptions, Attempt, Outcome, Push, PushPolicy, Reason
from gateway.testing import ApnsResponse, ApnsSimulator, generate_apns_auth_key
from tests.core.conftest import logged_text, nested

TOPIC = "com.example.app"
MakeClient = Callable[..., Awaitable[ApnsClient]]


def token() -> str:
    return secrets.token_hex(32)


def push_for(tok: str, payload: dict[str, Any] | None = None, **apns: Any) -> Push:
    return Push(
        plugin="test",
        app_id="ios",
        token=tok,
        payload=payload if payload is not None else {"aps": {"alert": "hi"}},
        apns=ApnsOptions(**apns),
    )


def sized_payload(size: int) -> dict[str, Any]:
    base = len(json.dumps({"aps": {}, "x": ""}, separators=(",", ":")).encode())
    return {"aps": {}, "x": "a" * (size - base)}


@pytest.fixture(autouse=True)
def no_jwt_in_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    yield
    text = logged_text(caplog)
    assert "bearer ey" not in text.lower()


@pytest.fixture
async def sim() -> AsyncIterator[ApnsSimulator]:
    async with ApnsSimulator() as simulator:
        yield simulator


@pytest.fixture
async def make_client(
    sim: ApnsSimulator, tmp_path: Path, secrets_seen: set[str]
) -> AsyncIterator[MakeClient]:
    clients: list[ApnsClient] = []

    async def make(*, proxy: str | None = None, **overrides: Any) -> ApnsClient:
        key = generate_apns_auth_key()
        keyfile = key.write_p8(tmp_path / f"AuthKey_{key.key_id}.p8")
        sim.add_jwt_key(key.key_id, key.team_id, key.public_key)
        settings: dict[str, Any] = {
            "keyfile": keyfile,
            "key_id": key.key_id,
            "team_id": key.team_id,
            "topic": TOPIC,
            "host": sim.host,
            "port": sim.port,
            "ca_file": sim.ca_path,
            "request_timeout": 1.0,
            **overrides,
        }
        client = ApnsClient("ios", ApnsAppConfig(**settings), proxy=proxy)
        await client.start()
        clients.append(client)
        if client.provider_token is not None:
            secrets_seen.add(client.provider_token.get_header()[len("bearer ") :])
        return client

    yield make
    for client in clients:
        await client.close()


async def send(client: ApnsClient, push: Push, secrets_seen: set[str]) -> Any:
    secrets_seen.add(push.token)
    assert client.validate(push) is None
    return await client.send(push)


async def one_connection(
    make_client: MakeClient, secrets_seen: set[str], **options: Any
) -> tuple[ApnsClient, Any]:
    """A client (`options`) whose pool holds the one connection a first push opened."""
    client = await make_client(**options)
    assert (await send(client, push_for(token()), secrets_seen)).outcome is Outcome.OK
    assert client._pool is not None
    (protocol,) = client._pool.connections
    return client, protocol


# --- success and headers ---------------------------------------------------------------


async def test_success_sends_compact_body_and_headers(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client()
    assert client.ready()
    tok = token()
    push = push_for(tok, {"aps": {"alert": "héllo"}}, priority=5, collapse_id="c1", expiration=0)
    attempt = await send(client, push, secrets_seen)
    assert attempt.outcome is Outcome.OK
    assert attempt.status == 200
    assert attempt.provider_id == push.id
    (request,) = sim.requests
    assert request.token == tok
    assert request.body == '{"aps":{"alert":"héllo"}}'.encode()
    headers = request.headers
    assert headers["apns-id"] == push.id
    assert headers["apns-topic"] == TOPIC
    assert headers["apns-push-type"] == "alert"
    assert headers["apns-priority"] == "5"
    assert headers["apns-collapse-id"] == "c1"
    assert headers["apns-expiration"] == "0"  # aioapns could only send now + ttl
    assert headers["authorization"].startswith("bearer ")


async def test_push_type_omitted_defaulted_and_beyond_aioapns(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    plain = await make_client()
    defaulted = await make_client(push_type="voip", topic=f"{TOPIC}.voip")
    tok = token()
    assert (await send(plain, push_for(tok, push_type=None), secrets_seen)).outcome is Outcome.OK
    assert "apns-push-type" not in sim.requests[-1].headers
    # Each with the topic Apple requires for it (another is refused before sending).
    for kind, suffix in (
        ("location", ".location-query"),
        ("pushtotalk", ".voip-ptt"),
        ("widgets", ".push-type.widgets"),
        ("liveactivity", ".push-type.liveactivity"),
    ):
        push = push_for(tok, push_type=kind, topic=f"{TOPIC}{suffix}")
        assert (await send(plain, push, secrets_seen)).outcome is Outcome.OK
        assert sim.requests[-1].headers["apns-push-type"] == kind
        assert sim.requests[-1].headers["apns-topic"] == f"{TOPIC}{suffix}"
    assert (
        await send(defaulted, push_for(tok, push_type=None), secrets_seen)
    ).outcome is Outcome.OK
    assert sim.requests[-1].headers["apns-push-type"] == "voip"


# --- classification end to end ---------------------------------------------------------


async def test_unregistered_keeps_timestamp(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client()
    tok = token()
    sim.script(tok, ApnsResponse.error("Unregistered", timestamp=1_700_000_000_000))
    attempt = await send(client, push_for(tok), secrets_seen)
    assert attempt.outcome is Outcome.TOKEN_INVALID
    assert attempt.status == 410
    assert attempt.reason == "Unregistered"
    assert attempt.token_timestamp == 1_700_000_000_000


async def test_bad_device_token(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client()
    attempt = await send(client, push_for("not-hex-at-all"), secrets_seen)
    assert attempt.outcome is Outcome.TOKEN_INVALID
    assert (attempt.status, attempt.reason) == (400, "BadDeviceToken")


@pytest.mark.parametrize(
    ("reason", "outcome", "wide"),
    [
        ("TooManyRequests", Outcome.THROTTLED, False),
        ("TooManyProviderTokenUpdates", Outcome.THROTTLED, True),
        ("TopicDisallowed", Outcome.PERMANENT, False),
        ("ServiceUnavailable", Outcome.TRANSIENT, False),
        ("DeviceTokenNotForTopic", Outcome.TOKEN_INVALID, False),
    ],
)
async def test_scripted_errors(
    sim: ApnsSimulator,
    make_client: MakeClient,
    secrets_seen: set[str],
    reason: str,
    outcome: Outcome,
    wide: bool,
) -> None:
    client = await make_client()
    tok = token()
    sim.script(tok, ApnsResponse.error(reason))
    attempt = await send(client, push_for(tok), secrets_seen)
    assert (attempt.outcome, attempt.reason, attempt.credential_wide) == (outcome, reason, wide)


async def test_expired_provider_token_is_auth_and_forces_one_resign(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client()
    jwt = client.provider_token
    assert jwt is not None
    tok = token()
    sim.script(tok, ApnsResponse.error("ExpiredProviderToken"), ApnsResponse.ok())
    attempt = await send(client, push_for(tok), secrets_seen)
    assert (attempt.outcome, attempt.status) == (Outcome.AUTH, 403)
    assert attempt.reason == "ExpiredProviderToken"
    before = jwt.signatures
    await client.refresh_credentials()
    await client.refresh_credentials()  # a second caller for the same failure: no new JWT
    assert jwt.signatures == before + 1
    secrets_seen.add(jwt.get_header()[len("bearer ") :])
    assert (await send(client, push_for(tok), secrets_seen)).outcome is Outcome.OK
    assert sim.jwts_seen == 2


async def test_invalid_provider_token_from_simulator(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client()
    other = generate_apns_auth_key()  # the simulator knows a key, but not this one
    sim._jwt_keys = {other.key_id: (other.team_id, other.public_key)}
    sim._jwt_cache.clear()
    attempt = await send(client, push_for(token()), secrets_seen)
    assert (attempt.outcome, attempt.reason) == (Outcome.AUTH, "InvalidProviderToken")
    jwt = client.provider_token
    assert jwt is not None
    before = jwt.signatures
    await client.refresh_credentials()  # not expired and younger than 20 min: no re-sign
    assert jwt.signatures == before


def test_jwt_refresh_schedule() -> None:
    key = generate_apns_auth_key()
    now = [1_000_000.0]
    from gateway.core.apns import _ProviderToken

    provider = _ProviderToken(key.private_key_pem, key.key_id, key.team_id, clock=lambda: now[0])
    first = provider.get_header()
    now[0] += 19 * 60
    assert not provider.refresh()  # younger than 20 min
    assert provider.get_header() == first
    now[0] += 2 * 60
    assert provider.refresh()  # older than 20 min: allowed
    second = provider.get_header()
    assert second != first
    now[0] += 44 * 60
    assert provider.get_header() == second
    now[0] += 2 * 60
    assert provider.get_header() != second  # re-signed on use after 45 min
    assert provider.signatures == 3
    provider.expired(provider.generation - 1)  # an old token expired: nothing to do
    assert not provider.refresh()
    provider.expired(provider.generation)
    assert provider.refresh()  # forced, however young


async def test_one_jwt_shared_by_connections(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    sim.set_max_concurrent_streams(1)
    client = await make_client(max_connections=3)
    tokens = [token() for _ in range(3)]
    for tok in tokens:
        sim.script(tok, ApnsResponse.ok(delay=0.2))
    results = await asyncio.gather(*(send(client, push_for(t), secrets_seen) for t in tokens))
    assert all(r.outcome is Outcome.OK for r in results)
    assert sim.connections_opened >= 2
    assert sim.jwts_seen == 1
    assert client.provider_token is not None and client.provider_token.signatures == 1


# --- faults ----------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["no_body", "reset", "drop", "goaway"])
async def test_faults_end_transient(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str], fault: str
) -> None:
    client = await make_client(request_timeout=1.0)
    tok = token()
    sim.script(tok, ApnsResponse.faulty(fault, status=410), ApnsResponse.ok())  # type: ignore[arg-type]
    # A guard, not a timing assert: a fault the request timeout does not end hangs.
    attempt = await asyncio.wait_for(send(client, push_for(tok), secrets_seen), 30)
    # the no_body 410 must not invalidate the token
    assert attempt.outcome is Outcome.TRANSIENT
    assert (await send(client, push_for(tok), secrets_seen)).outcome is Outcome.OK


async def test_no_answer_times_out_and_frees_the_stream(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    sim.set_max_concurrent_streams(1)
    client = await make_client(request_timeout=0.3, max_connections=1)
    slow, fast = token(), token()
    sim.script(slow, ApnsResponse.ok(delay=5.0))
    attempt = await send(client, push_for(slow), secrets_seen)
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.TIMEOUT)
    # the single stream slot was given back (RST_STREAM sent): the next push goes through
    assert (await send(client, push_for(fast), secrets_seen)).outcome is Outcome.OK


async def test_connection_refused_is_transient(tmp_path: Path, secrets_seen: set[str]) -> None:
    """The failure itself ends the send: aioapns would sleep a fixed second after a
    failed connect even on its last attempt (`max_connection_attempts=1`), holding the
    lane slot, and say only `MaxAttemptsExceeded`."""
    key = generate_apns_auth_key()
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        config = ApnsAppConfig(
            keyfile=key.write_p8(tmp_path / "k.p8"),
            key_id=key.key_id,
            team_id=key.team_id,
            topic=TOPIC,
            host="127.0.0.1",
            port=s.getsockname()[1],
            request_timeout=3.0,
        )
        client = ApnsClient("ios", config)
        await client.start()
        try:
            attempt = await send(client, push_for(token()), secrets_seen)
        finally:
            await client.close()
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.CONNECTION_ERROR)
    assert attempt.detail is not None and attempt.detail.startswith("ConnectionRefusedError")


async def test_send_before_start_is_transient(tmp_path: Path) -> None:
    key = generate_apns_auth_key()
    config = ApnsAppConfig(
        keyfile=key.write_p8(tmp_path / "k.p8"), key_id=key.key_id, team_id=key.team_id, topic=TOPIC
    )
    client = ApnsClient("ios", config)
    assert not client.ready()
    assert client.host == "api.push.apple.com"
    assert (await client.send(push_for(token()))).outcome is Outcome.TRANSIENT


# --- size and header checks --------------------------------------------------------------


async def test_payload_limits(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client()
    tok = token()
    secrets_seen.add(tok)
    exact = push_for(tok, sized_payload(4096))
    assert (await send(client, exact, secrets_seen)).outcome is Outcome.OK
    assert len(sim.requests[-1].body) == 4096

    over = push_for(tok, sized_payload(4097))
    refusal = client.validate(over)
    assert refusal is not None
    assert (refusal.outcome, refusal.reason) == (Outcome.PERMANENT, Reason.PAYLOAD_TOO_LARGE)
    assert refusal.detail is not None and tok not in refusal.detail
    assert (await client.send(over)).reason == Reason.PAYLOAD_TOO_LARGE  # send checks too
    assert len(sim.requests) == 1

    voip = push_for(tok, sized_payload(5120), push_type="voip", topic=f"{TOPIC}.voip")
    assert (await send(client, voip, secrets_seen)).outcome is Outcome.OK
    voip_over = push_for(tok, sized_payload(5121), push_type="voip", topic=f"{TOPIC}.voip")
    assert client.validate(voip_over) is not None

    policy = Push("test", "ios", tok, sized_payload(600), policy=PushPolicy(max_payload_bytes=512))
    refusal = client.validate(policy)
    assert refusal is not None and refusal.reason == Reason.PAYLOAD_TOO_LARGE


@pytest.mark.parametrize(
    ("payload", "options"),
    [
        ({"aps": {}}, {"collapse_id": "c" * 65}),
        ({"aps": {}}, {"priority": 7}),
        ({"aps": {}}, {"expiration": -1}),
        ({"aps": {}}, {"topic": "com.example.app\r\nx-injected: 1"}),
        ({"aps": {}}, {"topic": " com.example.app"}),
        ({"aps": {}}, {"push_type": ""}),
        ({"aps": {}}, {"collapse_id": "thread\x00"}),
        ({"aps": {}}, {"collapse_id": "thread\ud800"}),  # no UTF-8 form: not a raise
        ({"aps": {}}, {"topic": "com.example.app\udc80"}),
        ({"aps": {"x": float("nan")}}, {}),
        ({"aps": {"x": object()}}, {}),
        ({"aps": {}, "x": nested(100_000)}, {}),  # deeper than the encoder's stack
    ],
)
async def test_invalid_requests_refused(
    make_client: MakeClient, payload: dict[str, Any], options: dict[str, Any]
) -> None:
    client = await make_client()
    refusal = client.validate(push_for(token(), payload, **options))
    assert refusal is not None
    assert (refusal.outcome, refusal.reason) == (Outcome.PERMANENT, Reason.INVALID_PAYLOAD)


async def test_collapse_id_of_64_bytes_is_sent(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client()
    attempt = await send(client, push_for(token(), collapse_id="é" * 32), secrets_seen)
    assert attempt.outcome is Outcome.OK


def test_idle_connections_are_kept_for_an_hour() -> None:
    assert _ApnsProtocol.INACTIVITY_TIME >= 3600 == IDLE_SECONDS


# --- certificate auth and proxy ------------------------------------------------------------


async def test_certificate_auth_sends_no_authorization(
    sim: ApnsSimulator, tmp_path: Path, secrets_seen: set[str]
) -> None:
    sim._jwt_keys = None  # certificate auth: the simulator does not check JWTs
    cert, key = sim.ca.issue(["client.example"])
    bundle = tmp_path / "client.pem"
    bundle.write_bytes(cert.read_bytes() + key.read_bytes())
    config = ApnsAppConfig(
        certfile=bundle, topic=TOPIC, host=sim.host, port=sim.port, ca_file=sim.ca_path
    )
    client = ApnsClient("ios", config)
    await client.start()
    try:
        assert client.provider_token is None
        attempt = await send(client, push_for(token()), secrets_seen)
        await client.refresh_credentials()  # nothing to refresh
    finally:
        await client.close()
    assert attempt.outcome is Outcome.OK
    assert "authorization" not in sim.requests[-1].headers


class ConnectProxy:
    """A minimal HTTP CONNECT proxy for the tests (optionally refusing)."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.targets: list[str] = []
        self.auth: list[str | None] = []
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://user:p%40ss@127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        lines = head.split("\r\n")
        self.targets.append(lines[0].split()[1])
        self.auth.append(
            next((line.split(": ", 1)[1] for line in lines if line.startswith("Proxy-Auth")), None)
        )
        if self.refuse:
            writer.write(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        port = lines[0].split()[1].rsplit(":", 1)[1]
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", int(port))
        writer.write(b"HTTP/1.0 200 Connection established\r\n\r\n")

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def test_connect_proxy(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    proxy = ConnectProxy()
    async with proxy as url:
        client = await make_client(proxy=url)
        assert (await send(client, push_for(token()), secrets_seen)).outcome is Outcome.OK
        await client.close()
    assert proxy.targets == [f"{sim.host}:{sim.port}"]
    assert proxy.auth == ["Basic dXNlcjpwQHNz"]  # user:p@ss


async def test_connect_proxy_refusal_is_transient(
    make_client: MakeClient, secrets_seen: set[str]
) -> None:
    async with ConnectProxy(refuse=True) as url:
        client = await make_client(proxy=url, request_timeout=3.0)
        attempt = await send(client, push_for(token()), secrets_seen)
        await client.close()
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.CONNECTION_ERROR)


async def test_https_proxy_env_respects_no_proxy(
    monkeypatch: pytest.MonkeyPatch, sim: ApnsSimulator, make_client: MakeClient
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    client = await make_client()
    assert client._proxy is None
    monkeypatch.delenv("NO_PROXY")
    client = await make_client()
    assert client._proxy == "http://proxy.invalid:3128"


async def test_many_concurrent_sends_with_large_payloads(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    """More 4 KiB bodies in flight than one 64 KiB window holds: senders wait for credit."""
    sim.initial_window_size = 65535
    client = await make_client(request_timeout=5.0)
    tokens = [token() for _ in range(60)]
    results = await asyncio.gather(
        *(send(client, push_for(t, sized_payload(4096)), secrets_seen) for t in tokens)
    )
    assert [r.outcome for r in results] == [Outcome.OK] * 60


async def test_a_stream_reset_while_its_body_waits_for_window_ends_at_once(
    sim: ApnsSimulator,
    make_client: MakeClient,
    secrets_seen: set[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """RST_STREAM for a request whose sender waits for flow-control window wakes the
    sender: the send ends like any reset stream (`connection_error`, retried), not
    `timeout` after `request_timeout`, and the stream's error is retrieved."""
    sim.initial_window_size = 64  # per stream, until the client sends DATA
    client = await make_client(request_timeout=2.0, max_connections=1)
    # the connection knows the simulator's SETTINGS (a 64-byte window) once a push is back
    assert (await send(client, push_for(token()), secrets_seen)).outcome is Outcome.OK
    sim.reset_before_body = True
    attempt = await send(client, push_for(token(), sized_payload(1000)), secrets_seen)
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.CONNECTION_ERROR)
    assert attempt.detail is not None and attempt.detail.startswith("StreamResetError")
    gc.collect()  # an unretrieved future exception is reported when it is collected
    assert "never retrieved" not in caplog.text
    # the reset stream gave its slot back: the connection goes on
    sim.reset_before_body = False
    assert (await send(client, push_for(token()), secrets_seen)).outcome is Outcome.OK
    assert sim.connections_opened == 1


@pytest.mark.parametrize("then_reset", [True, False], ids=["then-reset", "no-reset"])
async def test_an_answer_that_comes_while_the_body_waits_for_window_is_the_answer(
    sim: ApnsSimulator,
    make_client: MakeClient,
    secrets_seen: set[str],
    then_reset: bool,
) -> None:
    """A server may answer before the whole request, then reset the stream with NO_ERROR
    (RFC 9113 section 8.1): the send ends with that answer at once, not `timeout` (or
    `connection_error`) while its body still waits for window, and frees its stream."""
    sim.initial_window_size = 64  # per stream, until the client sends DATA
    client = await make_client(request_timeout=5.0, max_connections=1)
    assert (await send(client, push_for(token()), secrets_seen)).outcome is Outcome.OK
    sim.answer_before_body = ApnsResponse(413, "PayloadTooLarge")
    sim.reset_after_early_answer = then_reset
    attempt = await asyncio.wait_for(
        send(client, push_for(token(), sized_payload(1000)), secrets_seen), 4.0
    )
    assert (attempt.outcome, attempt.status, attempt.reason) == (
        Outcome.PERMANENT,
        413,
        "PayloadTooLarge",
    )
    # the stream is closed on both sides: the connection goes on, with all its streams
    sim.answer_before_body = None
    sim.set_max_concurrent_streams(1)
    for _ in range(3):
        assert (await send(client, push_for(token()), secrets_seen)).outcome is Outcome.OK
    assert sim.connections_opened == 1


async def test_error_bodies_do_not_exhaust_the_receive_window(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    """aioapns never returns flow-control credit for DATA: 64 KiB of error bodies stall it."""
    client = await make_client(request_timeout=2.0, max_connections=1)
    reason = "Bad" + "x" * 4000  # ~4 KiB error bodies: 16 of them fill the 64 KiB window
    sim.script_all(ApnsResponse(400, reason))
    tok = token()
    for _ in range(5):
        results = await asyncio.gather(
            *(send(client, push_for(tok), secrets_seen) for _ in range(20))
        )
        assert {(r.outcome, r.reason) for r in results} == {(Outcome.PERMANENT, reason)}
    assert sim.connections_opened == 1


async def test_stream_slots_follow_the_peer_limit_both_ways() -> None:
    slots = _StreamSlots(1)
    assert await slots.acquire() == 1
    waiters = [asyncio.create_task(slots.acquire()) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    slots.bound = 3  # SETTINGS raise the limit: two of the waiters get a stream at once
    await asyncio.sleep(0)
    assert sum(w.done() for w in waiters) == 2
    slots.bound = 1  # and lower it again below the streams in use (3)
    slots.release()
    slots.release()
    await asyncio.sleep(0)
    assert sum(w.done() for w in waiters) == 2  # still 1 in use: nobody may start
    assert slots.is_busy
    slots.release()
    await asyncio.sleep(0)
    assert all(w.done() for w in waiters)


async def queued_behind_a_held_stream(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str], *, held: float
) -> tuple[ApnsClient, Any, asyncio.Task[Attempt], asyncio.Task[Attempt]]:
    """One connection of one stream: `holder`'s push holds it (answered after `held`
    seconds), `queued`'s waits for it. Returned once `queued` waits."""
    sim.set_max_concurrent_streams(1)
    client, protocol = await one_connection(
        make_client, secrets_seen, max_connections=1, request_timeout=held + 10.0
    )
    holder_token = token()
    sim.script(holder_token, ApnsResponse.ok(delay=held))
    holder = asyncio.create_task(send(client, push_for(holder_token), secrets_seen))
    await sim.wait_for_requests(2)
    queued = asyncio.create_task(send(client, push_for(token()), secrets_seen))

    async def queued_for_the_stream() -> None:
        while not protocol.free_channels._waiters:
            await asyncio.sleep(0)

    await asyncio.wait_for(queued_for_the_stream(), 5)
    return client, protocol, holder, queued


async def test_a_send_waiting_for_a_stream_ends_transient_when_the_connection_drops(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    """A send queued for a stream of a connection that is lost ends `connection_error`
    (retried by the dispatcher), not with a ValueError from the stream semaphore (which
    the dispatcher ends `client_error`, never retried)."""
    client, protocol, holder, queued = await queued_behind_a_held_stream(
        sim, make_client, secrets_seen, held=10.0
    )
    # Lost, not closed by a GOAWAY (after which a send still waiting for a stream was
    # not processed, and goes to another connection: test_review_http2_lifecycle.py).
    assert protocol.transport is not None
    protocol.transport.abort()
    for attempt in await asyncio.wait_for(asyncio.gather(holder, queued), 5):
        assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.CONNECTION_ERROR)
    assert (await send(client, push_for(token()), secrets_seen)).outcome is Outcome.OK


async def test_a_send_waiting_for_a_stream_of_a_retired_connection_goes_to_another_at_once(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    """A connection retired (after an `APNS_RECONNECT` answer) gives the sends waiting
    for one of its streams to another connection at once: they were not sent, and its
    slowest answer may be seconds away."""
    _, protocol, holder, queued = await queued_behind_a_held_stream(
        sim, make_client, secrets_seen, held=20.0
    )
    protocol.retire()
    try:
        attempt = await asyncio.wait_for(queued, 10)
        assert attempt.outcome is Outcome.OK
        assert not holder.done()  # sent on a new connection while the old one waits
        assert sim.connections_opened == 2
    finally:
        holder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await holder


async def test_a_lost_connection_ends_a_body_waiting_for_window_with_its_error_retrieved(
    sim: ApnsSimulator,
    make_client: MakeClient,
    secrets_seen: set[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A connection lost while a request's body waits for flow-control window ends that
    send `connection_error`, and the stream's own error is retrieved (no "exception was
    never retrieved" warning when it is collected)."""
    sim.initial_window_size = 64  # per stream: a larger body waits for window
    client, protocol = await one_connection(
        make_client, secrets_seen, request_timeout=5.0, max_connections=1
    )
    waiting = asyncio.create_task(
        send(client, push_for(token(), sized_payload(1000)), secrets_seen)
    )

    async def body_waits_for_window() -> None:
        while not protocol._window_waiters:
            await asyncio.sleep(0)

    await asyncio.wait_for(body_waits_for_window(), 5)
    sim.goaway_all()
    attempt = await asyncio.wait_for(waiting, 5)
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.CONNECTION_ERROR)
    gc.collect()  # an unretrieved future exception is reported when it is collected
    assert "never retrieved" not in caplog.text


async def test_concurrency_grows_after_settings(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client = await make_client(max_connections=1)
    tokens = [token() for _ in range(20)]
    for tok in tokens:
        # answered long after the test ends: the 20 requests can only all arrive if they
        # are in flight together, on the one connection, once the server's SETTINGS came
        sim.script(tok, ApnsResponse.ok(delay=600))
    sending = asyncio.gather(*(send(client, push_for(t), secrets_seen) for t in tokens))
    try:
        arrived = await sim.wait_for_requests(len(tokens))
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
    assert {r.token for r in arrived} == set(tokens)
    assert {r.connection_id for r in arrived} == {arrived[0].connection_id}
    assert sim.connections_opened == 1


async def test_requests_of_one_loop_iteration_share_a_write(
    make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client, protocol = await one_connection(make_client, secrets_seen, max_connections=1)
    assert protocol.transport is not None
    writes = []
    real_write = protocol.transport.write

    def counting(data: bytes) -> None:
        writes.append(len(data))
        real_write(data)

    protocol.transport.write = counting  # type: ignore[method-assign]
    attempts = await asyncio.gather(*(client.send(push_for(token())) for _ in range(20)))
    assert all(a.outcome is Outcome.OK for a in attempts)
    # 20 requests in one iteration: one write for all, then one per batch of acks
    assert 1 <= len(writes) < 10


async def test_idle_connection_closes_after_the_inactivity_time(
    make_client: MakeClient, secrets_seen: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_ApnsProtocol, "INACTIVITY_TIME", 0.3)
    client, protocol = await one_connection(make_client, secrets_seen, max_connections=1)
    lost = asyncio.get_running_loop().create_future()
    real_lost = protocol.connection_lost

    def on_lost(exc: Exception | None) -> None:
        real_lost(exc)
        lost.set_result(time.monotonic())

    protocol.connection_lost = on_lost  # type: ignore[method-assign]
    # activity re-arms the idle clock: a push now keeps the connection for 0.3 s more
    assert (await send(client, push_for(token()), secrets_seen)).outcome is Outcome.OK
    last_activity = time.monotonic()
    closed_at = await asyncio.wait_for(lost, 5)
    assert closed_at - last_activity >= 0.3 - 0.05
    assert protocol not in client._pool.connections


async def test_a_connection_being_closed_takes_no_new_request(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    """A connection that is closing (GOAWAY received, idle time over) stays in aioapns's
    pool until `connection_lost`, which comes only after the TLS shutdown round trip.
    Sends picked it meanwhile and failed `connection_error` at once: after a GOAWAY,
    a burst of pushes went into backoff and could open the lane's circuit breaker."""
    client, protocol = await one_connection(make_client, secrets_seen, max_connections=1)
    protocol.close()  # what `_idle_check` and a GOAWAY do; connection_lost comes later
    attempts = await asyncio.gather(
        *(send(client, push_for(token()), secrets_seen) for _ in range(3))
    )
    assert [a.outcome for a in attempts] == [Outcome.OK] * 3
    assert sim.connections_opened == 2


async def test_goaway_then_send_at_once_uses_a_new_connection(
    sim: ApnsSimulator, make_client: MakeClient, secrets_seen: set[str]
) -> None:
    client, protocol = await one_connection(make_client, secrets_seen, max_connections=1)
    assert protocol.transport is not None
    sim.goaway_all()

    async def goaway_seen() -> None:
        while not protocol.transport.is_closing():  # type: ignore[union-attr]
            await asyncio.sleep(0)

    await asyncio.wait_for(goaway_seen(), 5)
    attempt = await send(client, push_for(token()), secrets_seen)
    assert attempt.outcome is Outcome.OK


@pytest.mark.parametrize("window", [1024, 4096])
async def test_a_body_larger_than_the_peer_stream_window_is_sent_in_pieces(
    sim: ApnsSimulator,
    make_client: MakeClient,
    secrets_seen: set[str],
    window: int,
) -> None:
    """A server may advertise an initial stream window smaller than a payload (4096
    bytes is below a 5120-byte VoIP payload) and grant more only as DATA arrives
    (RFC 9113 section 6.9). Waiting for a window as large as the whole body before
    sending any of it waited for credit that never comes: the send ended `timeout`,
    and so did every retry."""
    sim.initial_window_size = window
    client = await make_client(request_timeout=2.0, max_connections=1)
    # the connection knows the simulator's SETTINGS once a push is back
    assert (await send(client, push_for(token()), secrets_seen)).outcome is Outcome.OK
    voip = push_for(token(), sized_payload(5120), push_type="voip", topic=f"{TOPIC}.voip")
    attempt = await send(client, voip, secrets_seen)
    assert attempt.outcome is Outcome.OK
    assert len(sim.requests[-1].body) == 5120


@pytest.mark.parametrize(
    ("device_token", "detail"),
    [
        ("ab/cd", "device token has invalid characters"),
        ("ab cd", "device token has invalid characters"),
        ("a" * (MAX_TOKEN_LENGTH + 1), f"device token longer than {MAX_TOKEN_LENGTH} characters"),
    ],
)
async def test_a_token_unfit_for_the_path_is_refused_without_a_request(
    sim: ApnsSimulator,
    make_client: MakeClient,
    secrets_seen: set[str],
    device_token: str,
    detail: str,
) -> None:
    """A token becomes the request's `:path`: one that would change the path, or one so
    long that the server closes the whole connection over it, is never sent."""
    client = await make_client()
    push = push_for(device_token)
    secrets_seen.add(device_token)
    refusal = client.validate(push)
    assert refusal is not None
    assert (refusal.outcome, refusal.reason, refusal.detail) == (
        Outcome.PERMANENT,
        Reason.INVALID_PAYLOAD,
        detail,
    )
    assert await client.send(push) == refusal  # send() refuses alike
    assert sim.requests == []
    # the longest token allowed still goes out
    longest = await send(client, push_for("a" * MAX_TOKEN_LENGTH), secrets_seen)
    assert longest.reason != Reason.INVALID_PAYLOAD
    assert len(sim.requests) == 1

"""A gateway whose only way out is an HTTP CONNECT proxy, and upstreams that misbehave.

A small CONNECT proxy (below, asyncio) sits in front of the real APNs and FCM
simulators (TLS): APNs sends, FCM sends and FCM's OAuth token requests must all go
through it with its credentials; `NO_PROXY` must let the simulators' host bypass it; a
refused CONNECT must be a transient, retried failure whose detail names the proxy and
never its password. A body of tens of megabytes, or one that never ends, must not be
read whole, and a provider "reason" as long as its body must not reach the receipts.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
from aiohttp import web

from gateway.config import ApnsAppConfig, FcmAppConfig
from gateway.core.apns import ApnsClient
from gateway.core.fcm import FcmClient
from gateway.core.push import Outcome, Push, PushPolicy, Reason
from gateway.testing import (
    ApnsResponse,
    ApnsSimulator,
    FcmResponse,
    FcmSimulator,
    SimulatorCA,
    generate_apns_auth_key,
    make_service_account,
)
from gateway.testing.harness import GatewayHarness, apns_app_config, base_config, fcm_app_config
from tests.conftest import LOG_CAPTURE
from tests.test_review_outage import sample_plugin

PROXY_USER = "egress-user"
PROXY_PASSWORD = "Pr0xy-pa55word-zq7"
BASIC = "Basic " + base64.b64encode(f"{PROXY_USER}:{PROXY_PASSWORD}".encode()).decode()
APNS_TOKEN = "ab" * 32
FCM_TOKEN = "fcm-egress-proxy-token-0123456789"
GUARD = 20.0  # seconds a test waits for what must happen (a guard, not an assertion)
REFUSALS = {
    407: b"HTTP/1.1 407 Proxy Authentication Required\r\n"
    b'Proxy-Authenticate: Basic realm="corp"\r\nContent-Length: 0\r\n\r\n',
    403: b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n",
    502: b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n",
}


@pytest.fixture(autouse=True)
def no_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy", "SSL_CERT_FILE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def secrets_registered(register_secret: Any) -> None:
    for secret in (PROXY_PASSWORD, BASIC.split()[1], APNS_TOKEN, FCM_TOKEN):
        register_secret(secret)


@dataclass
class ConnectProxy:
    """An HTTP CONNECT proxy: notes each CONNECT's target and `Proxy-Authorization`,
    answers the next CONNECTs with `refusals` (popped in order), tunnels the others."""

    refusals: list[bytes] = field(default_factory=list)
    connects: list[tuple[str, str | None]] = field(default_factory=list)
    server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://{PROXY_USER}:{PROXY_PASSWORD}@127.0.0.1:{self.port}"

    @property
    def label(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        lines = head.split("\r\n")
        method, target = lines[0].split()[:2]
        auth = next(
            (
                line.split(":", 1)[1].strip()
                for line in lines[1:]
                if ":" in line and line.split(":", 1)[0].lower() == "proxy-authorization"
            ),
            None,
        )
        self.connects.append((target, auth))
        if method != "CONNECT" or self.refusals:
            writer.write(self.refusals.pop(0) if self.refusals else REFUSALS[403])
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            writer.close()
            return
        host, _, port = target.rpartition(":")
        up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(port))
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def _spawn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.ensure_future(self._handle(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


@contextlib.asynccontextmanager
async def connect_proxy() -> AsyncIterator[ConnectProxy]:
    proxy = ConnectProxy()
    proxy.server = await asyncio.start_server(proxy._spawn, "127.0.0.1", 0)
    try:
        yield proxy
    finally:
        proxy.server.close()
        for task in list(proxy._tasks):
            task.cancel()
        await asyncio.gather(*proxy._tasks, return_exceptions=True)


@pytest.fixture
async def proxy() -> AsyncIterator[ConnectProxy]:
    async with connect_proxy() as running:
        yield running


@pytest.fixture
async def fcm_sim() -> AsyncIterator[FcmSimulator]:
    async with FcmSimulator(tls=True) as sim:
        yield sim


@pytest.fixture
async def apns_sim() -> AsyncIterator[ApnsSimulator]:
    async with ApnsSimulator() as sim:
        yield sim


@contextlib.asynccontextmanager
async def fcm_client(
    sim: FcmSimulator, tmp_path: Path, *, proxy: str | None = None, **overrides: Any
) -> AsyncIterator[FcmClient]:
    path = tmp_path / "service-account.json"
    sim.add_service_account(make_service_account("egress", sim.token_uri, path))
    settings: dict[str, Any] = {
        "service_account_file": path,
        "send_url": sim.send_url_template,
        "ca_file": sim.ca_path,
        "request_timeout": 2.0,
        **overrides,
    }
    client = FcmClient("android", FcmAppConfig(**settings), proxy=proxy)
    try:
        await client.start()
        yield client
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def apns_client(
    host: str,
    port: int,
    ca_file: Path,
    tmp_path: Path,
    *,
    proxy: str | None = None,
    sim: ApnsSimulator | None = None,
) -> AsyncIterator[ApnsClient]:
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
        request_timeout=2.0,
        max_connections=1,
    )
    client = ApnsClient("ios", config, proxy=proxy)
    await client.start()
    try:
        yield client
    finally:
        await client.close()


def fcm_push() -> Push:
    return Push(plugin="test", app_id="android", token=FCM_TOKEN, payload={"data": {"k": "v"}})


def apns_push() -> Push:
    return Push(plugin="test", app_id="ios", token=APNS_TOKEN, payload={"aps": {"alert": "x"}})


def logged() -> str:
    return "\n".join(LOG_CAPTURE.lines)


@contextlib.contextmanager
def new_log_lines() -> Iterator[list[str]]:
    start = len(LOG_CAPTURE.lines)
    lines: list[str] = []
    yield lines
    lines.extend(LOG_CAPTURE.lines[start:])


# --- everything goes through the proxy, with its credentials ---------------------------


async def test_fcm_sends_and_oauth_token_requests_go_through_the_proxy_with_credentials(
    fcm_sim: FcmSimulator, proxy: ConnectProxy, tmp_path: Path
) -> None:
    fcm_target = f"127.0.0.1:{fcm_sim.port}"
    async with fcm_client(fcm_sim, tmp_path, proxy=proxy.url) as client:
        # start() fetched the OAuth token (requests, in a thread): through the proxy
        assert proxy.connects == [(fcm_target, BASIC)]
        attempt = await client.send(fcm_push())
    assert attempt.outcome is Outcome.OK
    assert fcm_sim.tokens_issued == 1
    assert [r.token for r in fcm_sim.requests] == [FCM_TOKEN]
    # the send (aiohttp) opened the second tunnel, with the same credentials
    assert proxy.connects == [(fcm_target, BASIC), (fcm_target, BASIC)]


async def test_https_proxy_variable_carries_apns_and_fcm_and_no_proxy_bypasses_it(
    fcm_sim: FcmSimulator,
    apns_sim: ApnsSimulator,
    proxy: ConnectProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    monkeypatch.setenv("NO_PROXY", "push.example.net,.corp.example")  # not our hosts
    async with (
        fcm_client(fcm_sim, tmp_path) as fcm,
        apns_client(apns_sim.host, apns_sim.port, apns_sim.ca_path, tmp_path, sim=apns_sim) as apns,
    ):
        assert (await fcm.send(fcm_push())).outcome is Outcome.OK
        assert (await apns.send(apns_push())).outcome is Outcome.OK
    assert sorted(target for target, _ in proxy.connects) == sorted(
        [f"127.0.0.1:{fcm_sim.port}"] * 2 + [f"{apns_sim.host}:{apns_sim.port}"]
    )
    assert {auth for _, auth in proxy.connects} == {BASIC}

    proxy.connects.clear()
    monkeypatch.setenv("NO_PROXY", "push.example.net, 127.0.0.1")
    async with (
        fcm_client(fcm_sim, tmp_path) as fcm,
        apns_client(apns_sim.host, apns_sim.port, apns_sim.ca_path, tmp_path, sim=apns_sim) as apns,
    ):
        assert (await fcm.send(fcm_push())).outcome is Outcome.OK
        assert (await apns.send(apns_push())).outcome is Outcome.OK
    assert proxy.connects == []  # straight to the simulators
    assert fcm_sim.tokens_issued == 2


# --- a proxy that refuses CONNECT ------------------------------------------------------


@pytest.mark.parametrize("status", sorted(REFUSALS))
async def test_a_refused_fcm_send_names_the_proxy_never_its_password(
    fcm_sim: FcmSimulator, proxy: ConnectProxy, tmp_path: Path, status: int
) -> None:
    """aiohttp's ClientHttpProxyError quotes the proxy URL, password included: the
    detail (on the Receipt every plugin gets, "safe for logs") carried it."""
    async with fcm_client(fcm_sim, tmp_path, proxy=proxy.url) as client:
        proxy.refusals.append(REFUSALS[status])
        attempt = await client.send(fcm_push())
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.CONNECTION_ERROR)
    assert attempt.detail is not None
    assert f"proxy {proxy.label} refused CONNECT: {status}" in attempt.detail
    assert PROXY_PASSWORD not in attempt.detail
    assert PROXY_USER not in attempt.detail
    assert fcm_sim.requests == []  # never reached FCM


async def test_a_refused_oauth_token_request_names_the_proxy(
    fcm_sim: FcmSimulator, proxy: ConnectProxy, tmp_path: Path
) -> None:
    """The token request through a proxy answering 407 was reported as a bare
    `TransportError`, like any outage of Google's token endpoint."""
    proxy.refusals.append(REFUSALS[407])
    with new_log_lines() as lines:
        async with fcm_client(fcm_sim, tmp_path, proxy=proxy.url) as client:
            assert not client.ready()  # no token at start
            attempt = await client.send(fcm_push())  # within FETCH_RETRY: the same error
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.CONNECTION_ERROR)
    expected = f"proxy {proxy.label} refused CONNECT: 407 Proxy Authentication Required"
    assert attempt.detail is not None and expected in attempt.detail
    warnings = [line for line in lines if " WARNING " in line and "OAuth token" in line]
    assert len(warnings) == 1 and expected in warnings[0]
    text = "\n".join(lines)
    assert PROXY_PASSWORD not in text and "Traceback" not in text
    assert fcm_sim.token_requests == 0


@pytest.mark.parametrize("status", sorted(REFUSALS))
async def test_a_refused_apns_connect_names_the_proxy(
    apns_sim: ApnsSimulator, proxy: ConnectProxy, tmp_path: Path, status: int
) -> None:
    proxy.refusals.append(REFUSALS[status])
    async with apns_client(
        apns_sim.host, apns_sim.port, apns_sim.ca_path, tmp_path, proxy=proxy.url, sim=apns_sim
    ) as client:
        attempt = await client.send(apns_push())
        retry = await client.send(apns_push())  # the proxy lets the next one through
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.CONNECTION_ERROR)
    assert attempt.detail is not None
    assert f"proxy {proxy.label} refused CONNECT to {apns_sim.host}:{apns_sim.port}" in (
        attempt.detail
    )
    assert f" {status} " in attempt.detail
    assert PROXY_PASSWORD not in attempt.detail
    assert retry.outcome is Outcome.OK


async def test_refused_pushes_are_retried_and_delivered_and_the_password_stays_out(
    fcm_sim: FcmSimulator,
    apns_sim: ApnsSimulator,
    proxy: ConnectProxy,
    tmp_path: Path,
) -> None:
    """The whole gateway behind the proxy: its refusals end attempts transient, the
    dispatcher retries, the pushes are delivered; the password is in no log line,
    receipt, file or metric, and no traceback is logged."""
    apps = {
        "ios": apns_app_config(apns_sim, tmp_path),
        "android": fcm_app_config(fcm_sim, tmp_path, ca_file=str(fcm_sim.ca_path)),
    }
    config = base_config(tmp_path, {"sample": {"apps": apps}}, delivery={"proxy": proxy.url})
    with new_log_lines() as lines:
        async with GatewayHarness(config, extra_plugins={"sample": sample_plugin()}) as gw:
            context = gw.context("sample")
            receipts = []
            for push in (fcm_push(), apns_push()):
                proxy.refusals.extend([REFUSALS[502], REFUSALS[407]])
                push = Push(
                    "sample", push.app_id, push.token, push.payload, policy=PushPolicy(deadline=10)
                )
                receipts.append(await asyncio.wait_for(context.send(push), GUARD))
            metrics = await (await gw.client.get("/metrics")).text()
    assert [(r.outcome, r.attempts) for r in receipts] == [(Outcome.OK, 3), (Outcome.OK, 3)]
    assert len(fcm_sim.requests) == 1 and len(apns_sim.requests) == 1
    assert {auth for _, auth in proxy.connects} == {BASIC}
    assert 'outcome="ok"' in metrics and PROXY_PASSWORD not in metrics
    text = "\n".join(lines)
    assert "Traceback" not in text and PROXY_PASSWORD not in text
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name.startswith("receipts-") for p in files)
    for path in files:
        assert PROXY_PASSWORD.encode() not in path.read_bytes(), path


# --- misbehaving upstreams: huge and never-ending bodies, long reasons -----------------


@dataclass
class EndlessBodies:
    """An HTTP server answering every request `status` with a body of `size` bytes (None:
    never ending), written as the client reads it; notes how much it wrote."""

    size: int | None
    status: int = 503
    written: int = 0
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(
            status=self.status, headers={"Content-Type": "application/json"}
        )
        if self.size is not None:
            response.content_length = self.size
        await response.prepare(request)
        chunk = b'{"error": {"message": "' + b"x" * 65536
        try:
            while self.size is None or self.written < self.size:
                part = chunk if self.size is None else chunk[: self.size - self.written]
                await response.write(part)
                self.written += len(part)
        except (ConnectionError, RuntimeError):
            pass  # the client went away
        finally:
            self.finished.set()
        return response


@pytest.mark.parametrize("size", [40 * 1024 * 1024, None], ids=["40MB", "endless"])
async def test_an_fcm_answer_of_tens_of_megabytes_or_never_ending_is_not_read_whole(
    fcm_sim: FcmSimulator, tmp_path: Path, size: int | None
) -> None:
    upstream = EndlessBodies(size)
    app = web.Application()
    app.router.add_post("/v1/projects/{project}/messages:send", upstream.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        send_url = f"http://127.0.0.1:{port}/v1/projects/{{project_id}}/messages:send"
        async with fcm_client(fcm_sim, tmp_path, send_url=send_url) as client:
            attempt = await client.send(fcm_push())
            await asyncio.wait_for(upstream.finished.wait(), GUARD)
    finally:
        await runner.cleanup()
    # The answer's status, read from a bounded part of it: not a timeout after the
    # client kept reading (and keeping) the body for `request_timeout`.
    assert (attempt.outcome, attempt.status) == (Outcome.TRANSIENT, 503)
    # The client stopped reading: the server could write only what the sockets buffer.
    assert upstream.written < 16 * 1024 * 1024


class EndlessH2Server(asyncio.Protocol):
    """An HTTP/2 server answering every request `:status 400` and a DATA body that
    never ends (a JSON `reason` without an end), as fast as flow control allows."""

    def __init__(self, owner: EndlessApns) -> None:
        self.owner = owner
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        self.streams: set[int] = set()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.conn.initiate_connection()
        transport.write(self.conn.data_to_send())

    def data_received(self, data: bytes) -> None:
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                sid = event.stream_id
                assert sid is not None
                self.conn.send_headers(sid, [(":status", "400")])
                self.conn.send_data(sid, b'{"reason":"')
                self.streams.add(sid)
            elif isinstance(event, h2.events.DataReceived):
                assert event.stream_id is not None
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamReset):
                self.owner.resets += 1
                self.owner.reset_seen.set()
                self.streams.discard(event.stream_id)  # type: ignore[arg-type]
        self._pump()
        assert self.transport is not None
        self.transport.write(self.conn.data_to_send())

    def _pump(self) -> None:
        for sid in list(self.streams):
            while (
                size := min(
                    self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size
                )
            ) > 0:
                self.conn.send_data(sid, b"R" * size)
                self.owner.sent += size


@dataclass
class EndlessApns:
    sent: int = 0
    resets: int = 0
    reset_seen: asyncio.Event = field(default_factory=asyncio.Event)


async def test_an_apns_error_body_that_never_ends_is_cut_and_the_stream_reset(
    tmp_path: Path,
) -> None:
    ca = SimulatorCA(tmp_path / "ca")
    context = ca.server_context(["api.push.apple.com", "127.0.0.1"], alpn=["h2"])
    owner = EndlessApns()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: EndlessH2Server(owner), "127.0.0.1", 0, ssl=context)
    port = server.sockets[0].getsockname()[1]
    try:
        async with apns_client("127.0.0.1", port, ca.ca_path, tmp_path) as client:
            attempt = await client.send(apns_push())
            # the client resets the stream: the server stops sending
            await asyncio.wait_for(owner.reset_seen.wait(), GUARD)
    finally:
        server.close()
    # Answered with what came (a 400 without a readable reason: transient), not a
    # timeout after `request_timeout` of keeping (and acknowledging) an endless body.
    assert (attempt.outcome, attempt.status, attempt.reason) == (Outcome.TRANSIENT, 400, None)
    assert owner.resets == 1
    assert owner.sent < 1024 * 1024  # what the client's windows allowed before the reset


async def test_a_provider_reason_as_long_as_the_body_is_bounded(
    apns_sim: ApnsSimulator, fcm_sim: FcmSimulator, tmp_path: Path
) -> None:
    """A reason is passed through "as sent": 5 KB of it was kept in every receipt (and
    in the plugins' hooks and the detail). The documented ones are under 30 chars."""
    apns_sim.default = ApnsResponse(400, "Bad" + "Q" * 5000)
    gone = "cd" * 32
    apns_sim.script(gone, ApnsResponse(410, "Gone" + "G" * 5000))  # unknown reason, 410
    fcm_sim.default = FcmResponse(status=400, error_status="INVALID" + "_X" * 4000, message="m")
    apps = {
        "ios": apns_app_config(apns_sim, tmp_path),
        "android": fcm_app_config(fcm_sim, tmp_path, ca_file=str(fcm_sim.ca_path)),
    }
    config = base_config(tmp_path, {"sample": {"apps": apps}}, receipts={"format": "jsonl"})
    async with GatewayHarness(config, extra_plugins={"sample": sample_plugin()}) as gw:
        context = gw.context("sample")
        receipts = [
            await asyncio.wait_for(context.send(push), GUARD)
            for push in (
                Push("sample", "ios", APNS_TOKEN, {"aps": {"alert": "x"}}),
                Push("sample", "android", FCM_TOKEN, {"data": {"k": "v"}}),
            )
        ]
        dead = await asyncio.wait_for(
            context.send(Push("sample", "ios", gone, {"aps": {"alert": "x"}})), GUARD
        )
    assert dead.outcome is Outcome.TOKEN_INVALID
    # the plugin's token-invalid hook is told the bounded reason too
    [invalid] = context.state["invalid"]
    assert invalid.reason == dead.reason
    assert dead.reason is not None and len(dead.reason) == 64 and dead.reason.startswith("GoneG")
    for receipt, prefix in zip(receipts, ("BadQQQ", "INVALID_X_X"), strict=True):
        assert receipt.outcome is Outcome.PERMANENT
        assert receipt.reason is not None and receipt.reason.startswith(prefix)
        assert len(receipt.reason) <= 64 and receipt.reason.endswith("...")
        assert receipt.detail is not None and len(receipt.detail) <= 300
    records = [
        json.loads(line)
        for path in sorted((tmp_path / "receipts").glob("receipts-*.jsonl"))
        for line in path.read_text().splitlines()
    ]
    assert sorted(r["reason"] for r in records) == sorted(r.reason for r in [*receipts, dead])


async def test_an_oauth_token_answer_that_does_not_end_is_not_read_whole(
    tmp_path: Path,
) -> None:
    """google-auth's timeout bounds each read, not the answer: a token endpoint (or a
    proxy in its place) streaming a body without end was read for ever into memory,
    holding the app's only token thread. (The test's body ends after 256 MiB so that
    a regression fails instead of exhausting the machine.)"""
    upstream = EndlessBodies(256 * 1024 * 1024, status=200)
    app = web.Application()
    app.router.add_post("/token", upstream.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    path = tmp_path / "service-account.json"
    make_service_account("egress", f"http://127.0.0.1:{port}/token", path)
    config = FcmAppConfig(
        service_account_file=path,
        send_url=f"http://127.0.0.1:{port}/v1/projects/{{project_id}}/messages:send",
        request_timeout=2.0,
    )
    client = FcmClient("android", config)
    try:
        with new_log_lines() as lines:
            await asyncio.wait_for(client.start(), GUARD)
            await asyncio.wait_for(upstream.finished.wait(), GUARD)
            attempt = await client.send(fcm_push())
    finally:
        await client.close()
        await runner.cleanup()
    assert not client.ready()
    assert (attempt.outcome, attempt.reason) == (Outcome.TRANSIENT, Reason.CONNECTION_ERROR)
    assert attempt.detail == (
        "OAuth token request failed (TransportError: answer over 65536 bytes)"
    )
    assert upstream.written < 16 * 1024 * 1024
    assert "Traceback" not in "\n".join(lines)

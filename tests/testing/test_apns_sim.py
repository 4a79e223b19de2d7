"""The APNs simulator, driven by aioapns (the real client library) and a raw h2 client."""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt as pyjwt
import pytest
from aioapns import APNs, NotificationRequest, PushType
from aioapns.connection import APNsProductionClientProtocol
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RemoteSettingsChanged,
    ResponseReceived,
    StreamEnded,
    StreamReset,
)
from h2.settings import SettingCodes, Settings

from gateway.testing import (
    ApnsAuthKey,
    ApnsResponse,
    ApnsSimulator,
    generate_apns_auth_key,
    serve_simulators,
)

TOKEN = "ab" * 32
OTHER = "cd" * 32


# -- a small independent HTTP/2 client ---------------------------------------------------


@dataclass
class StreamResult:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    data_frames: int = 0
    reset_code: int | None = None

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class RawH2Client:
    """HTTP/2 over TLS with h2, exposing frames a library would hide."""

    def __init__(self) -> None:
        self.h2 = H2Connection(H2Configuration(client_side=True, header_encoding="utf-8"))
        self.results: dict[int, StreamResult] = {}
        self.futures: dict[int, asyncio.Future[StreamResult]] = {}
        self.goaway: ConnectionTerminated | None = None
        self.closed = asyncio.Event()
        self.settings_changed = asyncio.Event()
        self.response_headers = asyncio.Event()
        self.alpn: str | None = None
        self._reader: asyncio.StreamReader
        self._writer: asyncio.StreamWriter
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(
        cls,
        sim: ApnsSimulator,
        server_hostname: str = "api.push.apple.com",
        alpn: list[str] | None = None,
        initial_window: int | None = None,
    ) -> RawH2Client:
        self = cls()
        if initial_window is not None:
            self.h2.local_settings = Settings(
                client=True, initial_values={SettingCodes.INITIAL_WINDOW_SIZE: initial_window}
            )
        ctx = ssl.create_default_context(cafile=str(sim.ca_path))
        if alpn:
            ctx.set_alpn_protocols(alpn)
        self._reader, self._writer = await asyncio.open_connection(
            sim.host, sim.port, ssl=ctx, server_hostname=server_hostname
        )
        self.alpn = self._writer.get_extra_info("ssl_object").selected_alpn_protocol()
        self.h2.initiate_connection()
        self._flush()
        self._task = asyncio.create_task(self._read_loop())
        return self

    def _flush(self) -> None:
        data = self.h2.data_to_send()
        if data and not self._writer.is_closing():
            self._writer.write(data)

    def _finish(self, stream_id: int) -> None:
        fut = self.futures.pop(stream_id, None)
        if fut is not None and not fut.done():
            fut.set_result(self.results[stream_id])

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._reader.read(65536)
                if not data:
                    break
                for event in self.h2.receive_data(data):
                    if isinstance(event, ResponseReceived):
                        result = self.results[event.stream_id]  # type: ignore[index]
                        result.headers = dict(event.headers)  # type: ignore[arg-type]
                        result.status = int(result.headers[":status"])
                        self.response_headers.set()
                    elif isinstance(event, DataReceived):
                        result = self.results[event.stream_id]  # type: ignore[index]
                        result.body += event.data or b""
                        result.data_frames += 1
                        self.h2.acknowledge_received_data(
                            event.flow_controlled_length,
                            event.stream_id,  # type: ignore[arg-type]
                        )
                    elif isinstance(event, StreamEnded):
                        self._finish(event.stream_id)  # type: ignore[arg-type]
                    elif isinstance(event, StreamReset):
                        self.results[event.stream_id].reset_code = event.error_code  # type: ignore[index]
                        self._finish(event.stream_id)  # type: ignore[arg-type]
                    elif isinstance(event, ConnectionTerminated):
                        self.goaway = event
                    elif isinstance(event, RemoteSettingsChanged):
                        self.settings_changed.set()
                self._flush()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            self.closed.set()
            for fut in self.futures.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("connection closed"))
            self.futures.clear()

    def start_request(
        self,
        token: str = TOKEN,
        body: bytes | None = b'{"aps":{}}',
        headers: dict[str, str] | None = None,
        method: str = "POST",
        path: str | None = None,
    ) -> asyncio.Future[StreamResult]:
        stream_id = self.h2.get_next_available_stream_id()
        request_headers = [
            (":method", method),
            (":scheme", "https"),
            (":path", path if path is not None else f"/3/device/{token}"),
            (":authority", "api.push.apple.com"),
        ]
        request_headers += list((headers or {}).items())
        self.h2.send_headers(stream_id, request_headers, end_stream=not body)
        if body:
            self.h2.send_data(stream_id, body, end_stream=True)
        self._flush()
        self.results[stream_id] = StreamResult()
        fut: asyncio.Future[StreamResult] = asyncio.get_running_loop().create_future()
        self.futures[stream_id] = fut
        return fut

    async def request(self, *args: Any, **kwargs: Any) -> StreamResult:
        return await asyncio.wait_for(self.start_request(*args, **kwargs), 5)

    @property
    def max_concurrent_streams(self) -> int:
        return self.h2.remote_settings.max_concurrent_streams

    async def close(self) -> None:
        self._writer.close()
        if self._task is not None:
            await asyncio.wait_for(self._task, 5)


# -- aioapns, the library the gateway builds on ------------------------------------------


def make_aioapns(
    sim: ApnsSimulator, key: ApnsAuthKey, topic: str = "com.example.app", **kwargs: Any
) -> APNs:
    """aioapns pointed at the simulator as specs/providers.md §4.1 prescribes."""

    class SimulatorProtocol(APNsProductionClientProtocol):
        APNS_SERVER = "localhost"  # also the SNI / checked name: the cert names it
        APNS_PORT = sim.port

    client = APNs(
        key=key.private_key_pem,
        key_id=key.key_id,
        team_id=key.team_id,
        topic=topic,
        ssl_context=ssl.create_default_context(cafile=str(sim.ca_path)),
        max_connection_attempts=1,
        **kwargs,
    )
    client.pool.protocol_class = SimulatorProtocol
    return client


@pytest.fixture
def key() -> ApnsAuthKey:
    return generate_apns_auth_key()


@pytest.fixture
async def jwt_sim(key: ApnsAuthKey) -> Any:
    async with ApnsSimulator(jwt_keys={key.key_id: (key.team_id, key)}) as sim:
        yield sim


async def test_aioapns_success_is_recorded(jwt_sim: ApnsSimulator, key: ApnsAuthKey) -> None:
    client = make_aioapns(jwt_sim, key)
    request = NotificationRequest(
        TOKEN, {"aps": {"alert": "hi"}}, priority=5, push_type=PushType.ALERT
    )
    result = await client.send_notification(request)
    assert result.status == "200"
    assert result.notification_id == request.notification_id
    [seen] = await jwt_sim.wait_for_requests(1)
    assert seen.token == TOKEN
    assert seen.status == 200 and seen.reason is None
    assert seen.json == {"aps": {"alert": "hi"}}
    assert seen.headers["apns-topic"] == "com.example.app"
    assert seen.headers["apns-priority"] == "5"
    assert seen.headers["apns-push-type"] == "alert"
    assert seen.headers["apns-id"] == request.notification_id
    assert seen.headers["authorization"].startswith("bearer ")
    assert jwt_sim.connections_opened == 1
    assert jwt_sim.jwts_seen == 1
    assert jwt_sim.requests_for(TOKEN) == [seen]
    assert jwt_sim.requests_for(OTHER) == []


async def test_aioapns_sees_410_with_timestamp(jwt_sim: ApnsSimulator, key: ApnsAuthKey) -> None:
    jwt_sim.script(TOKEN, ApnsResponse.error("Unregistered", timestamp=1_700_000_000_000))
    client = make_aioapns(jwt_sim, key)
    result = await client.send_notification(NotificationRequest(TOKEN, {"aps": {}}))
    assert result.status == "410"
    assert result.description == "Unregistered"
    assert result.timestamp == 1_700_000_000_000


async def test_aioapns_many_concurrent_requests_share_one_jwt(
    jwt_sim: ApnsSimulator, key: ApnsAuthKey
) -> None:
    client = make_aioapns(jwt_sim, key, max_connections=1)
    results = await asyncio.gather(
        *(client.send_notification(NotificationRequest(TOKEN, {"aps": {}})) for _ in range(300))
    )
    assert {r.status for r in results} == {"200"}
    assert jwt_sim.request_count == 300
    assert jwt_sim.jwts_seen == 1
    assert {r.connection_id for r in jwt_sim.requests} == {1}


async def test_aioapns_hangs_on_error_without_body(
    apns_simulator: ApnsSimulator, key: ApnsAuthKey
) -> None:
    """specs/providers.md §4.1: the defect the core must guard with a per-request timeout."""
    apns_simulator.script(TOKEN, ApnsResponse.faulty("no_body", status=410))
    client = make_aioapns(apns_simulator, key)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(
            client.send_notification(NotificationRequest(TOKEN, {"aps": {}})), 0.5
        )
    [seen] = apns_simulator.requests
    assert (seen.status, seen.fault) == (410, "no_body")


# -- answers and error bodies ------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "status", "reason"),
    [
        (ApnsResponse.error("BadDeviceToken"), 400, "BadDeviceToken"),
        (ApnsResponse.error("TopicDisallowed"), 400, "TopicDisallowed"),
        (ApnsResponse.error("ExpiredProviderToken"), 403, "ExpiredProviderToken"),
        (ApnsResponse.error("TooManyProviderTokenUpdates"), 429, "TooManyProviderTokenUpdates"),
        (ApnsResponse(429), 429, "TooManyRequests"),
        (ApnsResponse(500), 500, "InternalServerError"),
        (ApnsResponse.error("Shutdown"), 503, "Shutdown"),
    ],
)
async def test_error_bodies(
    apns_simulator: ApnsSimulator, response: ApnsResponse, status: int, reason: str
) -> None:
    apns_simulator.script(TOKEN, response)
    client = await RawH2Client.connect(apns_simulator)
    apns_id = "0F3D2A6C-8C59-4D7A-9C7E-5F6B1C2D3E4F"
    result = await client.request(headers={"apns-id": apns_id})
    assert result.status == status
    assert result.headers["apns-id"] == apns_id
    assert result.headers["content-type"] == "application/json"
    assert result.json == {"reason": reason}
    await client.close()


async def test_410_body_carries_timestamp_and_apns_id_is_generated(
    apns_simulator: ApnsSimulator,
) -> None:
    apns_simulator.script(TOKEN, ApnsResponse(410))
    client = await RawH2Client.connect(apns_simulator)
    before = int(time.time() * 1000)
    result = await client.request()
    assert result.status == 410
    body = result.json
    assert body["reason"] == "Unregistered"
    assert body["timestamp"] >= before
    assert len(result.headers["apns-id"]) == 36
    await client.close()


async def test_success_has_empty_body(apns_simulator: ApnsSimulator) -> None:
    client = await RawH2Client.connect(apns_simulator)
    result = await client.request()
    assert (result.status, result.body, result.data_frames) == (200, b"", 0)
    await client.close()


async def test_script_is_consumed_in_order_and_last_repeats(
    apns_simulator: ApnsSimulator,
) -> None:
    apns_simulator.script(TOKEN, ApnsResponse(503), ApnsResponse.error("Unregistered"))
    apns_simulator.default = ApnsResponse.error("BadDeviceToken")
    client = await RawH2Client.connect(apns_simulator)
    statuses = [(await client.request()).status for _ in range(3)]
    assert statuses == [503, 410, 410]
    assert (await client.request(OTHER)).status == 400  # default for unscripted tokens
    apns_simulator.script_all(ApnsResponse(500))
    assert (await client.request(OTHER)).status == 500
    await client.close()


async def test_delay_does_not_block_other_streams(apns_simulator: ApnsSimulator) -> None:
    apns_simulator.script(TOKEN, ApnsResponse(delay=0.3))
    client = await RawH2Client.connect(apns_simulator)
    slow = client.start_request(TOKEN)
    fast = client.start_request(OTHER)
    done, _ = await asyncio.wait({slow, fast}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    assert done == {fast}
    assert (await asyncio.wait_for(slow, 5)).status == 200
    await client.close()


# -- request checks ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "status", "reason"),
    [
        ({"body": b"x" * 4097}, 413, "PayloadTooLarge"),
        (
            {"body": b"{}" + b" " * 5119, "headers": {"apns-push-type": "voip"}},
            413,
            "PayloadTooLarge",
        ),
        ({"body": None}, 400, "PayloadEmpty"),
        ({"body": b"not json"}, 400, ApnsSimulator.INVALID_JSON_REASON),
        ({"token": "xyz"}, 400, "BadDeviceToken"),
        ({"token": "abc"}, 400, "BadDeviceToken"),
        ({"path": "/3/device/"}, 400, "MissingDeviceToken"),
        ({"headers": {"apns-priority": "7"}}, 400, "BadPriority"),
        ({"headers": {"apns-push-type": "bogus"}}, 400, "InvalidPushType"),
        ({"headers": {"apns-collapse-id": "c" * 65}}, 400, "BadCollapseId"),
        ({"headers": {"apns-expiration": "soon"}}, 400, "BadExpirationDate"),
        ({"headers": {"apns-id": "not-a-uuid"}}, 400, "BadMessageId"),
        ({"headers": {"authorization": "bearer x"}}, 400, "MissingTopic"),
        ({"method": "GET", "body": None}, 405, "MethodNotAllowed"),
        ({"path": "/3/other/" + TOKEN}, 404, "BadPath"),
    ],
)
async def test_request_checks(
    apns_simulator: ApnsSimulator, kwargs: dict[str, Any], status: int, reason: str
) -> None:
    client = await RawH2Client.connect(apns_simulator)
    result = await client.request(**kwargs)
    assert (result.status, result.json["reason"]) == (status, reason)
    [seen] = apns_simulator.requests
    assert (seen.status, seen.reason) == (status, reason)
    await client.close()


async def test_payload_limits_accept_the_exact_maximum(apns_simulator: ApnsSimulator) -> None:
    client = await RawH2Client.connect(apns_simulator)
    alert = b'{"aps":{}}' + b" " * (4096 - 10)
    assert len(alert) == 4096
    assert (await client.request(body=alert)).status == 200
    voip = b'{"aps":{}}' + b" " * (5120 - 10)
    assert (await client.request(body=voip, headers={"apns-push-type": "voip"})).status == 200
    assert (await client.request(body=voip)).status == 413  # voip size only for voip pushes
    collapse = {"apns-collapse-id": "c" * 64, "apns-priority": "10", "apns-expiration": "0"}
    assert (await client.request(headers=collapse)).status == 200
    await client.close()


async def test_topics_allowlist_accepts_push_type_suffixes() -> None:
    async with ApnsSimulator(topics={"com.example.app"}) as sim:
        client = await RawH2Client.connect(sim)
        ok = await client.request(headers={"apns-topic": "com.example.app.voip"})
        assert ok.status == 200
        bad = await client.request(headers={"apns-topic": "com.other.app"})
        assert (bad.status, bad.json["reason"]) == (400, "TopicDisallowed")
        await client.close()


async def test_duplicate_apns_headers_are_refused(apns_simulator: ApnsSimulator) -> None:
    client = await RawH2Client.connect(apns_simulator)
    stream_id = client.h2.get_next_available_stream_id()
    client.results[stream_id] = StreamResult()
    fut = asyncio.get_running_loop().create_future()
    client.futures[stream_id] = fut
    client.h2.send_headers(
        stream_id,
        [
            (":method", "POST"),
            (":scheme", "https"),
            (":path", f"/3/device/{TOKEN}"),
            (":authority", "api.push.apple.com"),
            ("apns-priority", "10"),
            ("apns-priority", "5"),
        ],
    )
    client.h2.send_data(stream_id, b"{}", end_stream=True)
    client._flush()
    result = await asyncio.wait_for(fut, 5)
    assert (result.status, result.json["reason"]) == (400, "DuplicateHeaders")
    await client.close()


# -- JWT ---------------------------------------------------------------------------------


def sign(
    key: ApnsAuthKey, *, iat: int | None = None, kid: str | None = None, iss: str | None = None
) -> str:
    claims = {"iss": iss or key.team_id, "iat": int(time.time()) if iat is None else iat}
    return pyjwt.encode(
        claims, key.private_key_pem, algorithm="ES256", headers={"kid": kid or key.key_id}
    )


async def test_jwt_checks(key: ApnsAuthKey) -> None:
    now = [time.time()]
    async with ApnsSimulator(
        jwt_keys={key.key_id: (key.team_id, key.private_key_pem)}, clock=lambda: now[0]
    ) as sim:
        client = await RawH2Client.connect(sim)
        topic = {"apns-topic": "com.example.app"}

        async def reason(authorization: str | None) -> str | None:
            headers = dict(topic)
            if authorization is not None:
                headers["authorization"] = authorization
            result = await client.request(headers=headers)
            return None if result.status == 200 else result.json["reason"]

        good = sign(key)
        assert await reason(f"bearer {good}") is None
        assert await reason(None) == "MissingProviderToken"
        assert await reason("bearer garbage") == "InvalidProviderToken"
        assert await reason(f"bearer {sign(key, kid='UNKNOWNKID')}") == "InvalidProviderToken"
        assert await reason(f"bearer {sign(key, iss='OTHERTEAM1')}") == "InvalidProviderToken"
        impostor = generate_apns_auth_key(key.key_id, key.team_id)
        assert await reason(f"bearer {sign(impostor)}") == "InvalidProviderToken"
        tampered = good[:-4] + ("AAAA" if not good.endswith("AAAA") else "BBBB")
        assert await reason(f"bearer {tampered}") == "InvalidProviderToken"
        old = sign(key, iat=int(now[0]) - 3601)
        assert await reason(f"bearer {old}") == "ExpiredProviderToken"
        now[0] += 3601  # the good token ages out too
        assert await reason(f"bearer {good}") == "ExpiredProviderToken"
        fresh = sign(key, iat=int(now[0]))
        no_topic = await client.request(headers={"authorization": f"bearer {fresh}"})
        assert no_topic.json["reason"] == "MissingTopic"
        assert sim.jwts_seen == 8
        await client.close()


# -- connection behaviour ----------------------------------------------------------------


async def test_settings_without_alpn_and_with_alpn() -> None:
    async with ApnsSimulator(max_concurrent_streams=7) as sim:
        plain = await RawH2Client.connect(sim)  # no ALPN at all, like aioapns
        assert plain.alpn is None
        assert (await plain.request()).status == 200
        assert plain.max_concurrent_streams == 7
        negotiated = await RawH2Client.connect(sim, server_hostname="localhost", alpn=["h2"])
        assert negotiated.alpn == "h2"
        assert (await negotiated.request()).status == 200

        plain.settings_changed.clear()
        sim.set_max_concurrent_streams(1)
        await asyncio.wait_for(plain.settings_changed.wait(), 5)
        assert plain.max_concurrent_streams == 1
        assert sim.connections_opened == 2
        assert sim.open_connections == 2
        await plain.close()
        await negotiated.close()


async def test_data_is_acknowledged_for_flow_control() -> None:
    # With a 64 KiB window, 400 KB of bodies only fit if the simulator returns window.
    async with ApnsSimulator(initial_window_size=65535) as sim:
        client = await RawH2Client.connect(sim)
        body = b'{"aps":{}}' + b" " * 3990
        for _ in range(100):
            assert (await client.request(body=body)).status == 200
        assert sim.request_count == 100
        await client.close()


async def test_fault_no_body(apns_simulator: ApnsSimulator) -> None:
    apns_simulator.script(TOKEN, ApnsResponse.faulty("no_body", status=410))
    client = await RawH2Client.connect(apns_simulator)
    result = await client.request()
    assert (result.status, result.body, result.data_frames) == (410, b"", 0)
    await client.close()


async def test_fault_reset(apns_simulator: ApnsSimulator) -> None:
    apns_simulator.script(TOKEN, ApnsResponse.faulty("reset"))
    client = await RawH2Client.connect(apns_simulator)
    result = await client.request()
    assert result.status is None
    assert result.reset_code is not None
    assert (await client.request(OTHER)).status == 200  # the connection survives
    await client.close()


async def test_fault_drop(apns_simulator: ApnsSimulator) -> None:
    apns_simulator.script(TOKEN, ApnsResponse.faulty("drop"))
    client = await RawH2Client.connect(apns_simulator)
    with pytest.raises(ConnectionError):
        await client.request()
    await asyncio.wait_for(client.closed.wait(), 5)
    assert client.goaway is None
    [seen] = await apns_simulator.wait_for_requests(1)
    assert seen.fault == "drop"
    await client.close()


async def test_fault_goaway_carries_reason(apns_simulator: ApnsSimulator) -> None:
    apns_simulator.script(TOKEN, ApnsResponse.faulty("goaway", reason="Shutdown"))
    client = await RawH2Client.connect(apns_simulator)
    with pytest.raises(ConnectionError):
        await client.request()
    await asyncio.wait_for(client.closed.wait(), 5)
    assert client.goaway is not None
    assert json.loads(client.goaway.additional_data or b"") == {"reason": "Shutdown"}
    await client.close()


async def test_error_body_waits_for_client_flow_control_window(
    apns_simulator: ApnsSimulator,
) -> None:
    """Like APNs, the simulator never overruns the client's receive window."""
    apns_simulator.script(TOKEN, ApnsResponse.error("BadDeviceToken"))
    client = await RawH2Client.connect(apns_simulator, initial_window=10)
    pending = client.start_request()
    await asyncio.wait_for(client.response_headers.wait(), 5)
    [(stream_id, result)] = client.results.items()
    assert result.status == 400 and result.body == b"" and not pending.done()
    client.h2.increment_flow_control_window(1000, stream_id)
    client._flush()
    done = await asyncio.wait_for(pending, 5)
    assert done.json == {"reason": "BadDeviceToken"}
    await client.close()


async def test_goaway_all(apns_simulator: ApnsSimulator) -> None:
    client = await RawH2Client.connect(apns_simulator)
    assert (await client.request()).status == 200
    apns_simulator.goaway_all("Shutdown")
    await asyncio.wait_for(client.closed.wait(), 5)
    assert client.goaway is not None
    assert json.loads(client.goaway.additional_data or b"") == {"reason": "Shutdown"}
    assert apns_simulator.open_connections == 0
    await client.close()


async def test_wait_for_requests_times_out(apns_simulator: ApnsSimulator) -> None:
    with pytest.raises(TimeoutError, match="0 of 1"):
        await apns_simulator.wait_for_requests(1, timeout=0.05)


# -- runner ------------------------------------------------------------------------------


async def test_serve_simulators_state_dir_works_with_aioapns(tmp_path: Path) -> None:
    info = await serve_simulators(state_dir=tmp_path)
    try:
        described = json.loads((tmp_path / "simulators.json").read_text())
        assert described["apns_port"] == info.apns_port
        assert Path(described["ca_path"]).read_text().startswith("-----BEGIN CERTIFICATE")
        account = json.loads(info.service_account_path.read_text())
        assert account["token_uri"] == info.token_uri
        assert account["project_id"] == info.project_id
        key = ApnsAuthKey(
            info.apns_key_id,
            info.apns_team_id,
            info.apns_key_path.read_text(),
            generate_apns_auth_key().public_key,  # unused by the client
        )
        client = make_aioapns(info.apns, key)
        result = await client.send_notification(NotificationRequest(TOKEN, {"aps": {}}))
        assert result.status == "200"
        assert info.apns.jwts_seen == 1
    finally:
        await info.stop()


# -- odd requests and early answers ------------------------------------------------------


async def test_early_answer_when_the_body_came_with_the_headers(
    apns_simulator: ApnsSimulator, caplog: pytest.LogCaptureFixture
) -> None:
    """`answer_before_body` for a request whose DATA (with END_STREAM) arrived in the
    same read as its HEADERS, as a small body does: h2 has already half-closed the
    stream, so the answer closes it and there is nothing left to reset. The answer must
    arrive and the connection go on, not die of a StreamClosedError."""
    apns_simulator.answer_before_body = ApnsResponse(413, "PayloadTooLarge")
    client = await RawH2Client.connect(apns_simulator)
    result = await client.request()  # HEADERS and DATA leave in one write
    assert (result.status, result.json) == (413, {"reason": "PayloadTooLarge"})
    apns_simulator.answer_before_body = None
    assert (await client.request()).status == 200
    assert apns_simulator.connections_opened == 1
    assert "Fatal error" not in caplog.text
    await client.close()


async def test_early_answer_echoes_the_apns_id(apns_simulator: ApnsSimulator) -> None:
    """APNs echoes the request's `apns-id` in every answer (specs/providers.md §2.1),
    an early one too."""
    apns_simulator.answer_before_body = ApnsResponse(413, "PayloadTooLarge")
    apns_simulator.reset_after_early_answer = False
    client = await RawH2Client.connect(apns_simulator)
    apns_id = "0f3d2a6c-8c59-4d7a-9c7e-5f6b1c2d3e4f"
    result = await client.request(headers={"apns-id": apns_id})
    assert result.status == 413
    assert result.headers["apns-id"] == apns_id
    await client.close()


async def test_a_header_that_is_not_utf8_gets_a_goaway(
    apns_simulator: ApnsSimulator, caplog: pytest.LogCaptureFixture
) -> None:
    """Odd bytes from the client under test end its connection with GOAWAY
    PROTOCOL_ERROR, as any malformed frame does, not with an exception escaping the
    protocol (logged by asyncio as a fatal error, the TCP connection torn down)."""
    client = await RawH2Client.connect(apns_simulator)
    stream_id = client.h2.get_next_available_stream_id()
    client.results[stream_id] = StreamResult()
    fut: asyncio.Future[StreamResult] = asyncio.get_running_loop().create_future()
    client.futures[stream_id] = fut
    client.h2.send_headers(
        stream_id,
        [
            (b":method", b"POST"),
            (b":scheme", b"https"),
            (b":path", f"/3/device/{TOKEN}".encode()),
            (b":authority", b"api.push.apple.com"),
            (b"apns-topic", b"\xff\xfe"),
        ],
    )
    client.h2.send_data(stream_id, b"{}", end_stream=True)
    client._flush()
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(fut, 5)
    await asyncio.wait_for(client.closed.wait(), 5)
    assert client.goaway is not None
    assert client.goaway.error_code == ErrorCodes.PROTOCOL_ERROR
    assert "Fatal error" not in caplog.text
    assert apns_simulator.open_connections == 0
    await client.close()

"""HTTP semantics of every route pushgw serves (RFC 9110 / 9112), as real clients see them.

One gateway runs the matrix and zulip plugins on the simulators; requests go through
aiohttp's client or, where the bytes on the wire matter (`Connection`, pipelining),
through a raw socket.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import pytest_asyncio

from gateway.testing.apns_sim import ApnsSimulator
from gateway.testing.fcm_sim import FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, fcm_app_config
from tests.zulip.conftest import PREFIX, ZulipServer, zulip_config

NOTIFY = "/_matrix/push/v1/notify"


@asynccontextmanager
async def _gateway(directory: Path, **server: object) -> AsyncIterator[GatewayHarness]:
    """Matrix and Zulip on one gateway, with `server` settings."""
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        config = zulip_config(apns, fcm, directory)
        if server:
            config["server"] = server
        matrix = {
            "apps": {
                "com.example.ios": apns_app_config(apns, directory),
                "com.example.android": fcm_app_config(fcm, directory, project_id="matrix"),
            }
        }
        config["plugins"]["enabled"].append("matrix")
        config["plugins"]["matrix"] = matrix
        async with GatewayHarness(config) as harness:
            yield harness


@pytest_asyncio.fixture
async def gw(tmp_path: Path) -> AsyncIterator[GatewayHarness]:
    async with _gateway(tmp_path) as harness:
        yield harness


@pytest_asyncio.fixture
async def impatient(tmp_path: Path) -> AsyncIterator[GatewayHarness]:
    """A gateway whose `server.body_timeout` comes soon."""
    async with _gateway(tmp_path, body_timeout=0.3) as harness:
        yield harness


async def _exchange(gw: GatewayHarness, request: bytes) -> bytes:
    """Send `request` (one or more pipelined requests) on a fresh connection; every byte
    the gateway answers until it closes the connection, or stops answering."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.client.port)
    try:
        writer.write(request)
        await writer.drain()
        received = b""
        while True:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), 2.0)
            except TimeoutError:  # kept open, nothing more to say
                return received
            if not chunk:
                return received
            received += chunk
    finally:
        writer.close()


def _head(response: bytes) -> tuple[int, dict[str, str]]:
    """Status and headers (names lower-cased) of the first response in `response`."""
    lines = response.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers


# --- Zulip: a known endpoint asked with another method ----------------------------------


@pytest.mark.parametrize(
    ("method", "endpoint", "allowed"),
    [
        ("GET", "push/notify", ["POST"]),
        ("PUT", "push/e2ee/register", ["POST"]),
        ("DELETE", "server/register", ["POST"]),
        ("POST", "server/analytics/status", ["GET", "HEAD"]),
    ],
)
async def test_zulip_known_endpoint_with_another_method_is_405_with_allow(
    gw: GatewayHarness, method: str, endpoint: str, allowed: list[str]
) -> None:
    """RFC 9110 §15.5.6: the endpoint exists, so 405 and `Allow`, as Zulip's bouncer
    answers (`json_method_not_allowed`); not 404 "Endpoint not found", which sends an
    operator looking for a proxy that drops the route."""
    server = ZulipServer(gw.client)
    await server.register()
    resp = await gw.client.request(method, PREFIX + endpoint, headers=server.auth)
    assert resp.status == 405
    assert resp.content_type == "application/json"
    assert [m.strip() for m in resp.headers["Allow"].split(",")] == allowed
    body = await resp.json()
    assert body["result"] == "error" and body["msg"] == "Method Not Allowed"
    assert body["allowed_methods"] == allowed


async def test_zulip_unknown_endpoint_is_still_404(gw: GatewayHarness) -> None:
    for method, endpoint in (("GET", "server/billing"), ("POST", "push/notify/"), ("PUT", "x")):
        resp = await gw.client.request(method, PREFIX + endpoint)
        assert resp.status == 404, (method, endpoint)
        assert "Allow" not in resp.headers
        assert (await resp.json())["msg"] == "Endpoint not found"


# --- a body that does not decode: the connection is closed, and says so -----------------


def _bad_gzip_post(path: str, content_type: str, extra: str = "") -> bytes:
    body = b'{"not": "gzip"}'
    head = (
        f"POST {path} HTTP/1.1\r\nHost: pushgw\r\nContent-Type: {content_type}\r\n"
        f"Content-Encoding: gzip\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


@pytest.mark.parametrize(
    ("path", "content_type", "expected"),
    [
        (NOTIFY, "application/json", 400),
        (PREFIX + "server/register", "application/x-www-form-urlencoded", 400),
        ("/healthz", "application/json", 405),
    ],
)
async def test_undecodable_body_answer_announces_connection_close(
    gw: GatewayHarness, path: str, content_type: str, expected: int
) -> None:
    """aiohttp cannot go on with a connection whose body failed to decode: it closes it
    after the answer. The answer must say `Connection: close` (RFC 9112 §9.6), or a
    client that keeps connections alive (Synapse's pool, Zulip's `requests` session)
    sends its next request on a dead connection and fails it as a network error; a
    pipelined request is dropped unanswered."""
    pipelined = b"GET /healthz HTTP/1.1\r\nHost: pushgw\r\n\r\n"
    received = await _exchange(gw, _bad_gzip_post(path, content_type) + pipelined)
    status, headers = _head(received)
    assert status == expected
    assert headers.get("connection", "").lower() == "close", received
    assert received.count(b"HTTP/1.1 ") == 1  # the pipelined request was not answered


async def test_next_request_after_undecodable_body_succeeds(gw: GatewayHarness) -> None:
    """What a keep-alive client sees: its next request on the same session works."""
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    first = await gw.client.post(NOTIFY, data=b'{"not": "gzip"}', headers=headers)
    assert first.status == 400
    await first.read()
    second = await gw.client.get("/healthz")
    assert second.status == 200


# --- a body that does not come in time: 408 in the protocol's own terms ------------------


def _partial(path: str, content_type: str, auth: dict[str, str] | None = None) -> bytes:
    """Headers announcing 100 bytes of body, and 10 of them: the rest never comes."""
    extra = "".join(f"{name}: {value}\r\n" for name, value in (auth or {}).items())
    return (
        f"POST {path} HTTP/1.1\r\nHost: pushgw\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: 100\r\n{extra}\r\n0123456789"
    ).encode()


@pytest.mark.parametrize(
    ("endpoint", "content_type"),
    [
        ("server/register", "application/x-www-form-urlencoded"),  # a form, no auth
        ("push/notify", "application/json"),  # JSON, authenticated
    ],
)
async def test_zulip_body_timeout_is_408_in_zulip_envelope(
    impatient: GatewayHarness, endpoint: str, content_type: str
) -> None:
    """A Zulip server reads `msg` of every 4xx it gets (`send_to_push_bouncer`): the
    core's `{"error": ...}` made that a KeyError in its push worker."""
    server = ZulipServer(impatient.client)
    await server.register()
    received = await _exchange(impatient, _partial(PREFIX + endpoint, content_type, server.auth))
    status, headers = _head(received)
    assert status == 408
    assert headers["content-type"].startswith("application/json")
    assert headers.get("connection", "").lower() == "close"
    body = json.loads(received.split(b"\r\n\r\n", 1)[1])
    assert body["result"] == "error" and body["code"] == "BAD_REQUEST"
    assert "did not come in time" in body["msg"]


async def test_matrix_body_timeout_is_still_the_core_408(impatient: GatewayHarness) -> None:
    received = await _exchange(impatient, _partial(NOTIFY, "application/json"))
    status, headers = _head(received)
    assert status == 408 and headers.get("connection", "").lower() == "close"


# --- checked and found right: kept so that they stay right -------------------------------


async def test_head_on_get_routes_has_headers_and_no_body(gw: GatewayHarness) -> None:
    for path in ("/healthz", "/readyz", "/metrics", "/health"):
        get = await gw.client.get(path)
        head = await gw.client.head(path)
        assert head.status == get.status == 200, path
        assert head.headers.get("Content-Type") == get.headers.get("Content-Type"), path
        assert await head.read() == b"", path


async def test_matrix_notify_other_methods_405_allow_post(gw: GatewayHarness) -> None:
    for method in ("GET", "HEAD", "PUT", "OPTIONS"):
        resp = await gw.client.request(method, NOTIFY)
        assert resp.status == 405, method
        assert resp.headers["Allow"] == "POST", method


@pytest.mark.parametrize(
    "content_type",
    ["application/json; charset=utf-8", "APPLICATION/JSON", "text/plain", None],
)
async def test_matrix_notify_content_type_not_checked(
    gw: GatewayHarness, content_type: str | None
) -> None:
    """matrix.md §1: the request's Content-Type is not checked (Sygnal does not)."""
    body = {"notification": {"devices": [{"app_id": "unknown.app", "pushkey": "k"}]}}
    headers = {"Content-Type": content_type} if content_type else {}
    resp = await gw.client.post(
        NOTIFY, data=json.dumps(body).encode(), headers=headers, skip_auto_headers=["Content-Type"]
    )
    assert resp.status == 200
    assert await resp.json() == {"rejected": ["k"]}

"""Error shapes review: every error pushgw's HTTP endpoints give, in the terms the real
peer of each protocol parses.

- Zulip: a Zulip server reads every 4xx of the bouncer as JSON and takes its `msg`
  (`orjson.loads(res.content)["msg"]`, zerver/lib/remote_server.py
  `send_to_push_bouncer`), then acts on `code`; a body that is not that envelope is a
  traceback in its worker, and on the analytics calls switches its realms' push off.
- Matrix: Synapse fails the attempt on any non-2xx and retries; Sygnal answers its 400s
  in plain text, and the Push Gateway API's unknown endpoint / method is `M_UNRECOGNIZED`.

One gateway runs both plugins on the simulators. The test that names a finding failed
against the code it fixes; the others pin the shapes so that they cannot drift.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from gateway.testing.apns_sim import ApnsSimulator
from gateway.testing.fcm_sim import FcmSimulator
from gateway.testing.harness import GatewayHarness, apns_app_config, fcm_app_config
from tests.zulip.conftest import PREFIX, ZulipServer, fcm_token, zulip_config

NOTIFY = "/_matrix/push/v1/notify"
UNRECOGNIZED = {"errcode": "M_UNRECOGNIZED", "error": "Unrecognized request"}


@pytest_asyncio.fixture
async def gw(tmp_path: Path) -> AsyncIterator[GatewayHarness]:
    async with ApnsSimulator() as apns, FcmSimulator() as fcm:
        config = zulip_config(apns, fcm, tmp_path)
        config["plugins"]["enabled"].append("matrix")
        config["plugins"]["matrix"] = {
            "apps": {
                "com.example.ios": apns_app_config(apns, tmp_path),
                "com.example.android": fcm_app_config(fcm, tmp_path, project_id="matrix"),
            }
        }
        async with GatewayHarness(config) as harness:
            yield harness


def _zulip_error(status: int, content_type: str, raw: bytes) -> dict[str, object]:
    """The body of a Zulip error answer, checked to be what a Zulip server parses."""
    assert content_type == "application/json", (status, raw[:200])
    body = json.loads(raw)
    assert body["result"] == "error", body
    assert isinstance(body["msg"], str) and body["msg"], body
    assert isinstance(body["code"], str) and body["code"], body
    return body


# --- finding: an encoded slash under the Zulip prefix ------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "push%2Fnotify"),
        ("GET", "push%2Fnotify"),
        ("POST", "push%2fe2ee%2Fnotify"),
        ("GET", "server%2Fanalytics%2Fstatus"),
        ("HEAD", "server%2Fanalytics%2Fstatus"),
    ],
)
async def test_zulip_encoded_slash_is_an_unknown_endpoint_not_a_405_naming_the_method(
    gw: GatewayHarness, method: str, path: str
) -> None:
    """`push%2Fnotify` matches no endpoint's route (aiohttp routes on the path with an
    encoded slash kept), but the catch-all read its decoded `tail` and answered 405
    `Allow: POST` to a POST: an answer that contradicts itself (RFC 9110 §15.5.6, the
    method used is the one the resource does not support), and that sends a Zulip
    operator hunting for a proxy that rewrites methods. It is an unknown path: 404."""
    server = ZulipServer(gw.client)
    await server.register()
    resp = await gw.client.request(method, PREFIX + path, headers=server.auth)
    assert resp.status == 404
    assert "Allow" not in resp.headers
    if method != "HEAD":
        body = _zulip_error(resp.status, resp.content_type, await resp.read())
        assert body["msg"] == "Endpoint not found"


async def test_zulip_decoded_characters_still_reach_the_endpoint(gw: GatewayHarness) -> None:
    """The fix keys on the routed path, not the raw one: an encoded unreserved character
    (`%79` is `y`) still names the endpoint, as for its own route (405 with `Allow`)."""
    resp = await gw.client.get(PREFIX + "push/notif%79")
    assert resp.status == 405
    assert resp.headers["Allow"] == "POST"
    body = _zulip_error(resp.status, resp.content_type, await resp.read())
    assert body["allowed_methods"] == ["POST"]


# --- Zulip: every client mistake under the prefix is the envelope, never a 5xx -----------

_ENDPOINTS = [
    "server/register",
    "server/analytics",
    "server/analytics/status",
    "push/register",
    "push/unregister",
    "push/unregister/all",
    "push/notify",
    "push/test_notification",
    "push/e2ee/register",
    "push/e2ee/notify",
    "server/billing",
    "",
    "push/",
]
_METHODS = ["GET", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"]
# (`server/deactivate` is left out: its POST succeeds with any body, and every later
# authenticated request would be the deactivated server's 401.)


def _bodies(token: str) -> list[tuple[str | None, bytes | None]]:
    """Wrong content types, bad JSON, JSON of the wrong shape, forms with bad fields: each
    carrying a device token, which no error may echo."""
    return [
        (None, None),
        ("application/json", b"{bad"),
        ("application/json", json.dumps([token]).encode()),
        ("application/json", json.dumps({"token": token, "token_kind": 9}).encode()),
        ("application/json", b'{"user_id": 1e999}'),
        ("application/x-www-form-urlencoded", f"token={token}&token_kind=7&user_id=x".encode()),
        ("application/x-www-form-urlencoded; charset=no-such", f"token={token}".encode()),
        ("multipart/form-data", f"token={token}".encode()),  # no boundary
        ("text/plain", token.encode() + b"\x00\xff"),
    ]


@pytest.mark.parametrize("authenticated", [True, False])
async def test_zulip_every_client_mistake_is_the_zulip_envelope(
    gw: GatewayHarness, authenticated: bool, register_secret: object
) -> None:
    server = ZulipServer(gw.client)
    await server.register()
    token = fcm_token()
    register_secret(token)  # type: ignore[operator]
    headers = server.auth if authenticated else dict(server.headers)
    seen = set()
    for endpoint, method, (content_type, body) in itertools.product(
        _ENDPOINTS, _METHODS, _bodies(token)
    ):
        sent = {**headers, **({"Content-Type": content_type} if content_type else {})}
        resp = await gw.client.request(method, PREFIX + endpoint, headers=sent, data=body)
        raw = await resp.read()
        where = (method, endpoint, content_type, resp.status)
        assert resp.status < 500, (where, raw[:200])
        assert token.encode() not in raw, where
        if resp.status < 400:
            continue
        error = _zulip_error(resp.status, resp.content_type, raw)
        seen.add((resp.status, error["code"]))
        if resp.status == 405:
            allowed = [m.strip() for m in resp.headers["Allow"].split(",")]
            assert method not in allowed, where
            assert error["allowed_methods"] == allowed, where
        if resp.status == 401:
            assert error["code"] == "UNAUTHORIZED", where
            assert resp.headers["WWW-Authenticate"] == 'Basic realm="zulip"', where
    # The sweep reached the answers a Zulip server tells apart, not one kind of error.
    assert {(404, "BAD_REQUEST"), (405, "BAD_REQUEST"), (400, "BAD_REQUEST")} <= seen
    assert ((401, "UNAUTHORIZED") in seen) is not authenticated


async def test_zulip_head_answers_have_status_and_no_body(gw: GatewayHarness) -> None:
    server = ZulipServer(gw.client)
    await server.register()
    for path, headers, status in [
        ("push/notify", server.auth, 405),  # a POST endpoint
        ("nothing/here", server.auth, 404),
        ("server/analytics/status", {}, 401),  # GET endpoint, no credentials
        ("server/analytics/status", server.auth, 200),
    ]:
        resp = await gw.client.head(PREFIX + path, headers=headers)
        assert resp.status == status, path
        assert await resp.read() == b""
        assert resp.content_type == "application/json", path


# --- Matrix: Sygnal's plain-text 400s, M_UNRECOGNIZED, 413; no pushkey echoed ------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "Expected JSON request body"),
        (b"{bad", "Expected JSON request body"),
        (b"\xff\xfe", "Expected JSON request body"),
        (b'{"notification": NaN}', "Expected JSON request body"),
        (b"[]", "Invalid notification: expecting object in 'notification' key"),
        (b'{"notification": []}', "Invalid notification: expecting object in 'notification' key"),
        (b'{"notification": {}}', "Expected list in 'devices' key"),
        (b'{"notification": {"devices": []}}', "No devices in notification"),
        (
            b'{"notification": {"devices": [{"pushkey": "PUSHKEY"}]}}',
            "Device with missing or non-string app_id",
        ),
        (
            b'{"notification": {"devices": [{"app_id": "com.example.ios", "pushkey": 5}]}}',
            "Device with missing or non-string pushkey",
        ),
    ],
)
async def test_matrix_bad_bodies_are_sygnals_plain_text_400(
    gw: GatewayHarness, body: bytes, message: str
) -> None:
    # Content-Type is not checked (Sygnal reads any): the answer is the same under each.
    for content_type in ("application/json", "text/plain"):
        resp = await gw.client.post(NOTIFY, data=body, headers={"Content-Type": content_type})
        assert resp.status == 400
        assert resp.content_type == "text/plain"
        text = await resp.text()
        assert text == message
        assert "PUSHKEY" not in text


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH", "OPTIONS"])
async def test_matrix_other_method_on_notify_is_405_unrecognized(
    gw: GatewayHarness, method: str
) -> None:
    resp = await gw.client.request(method, NOTIFY)
    assert resp.status == 405
    assert resp.headers["Allow"] == "POST"
    assert resp.content_type == "application/json"
    assert await resp.json() == UNRECOGNIZED


@pytest.mark.parametrize(
    "path", ["/_matrix/push/v1/notifyx", "/_matrix/push/v2/notify", "/_matrix/push/v1%2Fnotify"]
)
async def test_matrix_unknown_push_path_is_404_unrecognized(gw: GatewayHarness, path: str) -> None:
    for method in ("GET", "POST"):
        resp = await gw.client.request(method, path, data=b"{}")
        assert resp.status == 404, (method, path)
        assert await resp.json() == UNRECOGNIZED


async def test_matrix_oversize_body_is_413_and_the_connection_goes_on(
    gw: GatewayHarness,
) -> None:
    resp = await gw.client.post(NOTIFY, data=b"x" * (512 * 1024 + 1))
    assert resp.status == 413
    assert await resp.text() == "Request body too large"
    # The same client's next request is answered (the unread body did not poison it).
    resp = await gw.client.get("/health")
    assert resp.status == 200
